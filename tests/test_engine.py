"""The engine on small random models: greedy equality, ragged batches, stops, limits, errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.bench import metrics
from tests.conftest import peaky_models
from spec_jax.decoding import compiled as compiled_lib
from spec_jax.decoding.compiled import execution_params
from spec_jax.drafters.base import DraftContext

CFG = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=256)
PROMPTS = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = sj.Sampling(temperature=0.0)


@functools.lru_cache(None)
def models():
  return peaky_models(CFG)


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


def self_draft_stats(new_tokens, k):
  """What SpecStats must say for a self-drafting greedy run (every draft accepted) that emitted
  `new_tokens` (lists per row): the prefill emits token 0, each round a block of K+1 (K drafts
  + bonus), and a last round cut after rem = emitted % (K+1) tokens emitted rem drafts."""
  rounds = accepted = emitted = 0
  for toks in new_tokens:
    e = len(toks) - 1
    full, rem = divmod(e, k + 1)
    rounds += full + (rem > 0)
    accepted += full * k + rem
    emitted += e
  return rounds, accepted, emitted


def test_self_draft_accepts_everything_and_stats_add_up():
  target, _ = models()
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(target), num_draft=3,
                    max_new_tokens=25, sampling=GREEDY, stop_tokens=[])
  s = out.stats
  assert s.acceptance_rate == 1.0 and s.mean_accepted_length == 4.0 and s.alpha_token == 1.0
  assert s.accepted_at == (1.0, 1.0, 1.0)
  # 25 new tokens = 1 from the prefill + 6 rounds of 4 per row.
  assert s.rounds == 3 * 6 and s.new_tokens == 75 and s.iterations == 6 and s.emitted == 72
  assert "alpha_token=1.000" in s.summary()


def test_stats_count_only_what_a_cut_block_emitted():
  """max_new_tokens = 23 with K = 3: 1 + 5 full blocks of 4 + a last round cut after 2 tokens.
  The 2 drafts thrown away there count neither as accepted nor as drafted."""
  target, _ = models()
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(target), num_draft=3,
                    max_new_tokens=23, sampling=GREEDY, stop_tokens=[])
  s = out.stats
  assert out.tokens == [t[:23] for t in plain_greedy().tokens]
  assert (s.rounds, s.accepted, s.drafted, s.emitted) == (3 * 6, 3 * 17, 3 * 17, 3 * 22)
  assert s.mean_accepted_length == pytest.approx(22 / 6)
  assert s.accepted_at == pytest.approx((1.0, 1.0, 5 / 6))
  assert s.acceptance_rate == 1.0
  # No draft was rejected: the per-token acceptance is 1, which the cut round no longer hides
  # (it drafted fewer than K, and the estimate from accepted_at alone was refused: None).
  assert s.rejected == 0 and s.row_counts["rejected"] == [0, 0, 0]
  assert metrics.alpha_per_verified_token(s) == 1.0


def test_rejections_are_counted_per_round_as_the_counts_imply():
  """A random draft model, greedy, K = 3, 23 new tokens: every round ends in exactly one of a
  correction (rejected), a bonus (all K accepted: accepted_at[K-1]) or the cut of the last
  round, so rounds - accepted_at[:, K-1] - rejected is 0 or 1 per row; the estimate is
  accepted / (accepted + rejected), and merged statistics keep the count."""
  target, draft = models()
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(draft), num_draft=3,
                    max_new_tokens=23, sampling=GREEDY, stop_tokens=[])
  s, res = out.stats, out.result
  rejected = np.asarray(res.rejected)
  left = np.asarray(res.rounds) - np.asarray(res.accepted_at)[:, -1] - rejected
  assert set(left.tolist()) <= {0, 1} and rejected.sum() > 0, (left, rejected)
  assert s.rejected == int(rejected.sum()) and s.row_counts["rejected"] == rejected.tolist()
  assert metrics.alpha_per_verified_token(s) == pytest.approx(
      s.accepted / (s.accepted + s.rejected))
  merged = sj.SpecStats.merge([s, s])
  assert merged.rejected == 2 * s.rejected
  assert metrics.alpha_per_verified_token(merged) == pytest.approx(
      metrics.alpha_per_verified_token(s))


def test_stop_token_inside_an_accepted_block_ends_the_row():
  """The stop token is an accepted draft in the middle of a self-drafted block (not its bonus
  token): the block must be cut right after it, and the drafts after it not counted."""
  target, _ = models()
  ref = plain_greedy().tokens
  k = 4
  # Index 0 is the prefill's token; round r emits indices 5r-4 .. 5r, the last one the bonus.
  stop, where = next((t, i) for i, t in enumerate(ref[0])
                     if ref[0].index(t) == i and i % (k + 1) in (1, 2, 3))
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(target), num_draft=k,
                    max_new_tokens=24, sampling=GREEDY, stop_tokens=[stop])
  want = [r[:r.index(stop) + 1] if stop in r else r for r in ref]
  assert out.tokens == want
  assert out.tokens[0][-1] == stop and len(out.tokens[0]) == where + 1
  s = out.stats
  rounds, accepted, emitted = self_draft_stats(out.tokens, k)
  assert (s.rounds, s.accepted, s.drafted, s.emitted) == (rounds, accepted, accepted, emitted)
  assert s.mean_accepted_length == pytest.approx(emitted / rounds)


@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_never_more_than_max_new_tokens(max_new):
  target, _ = models()
  k = 4
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(target), num_draft=k,
                    max_new_tokens=max_new, sampling=GREEDY, stop_tokens=[])
  assert [len(t) for t in out.tokens] == [max_new] * 3
  assert out.tokens == [t[:max_new] for t in plain_greedy().tokens]
  # Statistics of what was emitted: max_new = 2 is one forward per emitted token (tau 1, not
  # K+1); max_new = 1 has no rounds at all (tau 1 by definition, no NaN).
  s = out.stats
  rounds, accepted, emitted = self_draft_stats(out.tokens, k)
  assert (s.rounds, s.accepted, s.drafted, s.emitted) == (rounds, accepted, accepted, emitted)
  tau = {1: 1.0, 2: 1.0, 7: 3.0}[max_new]
  assert s.mean_accepted_length == tau
  if max_new == 1:
    assert s.acceptance_rate == 0.0 and s.alpha_token == 0.0 and s.accepted_at == (0.0,) * k
  else:
    assert s.acceptance_rate == 1.0


def test_capacity_exactly_what_is_needed(monkeypatch):
  """At the least capacity generate() accepts (found by probing its validation, which runs
  before anything is compiled; documented as longest prompt + max_new_tokens + K + 1, not a
  multiple of 64), the output is right: the longest row's last round writes its block up to
  the end of the buffers, so a bound one short would corrupt it (KV writes past the end are
  dropped and the token write is clamped back onto committed tokens)."""
  target, _ = models()
  k, max_new = 4, 22
  kw = dict(drafter=sj.drafters.DraftModel(target), num_draft=k, max_new_tokens=max_new,
            sampling=GREEDY, stop_tokens=[])

  class Accepted(Exception):
    pass

  def accepted(capacity):
    with monkeypatch.context() as m:
      m.setattr(compiled_lib, "_compiled_decode", lambda *a: (_ for _ in ()).throw(Accepted()))
      try:
        sj.generate(target, PROMPTS, capacity=capacity, **kw)
      except ValueError as e:
        assert "too small" in str(e)
        return False
      except Accepted:
        return True

  longest = max(map(len, PROMPTS))
  least = next(c for c in range(longest, longest + max_new + 2 * k + 8) if accepted(c))
  out = sj.generate(target, PROMPTS, capacity=least, **kw)
  assert out.tokens == [t[:max_new] for t in plain_greedy().tokens]
  assert least == longest + max_new + k + 1


def test_several_stop_tokens_and_a_stop_sampled_at_prefill():
  """Two stop tokens: one that row 1's prefill samples (row 1 ends with one token, no round),
  one inside row 0's text before any occurrence of the other. Every row ends at its first
  occurrence of either."""
  target, _ = models()
  ref = plain_greedy().tokens
  at_prefill = ref[1][0]
  first_other = ref[0].index(at_prefill) if at_prefill in ref[0] else len(ref[0])
  inner = next(t for i, t in enumerate(ref[0][1:first_other], 1)
               if ref[0].index(t) == i and t != at_prefill)
  stops = [inner, at_prefill]
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(target), num_draft=4,
                    max_new_tokens=24, sampling=GREEDY, stop_tokens=stops)
  want = []
  for r in ref:
    hits = [i for i, t in enumerate(r) if t in stops]
    want.append(r[:hits[0] + 1] if hits else r)
  assert out.tokens == want
  assert out.tokens[1] == [at_prefill] and out.tokens[0][-1] == inner


def test_default_stop_tokens_are_the_models_eos():
  """stop_tokens=None stops at config.eos_token_ids; [] does not."""
  target, _ = models()
  ref = plain_greedy().tokens
  eos = ref[2][6]
  with_eos = dataclasses.replace(target, config=target.config.replace(eos_token_ids=(eos,)))
  out = sj.generate(with_eos, PROMPTS, max_new_tokens=24, sampling=GREEDY)
  assert out.tokens == [r[:r.index(eos) + 1] if eos in r else r for r in ref]
  assert len(out.tokens[2]) <= 7
  assert sj.generate(with_eos, PROMPTS, max_new_tokens=24, sampling=GREEDY,
                     stop_tokens=[]).tokens == ref


def test_stop_lists_of_any_short_length_share_one_executable():
  """The stop ids are padded with -1s (never a token) to a multiple of STOP_BUCKET: no stops,
  one and three stops run one compiled decode, and each list still ends the rows at its ids;
  nine ids make the next bucket."""
  target, _ = models()
  ref = plain_greedy().tokens
  drafter = sj.drafters.DraftModel(target)

  def run(stops):
    return sj.generate(target, PROMPTS, drafter=drafter, num_draft=3, max_new_tokens=24,
                       sampling=GREEDY, stop_tokens=stops)

  def cut(stops):
    return [r[:min(r.index(s) for s in stops if s in r) + 1] if set(stops) & set(r) else r
            for r in ref]

  assert run([]).tokens == ref
  one, three = [ref[0][5]], [ref[0][5], ref[2][3], 63]
  for stops in (one, three):
    out = run(stops)
    assert out.compile_seconds == 0, stops              # the executable of [] above
    assert out.tokens == cut(stops) and out.tokens != ref
  nine = list(range(55, 64))
  out = run(nine)
  assert out.compile_seconds > 0 and out.tokens == cut(nine)


def test_per_row_top_k_and_top_p_through_the_engine():
  """Row 0: top_k = 1, row 1: top_p = 1e-6 (both the argmax: equal to greedy), row 2: top_k = 2
  at T = 1.5 (every token among the target's top 2, and not the greedy path). A sampled draft
  model drafts with the same per-row settings."""
  target, draft = models()
  sampling = sj.Sampling(temperature=np.float32([1.0, 1.0, 1.5]), top_k=np.int32([1, 0, 2]),
                         top_p=np.float32([1.0, 1e-6, 1.0]))
  out = sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(draft), num_draft=3,
                    max_new_tokens=24, sampling=sampling, key=jax.random.key(2), stop_tokens=[])
  ref = plain_greedy().tokens
  assert out.tokens[0] == ref[0] and out.tokens[1] == ref[1]
  assert out.tokens[2] != ref[2]
  seq = PROMPTS[2] + out.tokens[2]
  cache = sj.KVCache.zeros(CFG, 1, 64)
  logits = np.asarray(sj.forward(target.params, CFG, jnp.asarray([seq], jnp.int32), cache,
                                 jnp.zeros(1, jnp.int32)).logits[0])
  n = len(PROMPTS[2])
  for i, tok in enumerate(out.tokens[2]):
    row = logits[n - 1 + i]
    assert np.sum(row > row[tok]) < 2, (i, tok)         # tok is among the top 2


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
  with pytest.raises(ValueError, match="max_ngram must be <= 32"):
    sj.drafters.NGram(max_ngram=33)                 # its program grows as max_ngram squared
  for not_a_model in ("../shared/models/salty279K", None, draft.params):
    with pytest.raises(ValueError, match="DraftModel takes a model loaded with sj.load"):
      sj.drafters.DraftModel(not_a_model)


@pytest.mark.parametrize("kwargs,match", [
    (dict(capacity="64"), "capacity must be"),
    (dict(capacity=64.0), "capacity must be"),
    (dict(stop_tokens=5), "stop_tokens"),
    (dict(stop_tokens=[1.5]), "stop_tokens.*non-integral"),
    (dict(stop_tokens="2"), "stop_tokens"),
    (dict(key=0), "key must be a jax PRNG key"),
    (dict(key=jax.random.split(jax.random.key(0))), "key must be a jax PRNG key"),
    (dict(sampling=None), "sampling must be a spec_jax.Sampling"),
    (dict(prompts=[[1.7, 2.2]]), "prompt 0 .*non-integral"),
    (dict(prompts=[[1, 2], [True, False]]), "prompt 1 .*integer"),
    # a flat list of ids was a batch of one-token prompts
    (dict(prompts=[1, 3, 5]), r"prompt 0 must be a flat list .*one prompt of token ids is \[\["),
    (dict(prompts=[[[1, 3]]]), "prompt 0 must be a flat list of token ids, got .*2 dimensions"),
    (dict(stop_tokens=[[2]]), "stop_tokens must be a flat list"),
    (dict(capacity=2**31), r"below 2\*\*31"),
])
def test_more_bad_arguments_raise_value_error_before_compiling(kwargs, match, monkeypatch):
  """Each is refused with a ValueError (not a TypeError / AttributeError, not a silent
  truncation) before anything is compiled."""
  target, _ = models()
  monkeypatch.setattr(compiled_lib, "_compiled_decode", lambda *a: pytest.fail("compiled bad input"))
  prompts = kwargs.pop("prompts", PROMPTS)
  with pytest.raises(ValueError, match=match):
    sj.generate(target, prompts, max_new_tokens=4, **kwargs)


def test_integral_float_ids_are_accepted():
  """Token ids that are floats with integral values (a float array) are the same ids."""
  target, _ = models()
  a = sj.generate(target, [np.float32([1, 3])], max_new_tokens=3, sampling=GREEDY,
                  stop_tokens=np.float64([]))
  b = sj.generate(target, [[1, 3]], max_new_tokens=3, sampling=GREEDY, stop_tokens=[])
  assert a.tokens == b.tokens


def test_draft_model_with_another_vocabulary_is_refused():
  target, _ = models()
  other = sj.init_model(CFG.replace(vocab_size=80), jax.random.key(4))
  with pytest.raises(ValueError, match="vocabulary"):
    sj.generate(target, PROMPTS, drafter=sj.drafters.DraftModel(other), num_draft=2)


def test_cached_execution_layout_follows_weight_changes():
  """generate() keeps each model's execution layout between calls (execution_params);
  weights swapped in the same params dict afterwards must be used, not the cached layout."""
  target = sj.init_model(CFG, jax.random.key(11))
  target.params["embed"] = target.params["embed"] * 40
  run = lambda m: sj.generate(m, PROMPTS, max_new_tokens=8, sampling=GREEDY, stop_tokens=[])
  first = run(target).tokens
  assert run(target).tokens == first                       # a cache hit: same tokens
  assert execution_params(target) is execution_params(target)
  layers = dict(target.params["layers"])
  layers["wq"] = layers["wq"] * 3.0                        # a layer weight the layout fuses
  target.params["layers"] = layers
  target.params["embed"] = target.params["embed"][::-1]   # and the token embedding
  fresh = sj.Model(config=CFG, params=jax.tree.map(jnp.array, target.params), tokenizer=None)
  changed = run(target).tokens
  assert changed == run(fresh).tokens
  assert changed != first


def test_text_drops_ids_past_the_tokenizer(stories260k):
  """A model whose embedding is padded past its tokenizer (Qwen2.5: 151,936 rows, 151,665
  pieces) may emit a padding id: generate() raised after the whole decode (tokenizer.decode
  refuses an unknown id) and the result was lost. The text drops it, as a special id."""
  tok = stories260k.tokenizer
  cfg = sj.ModelConfig(vocab_size=tok.vocab_size + 64, hidden_size=16, intermediate_size=32,
                       num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=64)
  model = dataclasses.replace(sj.init_model(cfg, jax.random.key(0)), tokenizer=tok)
  padded = tok.vocab_size + 3
  out = sj.generate(model, ["Once"], max_new_tokens=3, stop_tokens=[],
                    sampling=sj.Sampling(temperature=0.0, logit_bias={padded: 1e4}))
  assert out.tokens == [[padded] * 3] and out.text == [""]
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([padded])                       # a caller's own id must still exist


def test_stop_tokens_as_arrays():
  """stop_tokens as decode takes them (a jax int32 [N] array) works in generate too; a 0-d
  array is a ValueError (it was a TypeError from len())."""
  target, _ = models()
  prompts = [[1, 5, 9]]
  kw = dict(max_new_tokens=6, sampling=sj.Sampling(temperature=0.0))
  plain = sj.generate(target, prompts, stop_tokens=[21], **kw).tokens
  assert sj.generate(target, prompts, stop_tokens=jnp.asarray([21]), **kw).tokens == plain
  assert sj.generate(target, prompts, stop_tokens=np.asarray([21]), **kw).tokens == plain
  with pytest.raises(ValueError, match="stop_tokens must be None .* or a list of token ids"):
    sj.generate(target, prompts, stop_tokens=np.asarray(21), **kw)
