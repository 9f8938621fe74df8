"""sj.decode: the pure loop inside a caller's jit equals sj.generate; one while, no callbacks."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.decoding.strategies.chain import check_num_draft
from spec_jax.decoding.prompts import prepare_batch

CFG = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=128, eos_token_ids=())
DRAFT_CFG = CFG.replace(num_layers=1, intermediate_size=32)
PROMPTS = [[1, 5, 9, 3], [2, 7]]
MAX_NEW = 12
K = 3


@pytest.fixture(scope="module")
def models():
  target = sj.init_model(CFG, jax.random.key(0))
  draft = sj.drafters.DraftModel(sj.init_model(DRAFT_CFG, jax.random.key(1)))
  return target, draft


def _batch(target):
  prompt_tokens, prompt_lens, capacity = prepare_batch(target, PROMPTS, MAX_NEW, K)
  return jnp.asarray(prompt_tokens), jnp.asarray(prompt_lens), capacity


def _user_fn(config, drafter, capacity, sampling):
  """A caller's own jitted function: decode, then score the samples with the target."""

  @jax.jit
  def sample_and_score(params, dparams, prompts, lens, key):
    res = sj.decode(params, prompts, lens, key, config=config, drafter=drafter,
                    drafter_params=dparams, num_draft=K, max_new_tokens=MAX_NEW,
                    capacity=capacity, sampling=sampling, stop_tokens=())
    b, s = res.tokens.shape
    logits = sj.forward(params, config, res.tokens, sj.KVCache.zeros(config, b, s),
                        jnp.zeros((b,), jnp.int32)).logits
    logp = jax.nn.log_softmax(logits[:, :-1])
    tok_logp = jnp.take_along_axis(logp, res.tokens[:, 1:, None], -1)[..., 0]
    pos = jnp.arange(s - 1)[None]
    new = (pos >= res.prompt_lens[:, None] - 1) & (pos < res.lengths[:, None] - 1)
    return res, jnp.sum(jnp.where(new, tok_logp, 0.0), axis=1)

  return sample_and_score


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_in_user_jit_equals_generate(models, temperature):
  target, draft = models
  sampling = sj.Sampling(temperature=temperature)
  key = jax.random.key(7)
  prompts, lens, capacity = _batch(target)
  out = sj.generate(target, PROMPTS, drafter=draft, num_draft=K, max_new_tokens=MAX_NEW,
                    sampling=sampling, key=key, stop_tokens=[], capacity=capacity)
  fn = _user_fn(CFG, draft, capacity, sampling)
  res, score = fn(target.params, draft.params, prompts, lens, key)
  assert sj.new_tokens(res) == out.tokens
  assert [len(t) for t in out.tokens] == [MAX_NEW] * len(PROMPTS)
  # The extra computation in the same jit ran: finite log-probabilities of the samples.
  assert np.all(np.isfinite(np.asarray(score))) and np.all(np.asarray(score) < 0)
  stats = sj.SpecStats.from_result(res)
  assert stats.rounds == out.stats.rounds and stats.accepted == out.stats.accepted
  # generate() gets its DecodeResult back packed into one vector (PackedDecode): every field
  # unpacks to the values, shape and dtype that decode returned.
  for name in ("lengths", "prompt_lens", "rounds", "drafted", "accepted", "accepted_at",
               "finished_at_round", "iterations", "k_rounds", "position_acceptance"):
    got, want = getattr(out.result, name), np.asarray(getattr(res, name))
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got, want)
    np.testing.assert_array_equal(got, want, err_msg=name)
  assert out.result.tokens.shape == res.tokens.shape


def test_decode_jaxpr_has_one_while_and_no_callbacks(models):
  target, draft = models
  prompts, lens, capacity = _batch(target)
  fn = functools.partial(sj.decode, config=CFG, drafter=draft, num_draft=K,
                         max_new_tokens=MAX_NEW, capacity=capacity,
                         sampling=sj.Sampling(temperature=1.0))
  jaxpr = jax.make_jaxpr(fn)(target.params, prompts, lens, jax.random.key(0),
                             drafter_params=draft.params)
  text = str(jaxpr)
  prims = []

  def walk(jx):
    for eqn in jx.eqns:
      prims.append(eqn.primitive.name)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jaxpr.jaxpr)
  top = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  assert top.count("while") == 1, top
  assert not [p for p in prims if "callback" in p], "host callbacks inside decode"
  assert "while" in text


def test_finished_at_round_is_each_rows_latency(models):
  target, _ = models
  out = sj.generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=5, stop_tokens=[],
                    sampling=sj.Sampling(temperature=0.0))
  # Plain decoding: the prefill gives token 1, each round one more: 4 rounds for 5 tokens.
  np.testing.assert_array_equal(out.result.finished_at_round, [4, 4])
  short = sj.generate(target, [[1, 2, 3]], max_new_tokens=1, stop_tokens=[])
  np.testing.assert_array_equal(short.result.finished_at_round, [0])
  assert short.stats.rounds == 0 and short.stats.mean_accepted_length == 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_draft=0), "num_draft"),
    (dict(capacity=8), "capacity 8 is too small"),
    (dict(tree=object()), "tree drafting"),
    (dict(sampling=None), "sampling must be"),
])
def test_decode_bad_static_arguments_raise_at_trace_time(models, kwargs, message):
  target, draft = models
  prompts, lens, capacity = _batch(target)
  args = dict(config=CFG, drafter=draft, num_draft=K, max_new_tokens=MAX_NEW,
              capacity=capacity, sampling=sj.Sampling())
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    jax.make_jaxpr(functools.partial(sj.decode, **args))(target.params, prompts, lens,
                                                         jax.random.key(0))


@pytest.mark.parametrize("change, message", [
    ("other_vocabulary", "vocabulary of 80 tokens but the target has 64"),
    ("empty_prompt", r"prompt_lens must lie in \[1, P=16\], got values from 0"),
    ("long_prompt", r"prompt_lens must lie in \[1, P=16\], got values from 4 to 17"),
    ("token_outside", r"prompt token ids outside the vocabulary \[0, 64\): \[64\]"),
    ("stop_outside", r"stop_tokens outside the vocabulary \[0, 64\): \[70\]"),
    ("stop_none", r"None, the model's defaults, is generate\(\)'s"),       # a TypeError before
    ("stop_fraction", r"stop_tokens must hold integer token ids, got non-integral values \[21.5\]"),  # stopped at 21
    ("int_key", "key must be a jax PRNG key"),
])
def test_decode_refuses_what_generate_refuses_when_it_can_see_the_values(models, change,
                                                                         message):
  """sj.decode is the layer under generate(): a draft model of another vocabulary ran (and
  drafted garbage) and bad concrete prompts, stops or keys reached the program; now each is a
  ValueError before anything runs. (Padding past a row's length may hold anything.)"""
  target, draft = models
  prompts, lens, capacity = _batch(target)
  key, stops = jax.random.key(0), ()
  if change == "other_vocabulary":
    draft = sj.drafters.DraftModel(sj.init_model(DRAFT_CFG.replace(vocab_size=80),
                                                 jax.random.key(2)))
  elif change in ("empty_prompt", "long_prompt"):
    lens = lens.at[1].set(0 if change == "empty_prompt" else prompts.shape[1] + 1)
  elif change == "token_outside":
    prompts = prompts.at[1, 0].set(CFG.vocab_size).at[1, -1].set(-5)   # the second: padding
  elif change == "stop_outside":
    stops = (2, 70)
  elif change == "stop_none":
    stops = None
  elif change == "stop_fraction":
    stops = np.asarray([21.5])
  else:
    key = 0
  with pytest.raises(ValueError, match=message):
    sj.decode(target.params, prompts, lens, key, config=CFG, drafter=draft, num_draft=K,
              max_new_tokens=MAX_NEW, capacity=capacity, sampling=sj.Sampling(),
              stop_tokens=stops)


def test_decode_and_generate_share_messages(models):
  target, draft = models
  with pytest.raises(ValueError) as from_generate:
    sj.generate(target, PROMPTS, drafter=sj.drafters.Medusa.init(target, num_heads=2,
                                                                  key=jax.random.key(0)),
                num_draft=3)
  with pytest.raises(ValueError) as from_decode:
    check_num_draft(sj.drafters.Medusa.init(target, num_heads=2, key=jax.random.key(0)), 3)
  assert str(from_generate.value) == str(from_decode.value)


# ----------------------------------------------------------------------------- acceptance

def test_position_acceptance_merges_and_reads_minus_one_when_nothing_was_judged(models):
  """SpecStats.merge dropped a chain's pooled position_acceptance (None, "not measured") though
  the merged counts give it; an n-gram that never matched read 0.0 ("every draft rejected")
  where nothing was judged, and an acceptance_prior handed that on."""
  target, _ = models
  same = sj.drafters.DraftModel(target)          # accepts what it drafts, but not at the cut
  kw = dict(drafter=same, num_draft=K, max_new_tokens=10, stop_tokens=[8, 25],
            sampling=sj.Sampling(temperature=0.0))
  one, two = (sj.generate(target, [p], **kw) for p in PROMPTS)
  both = sj.generate(target, PROMPTS, **kw)
  merged = sj.SpecStats.merge([one.stats, two.stats])
  assert merged.position_acceptance is not None
  np.testing.assert_allclose(merged.position_acceptance, both.stats.position_acceptance,
                             rtol=1e-6)
  # No repeats in the prompts: the n-gram drafter never proposes.
  out = sj.generate(target, [[1, 2, 3, 4, 5, 6]], drafter=sj.drafters.NGram(), num_draft=K,
                    max_new_tokens=3, stop_tokens=[], sampling=sj.Sampling(temperature=0.0))
  assert out.stats.drafted == 0 and out.stats.rounds > 0
  assert list(out.result.position_acceptance) == [-1.0] * K
  assert np.asarray(out.result.row_acceptance).tolist() == [[-1.0] * K]


# ----------------------------------------------------------------------------- caches

def test_prepared_weights_follow_their_leaves_and_drafters_are_not_kept(models):
  """The prepared copy of the weights was keyed by the params container and freed with one
  leaf: a loop replacing only the head ({**p, "lm_head": new}) kept one whole copy per step.
  A dropped DraftModel's weights stayed alive in the compiled-program cache (its static
  argument)."""
  import gc
  import weakref
  from spec_jax.decoding import compiled
  target, _ = models
  base = dict(target.params, lm_head=target.params["embed"].T)   # untied: a head to replace
  kw = dict(max_new_tokens=2, stop_tokens=[], sampling=sj.Sampling(temperature=0.0))
  sizes = []
  for step in range(4):
    params = dict(base, lm_head=base["lm_head"] + step)           # a new head, same layers
    tuned = sj.Model(config=target.config.replace(tie_embeddings=False), params=params)
    sj.generate(tuned, PROMPTS, **kw)
    del tuned, params
    gc.collect()
    sizes.append(len(compiled._EXECUTION_PARAMS))
  assert sizes[-1] <= sizes[0] + 1, sizes                         # it grew by one per step
  draft = sj.drafters.DraftModel(sj.init_model(DRAFT_CFG, jax.random.key(7)))
  leaf = weakref.ref(draft.model.params["embed"])
  sj.generate(target, PROMPTS, drafter=draft, num_draft=2, **kw)
  del draft
  gc.collect()
  assert leaf() is None                  # the draft model's weights went with the drafter


def test_logit_bias_sizes_share_one_executable(models):
  """Every number of logit_bias entries compiled decode again (M was not bucketed)."""
  from spec_jax.decoding import compiled
  target, _ = models
  kw = dict(max_new_tokens=2, stop_tokens=[])
  sj.generate(target, PROMPTS, sampling=sj.Sampling(0.0, logit_bias={3: -1.0}), **kw)
  before = len(compiled._COMPILED)
  for n in (2, 5, 8):
    bias = {i: -1.0 for i in range(n)}
    sj.generate(target, PROMPTS, sampling=sj.Sampling(0.0, logit_bias=bias), **kw)
  assert len(compiled._COMPILED) == before


def test_auto_reports_the_compile_its_calibration_ran(models, tmp_path, monkeypatch):
  """With num_draft="auto" the first call's calibration compiled decode and ran it, then
  generate read compile_seconds 0.0 (the calibration's later fetches had reset it); with a
  logit_bias the calibration timed (and compiled) an executable of its own."""
  from spec_jax.decoding import calibration, compiled
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  calibration.clear_memory()
  compiled.clear_compiled()                 # whatever ran before in this process: a fresh start
  target, _ = models
  # Candidates {0, 1, 2} instead of the default six: the governed decode compiles one round per
  # candidate and calibration times each (this test 24 -> 10 CPU-s); what compile_seconds
  # reports does not depend on the set. The default set: test_bench.py::
  # test_spec_suite_governor_column_and_mixed_prompts; a real calibration at (0, 1, 2):
  # test_governor.py::test_calibrate_caches_on_disk_and_generate_uses_it.
  kw = dict(drafter=sj.drafters.NGram(), num_draft="auto", governor=sj.Governor(max_draft=2),
            max_new_tokens=8, stop_tokens=[])
  before = len(compiled._COMPILED)
  out = sj.generate(target, PROMPTS, sampling=sj.Sampling(0.0, logit_bias={5: -1.0}), **kw)
  assert out.compile_seconds > 0
  assert out.stats.strategy == "K=auto(<=2)"
  assert len(compiled._COMPILED) == before + 1          # calibration's and generate's, shared
  again = sj.generate(target, PROMPTS, sampling=sj.Sampling(0.0, logit_bias={5: -1.0}), **kw)
  assert again.compile_seconds == 0.0
  one_row = sj.generate(target, PROMPTS[:1], sampling=sj.Sampling(0.0), **kw)
  assert one_row.compile_seconds > 0                   # read 0.0: calibration compiled it
  calibration.clear_memory()
