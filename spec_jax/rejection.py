"""The lossless rejection sampler (being written)."""


def rejection_sample(key, draft_tokens, draft_probs, target_probs, draft_lengths=None):
  raise NotImplementedError
