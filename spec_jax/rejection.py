"""The lossless rejection sampler of speculative decoding.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen
et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"): a draft
token x ~ q is accepted with probability min(1, p(x) / q(x)); on rejection the replacement is
drawn from the residual distribution

    r(x) = max(p(x) - q(x), 0) / (1 - beta),     beta = sum_x min(p(x), q(x)),

where 1 - beta = sum_x max(p(x) - q(x), 0) is the rejection probability. The emitted token then
has exactly the target's distribution:

    P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - beta) r(x)
              = min(p(x), q(x)) + max(p(x) - q(x), 0) = p(x).

Applied position by position along the draft (each position conditioned on all earlier ones
having been accepted, which is what target_probs[b, i] is when the verifier ran on the drafted
prefix), the emitted sequence has the target's joint distribution. When every draft is
accepted, one more "bonus" token is drawn from the target at the next position for free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sampling


def rejection_sample(key, draft_tokens, draft_probs, target_probs, draft_lengths=None):
  """Verifies a block of drafted tokens against the target without changing its distribution.

  Args:
    key: a jax.random key.
    draft_tokens: int32 [B, K], the drafted tokens. Entries at positions >= draft_lengths[b]
      are ignored and may hold anything (e.g. -1); out-of-vocabulary entries at valid
      positions are treated as rejected.
    draft_probs: float [B, K, V], the distributions q the drafts were sampled from, or None for
      deterministic drafts (q one-hot at the draft token: accepted with probability p(x), the
      residual is p with x zeroed, renormalised).
    target_probs: float [B, K+1, V], the target's distributions p at the K draft positions and
      the bonus position (target_probs[b, i] conditioned on drafts[b, :i]).
    draft_lengths: int32 [B] in [0, K], the number of valid drafts per row; None = all K.

  Returns:
    tokens: int32 [B, K+1]. With n = n_accepted[b]: tokens[b, :n] are the accepted drafts,
      tokens[b, n] is the correction token drawn from norm(max(p_n - q_n, 0)) when draft n was
      rejected, or the bonus token drawn from p_n when n == draft_lengths[b];
      tokens[b, n+1:] = -1.
    n_accepted: int32 [B], in [0, draft_lengths[b]]: the index of the first rejection.

  Jit-compatible: fixed shapes, no Python loop over K. K = 0 is plain sampling from
  target_probs[:, 0].
  """
  draft_tokens, draft_probs, target_probs, draft_lengths = _check_inputs(
      draft_tokens, draft_probs, target_probs, draft_lengths)
  batch, num_draft = draft_tokens.shape
  vocab = target_probs.shape[-1]
  # In int32 before any comparison with V: a narrow integer dtype (uint8 tokens, V = 300)
  # wrapped V - 1 around and rejected every valid draft.
  draft_tokens = draft_tokens.astype(jnp.int32)

  p = target_probs.astype(jnp.float32)                                   # [B, K+1, V]
  positions = jnp.arange(num_draft, dtype=jnp.int32)                     # [K]
  if draft_lengths is None:
    lengths = jnp.full((batch,), num_draft, jnp.int32)
  else:
    lengths = jnp.clip(draft_lengths.astype(jnp.int32), 0, num_draft)
  valid = positions[None, :] < lengths[:, None]                          # [B, K]
  in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)
  # Never index with a raw draft token: padding may be -1 or garbage.
  safe_tokens = jnp.clip(draft_tokens, 0, vocab - 1).astype(jnp.int32)  # [B, K]

  key_accept, key_final = jax.random.split(key)

  # Accept draft i with probability min(1, p_i(x_i) / q_i(x_i)), written u * q < p so that no
  # division happens. u in [0, 1): p(x) >= q(x) always accepts; p(x) = 0 never accepts (so a
  # one-hot greedy p reduces to exact matching); q(x) = 0 < p(x), a token q could not have
  # proposed, accepts (the limit of p/q -> inf).
  p_draft = jnp.take_along_axis(p[:, :num_draft], safe_tokens[..., None], axis=-1)[..., 0]
  if draft_probs is None:
    q_draft = jnp.ones_like(p_draft)
  else:
    q_draft = jnp.take_along_axis(draft_probs.astype(jnp.float32), safe_tokens[..., None],
                                  axis=-1)[..., 0]
  u = jax.random.uniform(key_accept, (batch, num_draft), jnp.float32)
  accept = (u * q_draft < p_draft) & valid & in_vocab                    # [B, K]

  # First rejection: the length of the all-accepted prefix (cumprod of the accept mask).
  n_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

  # The final token's distribution: p at position n, minus q there when n was a rejection.
  p_final = jnp.take_along_axis(p, n_accepted[:, None, None], axis=1)[:, 0]   # [B, V]
  if num_draft > 0:
    rejected = n_accepted < lengths                                      # else: bonus token
    at = jnp.minimum(n_accepted, num_draft - 1)
    # An out-of-vocabulary draft was never judged: its replacement comes from p (q taken as
    # 0 there), not from a residual of a draw that did not happen.
    token_ok = jnp.take_along_axis(in_vocab, at[:, None], axis=1)[:, 0]
    if draft_probs is None:
      token_at = jnp.take_along_axis(safe_tokens, at[:, None], axis=1)[:, 0]
      q_final = jax.nn.one_hot(token_at, vocab, dtype=jnp.float32) * token_ok[:, None]
    else:
      q_final = jnp.take_along_axis(draft_probs.astype(jnp.float32), at[:, None, None],
                                    axis=1)[:, 0] * token_ok[:, None]
    residual = jnp.maximum(p_final - q_final, 0.0)
    # p == q gives an all-zero residual; that branch has probability 0 of being taken (it
    # needs a rejection, i.e. p(x) < q(x)) but must not yield NaN: fall back to p.
    has_mass = jnp.sum(residual, axis=-1) > 0
    use_residual = (rejected & has_mass)[:, None]
    final_probs = jnp.where(use_residual, residual, p_final)
  else:
    final_probs = p_final
  # categorical on log-probabilities normalises, so the residual needs no explicit division;
  # log(0) = -inf (never NaN: final_probs >= 0).
  final_token = sampling.sample(key_final, final_probs)                 # [B]

  out_positions = jnp.arange(num_draft + 1, dtype=jnp.int32)[None, :]   # [1, K+1]
  drafts_padded = jnp.pad(safe_tokens, ((0, 0), (0, 1)))
  tokens = jnp.where(out_positions < n_accepted[:, None], drafts_padded,
                     jnp.where(out_positions == n_accepted[:, None], final_token[:, None], -1))
  return tokens.astype(jnp.int32), n_accepted


def _check_inputs(draft_tokens, draft_probs, target_probs, draft_lengths):
  """Shape and dtype checks at the boundary (static, before anything runs)."""
  draft_tokens = jnp.asarray(draft_tokens)
  target_probs = jnp.asarray(target_probs)
  if draft_tokens.ndim != 2:
    raise ValueError(f"draft_tokens must be [B, K], got shape {draft_tokens.shape}")
  if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
    raise ValueError(f"draft_tokens must be an integer array, got dtype {draft_tokens.dtype}")
  batch, num_draft = draft_tokens.shape
  if target_probs.ndim != 3 or target_probs.shape[:2] != (batch, num_draft + 1):
    raise ValueError(f"target_probs must be [B, K+1, V] = [{batch}, {num_draft + 1}, V] for "
                     f"draft_tokens of shape {draft_tokens.shape}, got {target_probs.shape}")
  if not jnp.issubdtype(target_probs.dtype, jnp.floating):
    raise ValueError(f"target_probs must be floating point, got dtype {target_probs.dtype}")
  vocab = target_probs.shape[-1]
  if vocab < 1:
    raise ValueError("target_probs has an empty vocabulary axis")
  if draft_probs is not None:
    draft_probs = jnp.asarray(draft_probs)
    if draft_probs.shape != (batch, num_draft, vocab):
      raise ValueError(f"draft_probs must be [B, K, V] = [{batch}, {num_draft}, {vocab}] or "
                       f"None (deterministic drafts), got {draft_probs.shape}")
    if not jnp.issubdtype(draft_probs.dtype, jnp.floating):
      raise ValueError(f"draft_probs must be floating point, got dtype {draft_probs.dtype}")
  if draft_lengths is not None:
    if not isinstance(draft_lengths, jax.core.Tracer):
      values = np.asarray(draft_lengths)
      if values.shape != (batch,):
        raise ValueError(f"draft_lengths must be [B] = [{batch}], got shape {values.shape}")
      if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"draft_lengths must be integers, got dtype {values.dtype}")
      if values.size and (values.min() < 0 or values.max() > num_draft):
        raise ValueError(f"draft_lengths must lie in [0, K={num_draft}], got values from "
                         f"{values.min()} to {values.max()}")
    draft_lengths = jnp.asarray(draft_lengths)
    if draft_lengths.shape != (batch,):
      raise ValueError(f"draft_lengths must be [B] = [{batch}], got shape {draft_lengths.shape}")
  return draft_tokens, draft_probs, target_probs, draft_lengths
