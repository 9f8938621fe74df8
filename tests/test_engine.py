"""The engine on small random models: greedy equality, ragged batches, stops, limits, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import engine
from spec_jax.drafters.base import DraftContext

CFG = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=256)
PROMPTS = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = sj.Sampling(temperature=0.0)


@functools.lru_cache(None)
def models():
  target = sj.init_model(CFG, jax.random.key(1))
  target.params["embed"] = target.params["embed"] * 40  # peaky logits: a non-trivial argmax path
  draft = sj.init_model(CFG.replace(num_layers=1), jax.random.key(3))
  draft.params["embed"] = draft.params["embed"] * 40
  return target, draft


@functools.lru_cache(None)
def plain_greedy(max_new=24):
  target, _ = models()
  return sj.generate(target, PROMPTS, max_new_tokens=max_new, sampling=GREEDY, stop_tokens=[])


def test_plain_decoding_matches_full_forward_argmax():
  """K=0 through the engine equals argmax decoding by re-running the whole sequence (no cache
  reuse: one causal forward over the padded sequence per step, read at its last real token)."""
  target, _ = models()
  out = plain_greedy()
  width = 64

  @jax.jit
  def next_token(params, seq, n):
    cache = sj.KVCache.zeros(CFG, 1, width)
    logits = sj.forward(params, CFG, seq[None], cache, jnp.zeros(1, jnp.int32)).logits
    return jnp.argmax(logits[0, n - 1])

  for prompt, new in zip(PROMPTS, out.tokens):
    seq = list(prompt)
    for _ in range(len(new)):
      padded = jnp.asarray(seq + [0] * (width - len(seq)), jnp.int32)
      seq.append(int(next_token(target.params, padded, len(seq))))
    assert seq[len(prompt):] == new
  assert out.stats.mean_accepted_length == 1.0 and out.stats.drafted == 0


def test_ragged_batch_equals_each_prompt_alone():
  target, _ = models()
  batched = plain_greedy()
  for i, prompt in enumerate(PROMPTS):
    alone = sj.generate(target, [prompt], max_new_tokens=24, sampling=GREEDY, stop_tokens=[])
    assert alone.tokens[0] == batched.tokens[i]


@pytest.mark.parametrize("make", [
    lambda t, d: sj.drafters.NGram(),
    lambda t, d: sj.drafters.NGram(max_ngram=4, min_ngram=2),
    lambda t, d: sj.drafters.DraftModel(d),
    lambda t, d: sj.drafters.DraftModel(t),      # self-drafting: every draft accepted
], ids=["ngram", "ngram42", "draft", "self"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_equals_plain(make, k):
  target, draft = models()
  spec = sj.generate(target, PROMPTS, drafter=make(target, draft), num_draft=k,
                     max_new_tokens=24, sampling=GREEDY, stop_tokens=[])
  assert spec.tokens == plain_greedy().tokens
  assert all(len(t) == 24 for t in spec.tokens)


def test_self_draft_accepts_everything_and_stats_add_up():
  target, _ = models()
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(target), num_draft=3,
                    max_new_tokens=25, sampling=GREEDY, stop_tokens=[])
  s = out.stats
  assert s.acceptance_rate == 1.0 and s.mean_accepted_length == 4.0
  assert s.accepted_at == (1.0, 1.0, 1.0)
  # 25 new tokens = 1 from the prefill + 6 rounds of 4 per row.
  assert s.rounds == 3 * 6 and s.new_tokens == 75 and s.iterations == 6


def test_stop_token_inside_an_accepted_block_ends_the_row():
  target, _ = models()
  ref = plain_greedy().tokens
  stop = ref[0][5]           # a token that row 0 emits at its 6th step
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(target), num_draft=4,
                    max_new_tokens=24, sampling=GREEDY, stop_tokens=[stop])
  for r, o in zip(ref, out.tokens):
    cut = r.index(stop) + 1 if stop in r else len(r)
    assert o == r[:cut]


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_never_more_than_max_new_tokens(max_new):
  target, _ = models()
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(target), num_draft=4,
                    max_new_tokens=max_new, sampling=GREEDY, stop_tokens=[])
  assert [len(t) for t in out.tokens] == [max_new] * 3
  assert out.tokens == [t[:max_new] for t in plain_greedy().tokens]


def test_results_do_not_depend_on_batch_composition():
  """Row streams are fold_in(key, row): a sampled row is the same whatever its neighbours."""
  target, draft = models()
  s = sj.Sampling(temperature=1.0)
  a = sj.generate(target, [PROMPTS[0], PROMPTS[1]], drafter=sj.drafters.DraftModel(draft),
                  num_draft=3, max_new_tokens=16, sampling=s, key=jax.random.key(5), stop_tokens=[])
  b = sj.generate(target, [PROMPTS[0], PROMPTS[2]], drafter=sj.drafters.DraftModel(draft),
                  num_draft=3, max_new_tokens=16, sampling=s, key=jax.random.key(5), stop_tokens=[])
  assert a.tokens[0] == b.tokens[0]


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
  drafter = sj.drafters.NGram(max_ngram=3, min_ngram=1)
  tokens = jnp.asarray([[5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7, 0, 0, 0],
                        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0, 0, 0, 0, 0],
                        [3, 9, 3, 4, 4, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.asarray([13, 10, 6], jnp.int32)
  ctx = DraftContext(key=jax.random.key(0), tokens=tokens, lengths=lengths,
                     sampling=sj.Sampling().as_arrays(3), target_params=None, num_draft=4)
  drafts, probs, _ = drafter.propose(None, (), ctx)
  assert probs is None
  # row 0: "5 6 7" last seen at 5..7, followed by 1 2 5 6 (the latest earlier match wins).
  # row 1: no repeated n-gram: no drafts. row 2: "3" (the 1-gram) last seen at 2 -> 4 4 3,
  # only 3 tokens of continuation exist.
  assert drafts.tolist() == [[1, 2, 5, 6], [-1, -1, -1, -1], [4, 4, 3, -1]]


def test_bad_arguments_raise_value_error():
  target, draft = models()
  with pytest.raises(ValueError, match="num_draft"):
    sj.generate(target, PROMPTS, drafter=sj.drafters.NGram(), num_draft=0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    sj.generate(target, PROMPTS, max_new_tokens=0)
  with pytest.raises(ValueError, match="empty"):
    sj.generate(target, [[1, 2], []])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    sj.generate(target, [[1, 64]])
  with pytest.raises(ValueError, match="non-empty list"):
    sj.generate(target, "a string is not a list of prompts")
  with pytest.raises(ValueError, match="tokenizer"):
    sj.generate(target, ["text needs a tokenizer"])
  with pytest.raises(ValueError, match="context"):
    sj.generate(target, [[1] * 200], max_new_tokens=100)
  with pytest.raises(ValueError, match="capacity"):
    sj.generate(target, [[1] * 20], max_new_tokens=20, capacity=30)
  with pytest.raises(ValueError, match="temperature"):
    sj.generate(target, PROMPTS, sampling=sj.Sampling(temperature=np.array([1.0, -1.0, 1.0])))
  with pytest.raises(ValueError, match="3 rows"):
    sj.generate(target, PROMPTS, sampling=sj.Sampling(temperature=np.array([1.0, 1.0])))
  with pytest.raises(ValueError, match="stop_tokens"):
    sj.generate(target, PROMPTS, stop_tokens=[99])
  with pytest.raises(ValueError, match="drafter"):
    sj.generate(target, PROMPTS, drafter="ngram")
  with pytest.raises(ValueError, match="max_ngram"):
    sj.drafters.NGram(max_ngram=0)
  with pytest.raises(ValueError, match="min_ngram"):
    sj.drafters.NGram(max_ngram=2, min_ngram=3)


def test_draft_model_with_another_vocabulary_is_refused():
  target, _ = models()
  other = sj.init_model(CFG.replace(vocab_size=80), jax.random.key(4))
  with pytest.raises(ValueError, match="vocabulary"):
    sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(other), num_draft=2)
