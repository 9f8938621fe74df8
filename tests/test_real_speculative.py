"""Speculative decoding on the real checkpoints of ../shared/models.

Greedy speculative output must equal greedy plain output token for token, batched with ragged
prompts: stories260K with the salty279K draft model and with n-gram lookup, tinystories656K
with n-gram lookup. Also the classic mistake: a draft with another vocabulary is refused.
"""

import pytest

import spec_jax as sj

PROMPTS = ["Once upon a time", "Tom and his dog went to the park. Tom saw a big tree",
           "Lily liked to", "One day, a little bird"]
GREEDY = sj.Sampling(temperature=0.0)
NEW = 48


def _check_equal(target, drafter, k):
  plain = sj.generate(target, PROMPTS, max_new_tokens=NEW, sampling=GREEDY, stop_tokens=[])
  spec = sj.generate(target, PROMPTS, drafter=drafter, num_draft=k, max_new_tokens=NEW,
                     sampling=GREEDY, stop_tokens=[])
  assert spec.tokens == plain.tokens
  assert spec.text == plain.text
  return spec.stats


@pytest.mark.parametrize("k", [2, 5])
def test_stories260k_with_salty279k_draft(stories260k, salty279k, k):
  stats = _check_equal(stories260k, sj.drafters.DraftModel(salty279k), k)
  assert stats.accepted > 0 and stats.mean_accepted_length > 1.2, stats.summary()


def test_stories260k_with_ngram(stories260k):
  stats = _check_equal(stories260k, sj.drafters.NGram(), 4)
  assert stats.drafted > 0, stats.summary()


def test_tinystories656k_with_ngram(tinystories656k):
  stats = _check_equal(tinystories656k, sj.drafters.NGram(), 3)
  assert stats.drafted > 0, stats.summary()


def test_stories260k_known_text_through_generate(stories260k):
  out = sj.generate(stories260k, ["Once upon a time"], max_new_tokens=40, sampling=GREEDY)
  assert ("Once upon a time" + out.text[0]).startswith(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park. One day, she saw a big, red ball")


def test_draft_with_another_tokenizer_is_refused(stories260k, tinystories656k):
  with pytest.raises(ValueError, match="vocabulary"):
    sj.generate(stories260k, PROMPTS, drafter=sj.drafters.DraftModel(tinystories656k))
  with pytest.raises(ValueError, match="vocabulary"):
    sj.generate(tinystories656k, PROMPTS, drafter=sj.drafters.DraftModel(stories260k))


def test_same_size_but_different_pieces_is_refused(stories260k, salty279k):
  """Same vocabulary size, different token strings: refused by the piece comparison."""
  import copy
  other = copy.copy(salty279k)
  tok = copy.copy(salty279k.tokenizer)
  pieces = list(tok.pieces())
  pieces[300], pieces[301] = pieces[301], pieces[300]
  tok.pieces = lambda: pieces
  other.tokenizer = tok
  with pytest.raises(ValueError, match="tokenizer differs"):
    sj.generate(stories260k, PROMPTS, drafter=sj.drafters.DraftModel(other))
