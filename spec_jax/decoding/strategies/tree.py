"""Tree: every round verifies a draft tree in one target forward (spec_jax.tree has the trees,
their building and their lossless verification; this is the decode core's side of them)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax.decoding.rounds import commit_history, commit_step, update_stats
from spec_jax.decoding.strategies.base import Strategy
from spec_jax.drafters.base import DraftContext, VerifyInfo
from spec_jax.tree.build import ancestor_mask
from spec_jax.drafters.registry import TREE_DRAFTERS
from spec_jax.tree.spec import TreeSpec, check_tree
from spec_jax.tree.verify import verify_tree, verify_tree_greedy, verify_tree_logits


def tree_round(env, st, *, spec: TreeSpec):
  """One speculative round with a draft tree (spec_jax.tree's docstring): propose_tree -> one target
  forward over the N+1 nodes with the ancestor mask -> verify -> commit the path (tokens, KV
  move, drafter.commit_tree) -> statistics. env: decoding.state.LoopEnv; st: its DecodeState
  (accepted_at [B, D])."""
  key, draft_key, accept_key = jax.random.split(st.key, 3)
  ctx = DraftContext(key=draft_key, tokens=st.tokens, lengths=st.lengths,
                     sampling=env.sampling.for_drafts(),
                     target_params=env.target_params, num_draft=spec.depth, greedy=env.greedy,
                     target_cache=st.cache, history=env.history_of(st))
  tree, dstate = env.drafter.propose_tree(env.drafter_params, st.drafter_state, ctx, spec)
  last = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)[:, 0]
  tree = tree.replace(tokens=jnp.where(tree.valid, tree.tokens, 0).at[:, 0].set(last))
  mask = ancestor_mask(tree.parents, spec.depth)
  positions = st.lengths[:, None] - 1 + tree.depths
  out = env.target.forward(env.target_params, tree.tokens, st.cache, st.lengths - 1,
                           positions=positions, tree_mask=mask, return_layers=env.layers)
  # Node i's penalties see the committed history plus its own path (itself and its ancestors).
  hist = env.history_of(st)
  hist = None if hist is None else tree_history(hist, tree, spec.depth)
  if env.greedy:
    amax = sampling_lib.greedy_tokens(out.logits, env.sampling, hist)
    emitted, path, n_acc = verify_tree_greedy(tree, amax, spec.depth)
  elif hist is None:                   # p one row at a time (memory: verify_tree_logits)
    emitted, path, n_acc = verify_tree_logits(accept_key, tree, out.logits, env.sampling,
                                              spec.depth)
  else:
    p = sampling_lib.probs(out.logits, env.sampling, hist)
    emitted, path, n_acc = verify_tree(accept_key, tree, p, spec.depth)
  tokens, lengths, done, n_emit = commit_step(st.tokens, st.lengths, st.done, emitted, n_acc,
                                              env.stop_tokens, env.limit)
  cache = env.target.move_kv(out.cache, st.lengths, path, n_acc)
  # The drafter sees the verify outputs along the accepted path, shaped like a chain of D
  # drafts: input 0 is the root, input i the path's i-th node (entries after n_accepted are
  # stale, as a chain's rejected drafts are).
  nodes = jnp.concatenate([jnp.zeros_like(path[:, :1]), jnp.maximum(path, 0)], axis=1)
  rows = jnp.arange(nodes.shape[0])[:, None]
  along = lambda x: x[rows, nodes]
  verify = VerifyInfo(input_tokens=along(tree.tokens), hidden=along(out.hidden),
                      layer_hidden=tuple(along(h) for h in out.layer_hidden),
                      lengths_before=st.lengths, lengths=lengths, target_params=env.target_params)
  dstate = env.drafter.commit_tree(env.drafter_params, dstate, emitted, n_acc, verify)
  drafted = jnp.sum(tree.valid[:, 1:], axis=1).astype(jnp.int32)
  new = st.replace(tokens=tokens, lengths=lengths, done=done, cache=cache, drafter_state=dstate,
                   key=key, sampling_state=commit_history(env, st, emitted, n_emit))
  return update_stats(st, new, drafted, n_acc, n_emit)


def tree_history(history, tree, depth: int):
  """The History of every node of a draft tree [B, N+1, V] (History.along_tree; a module-level
  name so that tests can swap in a lossy variant)."""
  return history.along_tree(tree.tokens, tree.parents, depth)


@dataclasses.dataclass(frozen=True)
class Tree(Strategy):
  """Tree drafting: every round verifies a draft tree of spec.num_nodes nodes (tree_round)."""
  spec: TreeSpec
  width = property(lambda self: self.spec.depth)
  verify_tokens = property(lambda self: self.spec.num_nodes + 1)
  extent = property(lambda self: self.spec.cache_extent)
  label = property(lambda self: self.spec.label())

  def bind(self, drafter, target) -> "Tree":
    check_tree(self.spec, drafter, tree_drafters=TREE_DRAFTERS)
    if target is not None and not target.tree_capable:
      what = getattr(getattr(target, "config", None), "model_type", None)
      raise ValueError(f"tree drafting needs a target with move_kv (Target.tree_capable); "
                       f"{type(target).__name__}"
                       f"{f' (model_type {what!r})' if what else ''} has none (a hybrid "
                       "linear-attention model's recurrent state follows one sequence): pass "
                       "tree=None for a chain")
    return self

  def round(self, env, state):
    return tree_round(env, state, spec=self.spec)

  def stats_fields(self, greedy: bool, drafter) -> dict:
    """The tree with the candidate kind its rounds drew (deterministic drafters and greedy
    decoding take the top-k)."""
    spec = self.spec.resolved(greedy or getattr(drafter, "greedy_drafts", False) or
                              not drafter.samples_tree_candidates)
    return {"num_draft": spec.depth, "tree": spec, "strategy": spec.label()}
