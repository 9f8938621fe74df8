"""DDTree's best-first trees (spec_jax.tree.build_best_first_tree, TreeSpec(candidates=
"best_first")) over the DFlash and DSpark block drafters.

- The builder returns exactly the N likeliest prefix-closed sequences (brute force on a tiny
  D, V), for a factorized q (DFlash) and for an autoregressive one (DSpark's Markov head).
- Greedy speculative decoding equals plain greedy decoding token for token (float32).
- Through the whole engine (sj.generate) the emitted tokens follow the target's exact joint
  (tests/test_lossless.py's six-token joint, chi-square at 1e-3) at T = 1 and at T = 0.7 with
  top-p, and the same check rejects a lossy variant: best-first candidates verified as if
  they had been drawn i.i.d. from q (SpecInfer's rule).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from spec_jax import sampling as sampling_lib
from spec_jax import tree as tree_lib
from spec_jax.drafters.dflash import DFlash
from tests import test_dflash, test_dspark
from tests.stats_helpers import chi2_critical, chi_square
from tests.test_dflash import GREEDY, assert_exact_joint, sample_joint, target  # noqa: F401
from tests.test_lossless import PROMPT, counts3, exact_joint6


# ----------------------------------------------------------------------------- the builder

def _paths(tree):
  """Per row, the token path of every valid node: list (rows) of lists of tuples, in node
  order (parents come first, so a node's path extends its parent's)."""
  tokens, parents, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
  out = []
  for b in range(tokens.shape[0]):
    paths = {0: ()}
    row = []
    for i in range(1, tokens.shape[1]):
      if valid[b, i]:
        assert parents[b, i] < i and parents[b, i] in paths
        paths[i] = paths[parents[b, i]] + (int(tokens[b, i]),)
        row.append(paths[i])
    out.append(row)
  return out


def _brute_force(logp_of, v, depth, n, cap):
  """The n best sequences of length 1..depth: logp_of(prefix) -> log q [V] of the next token;
  only tokens ranked < cap among their siblings count (TreeSpec.top_k)."""
  scored = []
  for d in range(1, depth + 1):
    for seq in itertools.product(range(v), repeat=d):
      s, ok = 0.0, True
      for j in range(d):
        lp = logp_of(seq[:j])
        ok &= int(np.sum(lp > lp[seq[j]])) < cap and np.isfinite(lp[seq[j]])
        s += lp[seq[j]]
      if ok:
        scored.append((s, seq))
  scored.sort(key=lambda x: -x[0])
  assert len(scored) <= n or scored[n - 1][0] > scored[n][0] + 1e-6, "ties at the cut"
  return scored[:n]


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("depth,top_k,n", [(3, 12, 12), (3, 2, 9), (2, 5, 5), (4, 31, 31)])
def test_best_first_is_the_top_n_prefix_closed_set(depth, top_k, n):
  """Factorized q (DFlash: one distribution per depth) and autoregressive q (DSpark: the
  children depend on the node's own token), two rows: the popped nodes are the n best
  sequences (sum of log q along the path) among those whose every token ranks < top_k, in
  score order, each node's parent before it."""
  v, b = 4, 2
  spec = sj.TreeSpec(depth, top_k, n, "best_first")
  rng = np.random.default_rng(depth * 100 + top_k)
  slot = jnp.asarray(rng.normal(size=(b, depth, v)) * 1.5, jnp.float32)
  markov = jnp.asarray(rng.normal(size=(b, depth, v, v)) * 1.5, jnp.float32)   # [b, d, tok]
  rows = jnp.arange(b)

  def node_logits(tokens, depths):
    return markov[rows, jnp.minimum(depths, depth - 1), tokens]

  for kind, fn in (("factorized", None), ("markov", node_logits)):
    tree = jax.jit(lambda s, fn=fn: tree_lib.build_best_first_tree(s, spec, fn))(slot)
    assert tree.q is None and tree.tokens.shape == (b, n + 1)
    for r, got in enumerate(_paths(tree)):
      lp_slot = _log_softmax(np.asarray(slot)[r])
      lp_markov = _log_softmax(np.asarray(markov)[r])
      if kind == "factorized":
        logp_of = lambda prefix: lp_slot[len(prefix)]
      else:
        logp_of = lambda prefix: (lp_slot[0] if not prefix else
                                  lp_markov[len(prefix), prefix[-1]])
      want = _brute_force(logp_of, v, depth, n, top_k)
      assert got == [s for _, s in want], (kind, r)     # the same sequences, in score order
    depths, parents = np.asarray(tree.depths), np.asarray(tree.parents)
    valid = np.asarray(tree.valid)
    assert (depths[:, 1:][valid[:, 1:]] == (depths[np.arange(b)[:, None], parents][:, 1:] +
                                             1)[valid[:, 1:]]).all()


def test_best_first_pads_when_few_sequences_have_mass():
  """Tokens of probability 0 are never nodes: 2 drawable tokens, depth 2 -> 6 sequences; a
  budget of 9 leaves 3 invalid padding nodes (parent 0, depth 1, token 0)."""
  logits = jnp.full((1, 2, 5), -jnp.inf).at[:, :, jnp.asarray([1, 3])].set(
      jnp.asarray([[0.5, -0.2], [0.1, 0.3]]))
  tree = tree_lib.build_best_first_tree(logits, sj.TreeSpec(2, 9, 9, "best_first"))
  valid = np.asarray(tree.valid)[0]
  assert valid.sum() == 1 + 6 and not valid[7:].any()
  assert set(np.asarray(tree.tokens)[0, 1:7].tolist()) <= {1, 3}
  assert (np.asarray(tree.tokens)[0, 7:] == 0).all()
  assert (np.asarray(tree.parents)[0, 7:] == 0).all()


def test_best_first_is_refused_where_it_cannot_be_built():
  t, _ = test_dflash.tiny()
  spec = sj.TreeSpec(2, 4, 4, "best_first")
  assert tree_lib.parse_tree_spec("3,8,8,best_first") == sj.TreeSpec(3, 8, 8, "best_first")
  assert spec.candidates_for(True) == spec.candidates_for(False) == "best_first"
  assert spec.cache_extent == 4
  draft = sj.drafters.DraftModel(sj.init_model(t.config, jax.random.key(1)))
  for drafter in (draft, sj.drafters.NGram()):
    with pytest.raises(ValueError, match=rf"{type(drafter).__name__} cannot build best-first "
                                         r"\(DDTree\) trees"):
      sj.generate(t, [PROMPT], drafter=drafter, tree=spec, max_new_tokens=2)
  with pytest.raises(ValueError, match="best_first' trees come from build_best_first_tree"):
    tree_lib.build_dynamic_tree(jnp.zeros((1, 8)), None, (), spec, key=jax.random.key(0),
                                sampling=GREEDY, candidates="best_first")
  with pytest.raises(ValueError, match="slot_logits has 1 slots, TreeSpec.depth is 2"):
    tree_lib.build_best_first_tree(jnp.zeros((1, 1, 8)), spec)
  with pytest.raises(ValueError, match="rnn Markov head cannot build trees"):
    sj.generate(t, [PROMPT], drafter=test_dspark.small(t, "rnn", target_layers=(0,),
                                                       num_layers=1),
                tree=spec, max_new_tokens=2)


# ----------------------------------------------------------------------------- greedy

def test_greedy_best_first_equals_plain_greedy(target):
  prompts = [[1, 5, 9, 22, 40, 7, 3, 80, 11], [1, 3], [1, 60, 61, 62, 63, 2, 2, 9, 33, 17]]
  plain = sj.generate(target, prompts, max_new_tokens=14, sampling=GREEDY, stop_tokens=[])
  dflash = DFlash.init(target, key=jax.random.key(2), block_size=5, num_layers=1,
                       target_layers=(1, 3), init_std=0.3)
  dspark = test_dspark.small(target, "vanilla")
  # 63 nodes: the largest tree, its root and nodes past the first 32 verified in one pass.
  for drafter, nodes in ((dflash, 10), (dspark, 10), (dflash, 63)):
    spec = sj.generate(target, prompts, drafter=drafter, max_new_tokens=14, sampling=GREEDY,
                       stop_tokens=[], tree=sj.TreeSpec(4, nodes, nodes, "best_first"))
    assert spec.tokens == plain.tokens, (type(drafter).__name__, nodes)
    assert spec.stats.drafted > 0 and spec.stats.tree[3] == "best_first"


# ----------------------------------------------------------------------------- the exact joint

# test_dflash.tiny(): block 4 (depth <= 3), vocabulary 8: top_k 8 = every token, no cap.
BEST_FIRST = sj.TreeSpec(3, 8, 8, "best_first")
T07_TOPP = sj.Sampling(temperature=0.7, top_p=0.8)
# 20k rows (test_dflash's lossless checks run 12k): the lossy variant below gives 35x the
# critical chi-square at 20k (69x at 40k; 21.6k against 615.5); the positive checks keep alpha
# 1e-3.
ROWS = 20_000


@pytest.mark.parametrize("sampling", [sj.Sampling(temperature=1.0), T07_TOPP],
                         ids=["T1", "T0.7_topp0.8"])
@pytest.mark.optimized
def test_dflash_best_first_keeps_the_target_joint(sampling):
  _, drafter = test_dflash.tiny()
  toks, stats = sample_joint(drafter, sampling, seed=5, rows=ROWS, tree=BEST_FIRST)
  assert stats.tree[3] == "best_first"
  assert 0.02 < stats.acceptance_rate < 0.98, stats.summary()
  assert stats.accepted_at[1] > 0.005, stats.summary()
  assert_exact_joint(toks, sampling)


def test_dspark_best_first_keeps_the_target_joint():
  """DSpark's Markov head makes each node's children depend on its token (per-node best-first
  expansion): test_dspark's 12k-row joint at T = 1."""
  _, d = test_dspark.tiny()
  (s1, dof1), (s2, dof2), stats = test_dspark.joint_stats(d, "T1", tree=BEST_FIRST)
  assert 0.02 < stats.acceptance_rate < 0.98 and stats.accepted_at[1] > 0.005, stats.summary()
  assert s1 < chi2_critical(dof1, 1e-3) and s2 < chi2_critical(dof2, 1e-3), (s1, dof1, s2, dof2)


class BestFirstAsSampled(DFlash):
  """LOSSY: a best-first tree verified as if its children were i.i.d. draws from q (SpecInfer's
  min(1, p/q) rule with each node's q attached). The children are the likeliest tokens, not
  draws, so the acceptance ratio is wrong."""

  def _static_key(self):
    return ("BestFirstAsSampled",) + super()._static_key()

  def propose_tree(self, params, state, ctx, spec):
    tree, state = super().propose_tree(params, state, ctx, spec)
    q = sampling_lib.probs(self.block_logits(params, state, ctx, spec.depth), ctx.sampling)
    rows = jnp.arange(q.shape[0])[:, None]
    return tree.replace(q=q[rows, jnp.minimum(tree.depths, spec.depth - 1)]), state


@pytest.mark.slow   # one more 40k-row generate
@pytest.mark.optimized
def test_the_joint_check_catches_best_first_verified_as_sampled():
  _, d = test_dflash.tiny()
  lossy = BestFirstAsSampled(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)
                                if f.init})
  sampling = sj.Sampling(temperature=1.0)
  toks, _ = sample_joint(lossy, sampling, seed=5, rows=ROWS, tree=BEST_FIRST)
  joint = exact_joint6(test_dflash.tiny()[0], PROMPT, sampling)
  stat, dof = chi_square(counts3(toks[:, :3]), joint.sum(axis=(3, 4, 5)))
  assert stat > 3 * chi2_critical(dof, 1e-3), (stat, dof)


def test_bench_skips_best_first_trees_for_drafters_that_cannot_build_them(tmp_path):
  """`--tree D,k,N,best_first` pairs only with block drafters: an n-gram bench runs its chain
  and no tree row instead of failing, and a note says why (the tree was dropped silently)."""
  import json
  from spec_jax.bench import cli
  out = tmp_path / "spec.json"
  rc = cli.main(["--pairs", "random:tiny@ngram", "-K", "2", "--tree", "2,4,4,best_first", "-B",
                 "1", "--max-new-tokens", "8", "--repeats", "1", "--cost-repeats", "1",
                 "--temperatures", "0", "--out", str(out)])
  assert rc == 0
  data = json.loads(out.read_text())
  rows = data["rows"]
  assert sorted((r["drafter"], r["K"], r["tree"] or "") for r in rows) == [
      ("ngram", 2, ""), ("none", 0, "")]
  assert any("no row for --tree 2,4,4,best_first" in n for n in data["notes"]), data["notes"]
