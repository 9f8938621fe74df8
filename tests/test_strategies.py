"""Round strategies (sj.strategies): strategy= on generate and decode gives what the sugar
(num_draft=, tree=, governor=) gives, bad combinations are refused before compiling, and a
strategy written outside the library plugs into the loop with its own state."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax.decoding import compiled as compiled_lib
from spec_jax.decoding.rounds import chain_round
from spec_jax.decoding.strategies import strategy_for
from tests.conftest import peaky_models

CFG = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=256, eos_token_ids=())
PROMPTS = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
GREEDY = sj.Sampling(temperature=0.0)
NEW = 16


@functools.lru_cache(None)
def models():
  target, draft = peaky_models(CFG)
  return target, sj.drafters.DraftModel(draft)


def run(**kwargs):
  target, drafter = models()
  kwargs.setdefault("drafter", drafter)
  return sj.generate(target, PROMPTS, max_new_tokens=NEW, sampling=GREEDY, stop_tokens=[],
                     **kwargs)


@functools.lru_cache(None)
def plain():
  return run(drafter=None).tokens


def test_strategy_objects_equal_the_sugar():
  chain = run(strategy=sj.Chain(3))
  assert chain.tokens == run(num_draft=3).tokens == plain()
  assert chain.stats.strategy == "K=3" and chain.stats.summary().startswith("K=3 ")
  tree = run(strategy=sj.Tree(sj.TreeSpec(2, 2, 4)))
  assert tree.tokens == plain() and tree.stats.tree == (2, 2, 4, "topk")
  assert tree.stats.summary().startswith("tree D=2,k=2,N=4,topk ")
  gov = sj.Governor(ks=(0, 1, 2), schedule=(0, 2, 1))
  auto = run(strategy=sj.Governed(gov))
  assert auto.tokens == run(num_draft="auto", governor=gov).tokens == plain()
  assert auto.stats.auto and auto.stats.strategy == "K=auto(<=2)"
  assert set(auto.stats.k_histogram) == {0, 1, 2}
  assert sj.strategies.Chain is sj.Chain and run(drafter=None, strategy=sj.Chain(0)).tokens \
      == plain()


def test_bad_strategies_are_refused_before_compiling():
  _, drafter = models()
  compiled = len(compiled_lib._COMPILED)
  spec = sj.TreeSpec(2, 2, 4)
  for kwargs, message in [
      (dict(strategy=sj.Chain(2), tree=spec), "give strategy= or the num_draft="),
      (dict(strategy=sj.Chain(2), num_draft=3), "give strategy= or the num_draft="),
      (dict(strategy="auto", governor=sj.Governor()), "give strategy= or"),
      (dict(strategy="fast"), "strategy must be 'auto' or a spec_jax.strategies Strategy"),
      (dict(strategy=sj.Chain(2), drafter=None), r"Chain\(2\) drafts: it needs a drafter"),
      (dict(strategy=sj.Chain(0)), "num_draft .K. must be an integer >= 1"),
      (dict(strategy=sj.Tree(spec), drafter=sj.drafters.Medusa.init(
          models()[0], num_heads=2)), "Medusa cannot build draft trees"),
      (dict(strategy="auto", drafter=None), "needs a drafter")]:
    with pytest.raises(ValueError, match=message):
      run(**kwargs)
  with pytest.raises(ValueError, match=r"Chain\(K\): K \(num_draft\) must be an integer >= 0"):
    sj.Chain(-1)
  assert len(compiled_lib._COMPILED) == compiled
  # Binding is idempotent: a bound strategy binds to an equal one (generate binds once, then
  # decode checks it again inside the compiled call).
  bound = strategy_for("auto", drafter)
  assert bound == bound.bind(drafter, None) and hash(bound) == hash(bound.bind(drafter, None))
  assert bound.candidates == (0, 1, 2, 4, 6, 8)


def test_decode_takes_a_strategy_inside_a_user_jit():
  target, drafter = models()
  prompts, lens, capacity = sj.prepare_batch(target, PROMPTS, NEW, 3)

  @functools.partial(jax.jit, static_argnames="strategy")
  def go(params, dparams, prompts, lens, strategy):
    return sj.decode(params, prompts, lens, jax.random.key(0), config=CFG, drafter=drafter,
                     drafter_params=dparams, strategy=strategy, max_new_tokens=NEW,
                     capacity=capacity, sampling=GREEDY)

  res = go(target.params, drafter.params, jnp.asarray(prompts), jnp.asarray(lens), sj.Chain(3))
  assert sj.new_tokens(res) == plain()
  np.testing.assert_array_equal(res.k_rounds, [0, 0, 0, int(res.iterations)])


@dataclasses.dataclass(frozen=True)
class Budgeted(sj.Strategy):
  """A strategy from outside the library: a chain of at most k drafts whose rows each draft
  their own budget (row b: b % (k + 1) drafts), kept in the strategy's own state."""
  k: int

  @property
  def width(self):
    return self.k

  def init(self, env, state):
    return jnp.arange(state.lengths.shape[0], dtype=jnp.int32) % (self.k + 1)

  def round(self, env, state):
    return chain_round(env, state, k=self.k, draft_rows=state.strategy)


def test_a_strategy_of_our_own_with_per_row_draft_lengths():
  out = run(strategy=Budgeted(3))
  assert out.tokens == plain()
  drafted, rounds = out.stats.row_counts["drafted"], out.stats.row_counts["rounds"]
  assert drafted[0] == 0 and 0 < drafted[1] <= rounds[1] and rounds[2] < drafted[2] <= 2 * rounds[2]
  assert out.stats.strategy == "Budgeted"


# ------------------------------------------------------------- drafts at a tuned temperature

def test_acceptance_at_other_scales_equals_drafting_there():
  """TunedDraftTemperature scores a candidate scale c' from the q drawn at c as q^(c/c')
  renormalised: the same beta = sum_x min(p, q_c') as the drafter's own softmax at
  temperature T c' (no top-k / top-p), at every position of every row."""
  from spec_jax.decoding.rounds import Verified
  from spec_jax.decoding.strategies.tuned import acceptance_at_scales, scored_positions
  b, k, v, temperature = 3, 2, 64, 0.9
  logits = 3.0 * jax.random.normal(jax.random.key(0), (b, k, v))
  p = jax.nn.softmax(2.0 * jax.random.normal(jax.random.key(1), (b, k + 1, v)), axis=-1)
  drawn = jnp.asarray([0.6, 1.0, 0.8])                      # each row's scale c
  candidates = jnp.asarray([0.5, 0.8, 1.0, 1.5])
  q = jax.nn.softmax(logits / (temperature * drawn[:, None, None]), axis=-1)
  verified = Verified(q, p, jnp.asarray([2, 1, 0]), jnp.asarray([1, 0, 0]),
                      jnp.asarray([True, True, False]))
  beta = acceptance_at_scales(verified, drawn[:, None] / candidates[None, :])     # [B, K, S]
  for s, c in enumerate(candidates):
    q_c = jax.nn.softmax(logits / (temperature * c), axis=-1)
    want = jnp.sum(jnp.minimum(p[:, :k], q_c), axis=-1)
    np.testing.assert_allclose(beta[..., s], want, rtol=1e-5, atol=1e-6)
  # Every drafted position of a running sampled row is scored, past a rejection too.
  scored = scored_positions(verified, jnp.asarray([True, False, True]))
  np.testing.assert_array_equal(scored, [[True, True], [False, False], [False, False]])


def test_tuned_draft_temperature_is_checked_and_leaves_greedy_rows_alone():
  tuned = sj.strategies.TunedDraftTemperature
  for scales in [(), (0.5, 0.5), (0.0, 1.0), (1.0, float("inf")), "0.8", (True, 0.5)]:
    with pytest.raises(ValueError, match="scales must be distinct finite numbers > 0"):
      tuned(2, scales=scales)
  with pytest.raises(ValueError, match="needs a drafter"):
    run(strategy=tuned(2), drafter=None)
  assert tuned(2, scales=(0.3, 3.0)).start == 1 and tuned(2).scales[tuned(2).start] == 1.0
  assert tuned(2, scales=(np.float32(0.5), 1)).scales == (0.5, 1.0)
  # Greedy: temperature 0 at any scale, so the tokens are plain greedy's.
  out = run(strategy=tuned(2))
  assert out.tokens == plain(), out.stats.summary()


def test_a_targets_max_verify_bounds_a_trees_nodes_not_its_depth():
  """A tree round verifies num_nodes + 1 tokens; the check compared the depth + 1 (a Tree of
  16 nodes passed a target whose cache holds 5 verify positions)."""
  from spec_jax.decoding.strategies import Chain, Tree
  from spec_jax.decoding.target import ModelTarget

  @dataclasses.dataclass(frozen=True)
  class FiveWide(ModelTarget):
    max_verify = property(lambda self: 5)
    tree_capable = property(lambda self: True)

  target, ngram = FiveWide(CFG), sj.drafters.NGram()
  assert strategy_for(Chain(4), ngram, target=target).verify_tokens == 5
  assert strategy_for(Tree(sj.TreeSpec(2, 2, 4)), ngram, target=target).verify_tokens == 5
  for strategy in (Chain(5), Tree(sj.TreeSpec(4, 4, 16))):
    with pytest.raises(ValueError, match="verifies at most 5 tokens per round"):
      strategy_for(strategy, ngram, target=target)
