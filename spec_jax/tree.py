"""Tree drafting: TreeSpec, draft trees in fixed shapes, lossless tree verification, one round.

A chain of K drafts dies at its first wrong token; a tree keeps several candidates per position
and the target verifies all of them in ONE forward through an ancestor mask.

    sj.generate(target, prompts, drafter=d, tree=sj.TreeSpec(depth=D, top_k=k, num_nodes=N))

One round (fixed shapes; B rows, N nodes, D depth):

    drafter.propose_tree ─► DraftTree: node 0 = the last committed token (the root), nodes
        1..N = drafts with parent index < own index, depth 1..D, unused nodes padded (valid
        False)
    target forward over the N+1 nodes at cache slots lengths-1 .. lengths-1+N, RoPE positions
        lengths-1+depth, tree_mask = ancestor-or-self ─► p [B, N+1, V]
    verify (below) ─► accepted root-to-leaf path [B, D] (node ids), n_accepted, emitted tokens
        [B, D+1] (the accepted drafts, then the correction / bonus token)
    commit: tokens and lengths as for chains (engine.commit_step); the accepted nodes' KV entries
        are moved to contiguous slots lengths .. lengths+n-1 (one gather, one in-place scatter);
        the drafter follows the accepted path (drafter.commit_tree sees the verify outputs
        gathered along it, shaped like a chain of D drafts).

Tree building (drafters call `build_dynamic_tree`; NGram builds a trie with `trie_from_branches`):

  EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
  Dynamic Draft Trees", sec. 4; SafeAILab/EAGLE `eagle/model/cnets.py` topK_generate): the root's
  top-k children form depth 1; at each further depth the k frontier nodes each get their top-k
  children, scored by the cumulative draft log-probability of their path, and the k best of
  those k^2 become the next frontier; at the end the N best of all candidates by score are kept.
  A child's score is at most its parent's, and ties keep creation order, so the kept set is
  ancestor-closed. One batched drafter forward per depth over the new frontier only: the
  earlier frontiers are already in the drafter's cache, just past the committed tokens, and
  the new nodes see them through a tree mask [B, F, W] over those W cache entries (ancestors
  and self; kernels_pallas.reference's wide tree mask).

  Sampled candidates (TreeSpec(candidates="sampled" or "distinct")): the same shape (k children
  per expanded node, k frontier nodes per depth, the N best kept), but every expanded node v
  draws its children from the drafter's q_v = sampling.probs(logits): i.i.d. ("sampled") or
  without replacement ("distinct": Gumbel-top-k, the first k draws of sampling without
  replacement, in draw order). Which children are expanded and kept must not depend on a
  child's own token, or the kept children would no longer follow q (keeping the likeliest of
  k i.i.d. draws is lossy). So nodes are ranked by a priority fixed BEFORE the node is drawn:

      prio(c_i) = min(prio(v), score(v) + log R_i),   R_i = 1 - sum_{j<i} q_v(c_j),

  with score(v) = the cumulative log q of v's path (v's own token is known when its children
  are ranked). prio never increases along a path or a sibling list, so anything whose rank
  depends on c_i's token ranks below c_i, and whether c_i is drawn, expanded or kept depends
  only on what ranks above it: the kept tree is a best-first search that decides each node
  before drawing it, and every kept child of v is, given everything decided before it, a
  fresh draw from q_v (or from q_v without the earlier siblings). Frontiers and the final N
  are chosen by prio (ties: creation order, which keeps the tree ancestor-closed).

Verification, chosen by how the candidates were drawn (all lossless: the emitted tokens have
exactly the target's joint distribution):

  Greedy target (temperature 0, static): walk from the root, moving to the first child whose
  token is the target's argmax at the current node; emit the argmax at the last node.

  Deterministic candidates (top-k trees, n-gram tries; q one-hot): at the current node with
  target distribution p, try the children c_1, c_2, ... in order with r_1 = p:

      accept c_i with probability r_i(c_i);    on rejection r_{i+1} = norm(r_i with c_i zeroed)

  and when every child is rejected (or there are none) draw the token from the last r. This is
  recursive rejection sampling with one-hot drafts, i.e. exact sampling from p: by induction,
  P(emit x) = r_1(c_1) [x = c_1] + (1 - r_1(c_1)) P_{r_2}(x) = p(x), since
  (1 - p(c_1)) r_2(x) = p(x) for x != c_1. It is EAGLE's `evaluate_posterior` rule for sampling
  (SafeAILab/EAGLE `eagle/model/utils.py`: qx = 1, gtp[xi] = 0, renormalise) and the k-candidate
  rule of Yang et al. 2024 ("Multi-Candidate Speculative Decoding") with one-hot drafts.

  Sampled candidates (children i.i.d. from q): SpecInfer's multi-step speculative sampling
  (Miao et al., ASPLOS 2024, "SpecInfer: Accelerating Large Language Model Serving with
  Tree-based Speculative Inference and Verification", sec. 4.2, Algorithm 2 `VerifyStochastic`,
  Theorem 4.2): with r_1 = p,

      accept c_i with probability min(1, r_i(c_i) / q(c_i));
      on rejection r_{i+1} = norm(max(r_i - q, 0));

  all rejected -> draw from the last r. Each step is Leviathan et al.'s rejection sampler
  applied to the residual target r_i (emit ~ r_i exactly when c_i ~ q independently), so the
  emitted token has distribution r_1 = p.

  Distinct candidates (drawn without replacement from q): recursive rejection sampling (Jeon et
  al. 2024, "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without
  Replacement", sec. 3, Algorithm 1): the same step with the proposal of the i-th draw,
  q_1 = q, q_{i+1} = norm(q_i with c_i zeroed):

      accept c_i with probability min(1, r_i(c_i) / q_i(c_i));
      on rejection r_{i+1} = norm(max(r_i - q_i, 0)),  q_{i+1} = norm(q_i with c_i zeroed).

  c_{i+1} given c_1..c_i is a draw from q_{i+1}, so each step is again exact for r_i.

  Every rule continues at the accepted child with its own p; a node's children are fixed
  before, and independently of, the uniforms at the node, so by induction over depth the
  emitted sequence has the target's joint.

`verify_tree` is the vectorised verification (one pass over the nodes in index order, which is
topological: a node's children come after it and siblings are tried in index order);
`verify_tree_reference` is the same math written plainly (explicit child lists, one row at a
time), the test oracle. They draw the same uniforms, so they return the same tokens.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sampling as sampling_lib
from spec_jax.models.transformer import KVCache, forward

MAX_TREE_TOKENS = 32       # root + nodes per verify: the kernels' one 32-bit mask per query row
CANDIDATES = ("topk", "sampled", "distinct")


# ----------------------------------------------------------------------------- the spec

@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """The shape of the draft tree of every round (static, hashable).

  depth: D, the most drafts accepted per round (the deepest node), >= 1.
  top_k: k, children per expanded node (EAGLE-2: also the frontier width; n-gram: branches).
  num_nodes: N, draft nodes verified per round (the root, the last committed token, is extra):
    depth <= N and N + 1 <= 32.
  candidates: "topk" (deterministic top-k children; verified by recursive rejection with
    one-hot drafts), "sampled" (children drawn i.i.d. from the drafter's q; SpecInfer's
    multi-step speculative sampling) or "distinct" (children drawn from q without replacement;
    recursive rejection sampling). Greedy decoding and deterministic drafters (n-gram,
    greedy_drafts=True) always use top-k candidates.
  """
  depth: int
  top_k: int
  num_nodes: int
  candidates: str = "topk"

  def __post_init__(self):
    for name in ("depth", "top_k", "num_nodes"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (numbers.Integral, np.integer)):
        raise ValueError(f"TreeSpec.{name} must be an integer, got {v!r}")
      object.__setattr__(self, name, int(v))
    if self.depth < 1:
      raise ValueError(f"TreeSpec.depth must be >= 1, got {self.depth}")
    if self.top_k < 1:
      raise ValueError(f"TreeSpec.top_k must be >= 1, got {self.top_k}")
    if self.num_nodes < self.depth:
      raise ValueError(f"TreeSpec.num_nodes ({self.num_nodes}) must be >= depth ({self.depth}): "
                       "a tree of depth D needs at least D nodes")
    if self.num_nodes + 1 > MAX_TREE_TOKENS:
      raise ValueError(f"TreeSpec.num_nodes ({self.num_nodes}) + 1 (the root) must be <= "
                       f"{MAX_TREE_TOKENS} (one 32-bit mask per verify row): num_nodes <= "
                       f"{MAX_TREE_TOKENS - 1}")
    if self.candidates not in CANDIDATES:
      raise ValueError(f"TreeSpec.candidates must be one of {CANDIDATES}, got "
                       f"{self.candidates!r}")

  @property
  def cache_extent(self) -> int:
    """Cache slots past the last committed token a round may write: the N verify nodes, and a
    drafter's frontier nodes (at most top_k per depth below D)."""
    return max(self.num_nodes, self.top_k * (self.depth - 1))

  def label(self) -> str:
    kind = "" if self.candidates == "topk" else "," + self.candidates
    return f"tree D={self.depth},k={self.top_k},N={self.num_nodes}{kind}"


def parse_tree_spec(text: str) -> TreeSpec:
  """'D,k,N' or 'D,k,N,CANDIDATES' (topk, sampled or distinct; the bench's --tree) ->
  TreeSpec; ValueError otherwise."""
  parts = [p.strip() for p in str(text).split(",")]
  if len(parts) not in (3, 4):
    raise ValueError(f"a tree is written D,k,N or D,k,N,{'|'.join(CANDIDATES)} (depth, top_k, "
                     f"num_nodes[, candidates]), got {text!r}")
  try:
    d, k, n = (int(p) for p in parts[:3])
  except ValueError:
    raise ValueError(f"a tree's D,k,N must be integers, got {text!r}") from None
  return TreeSpec(d, k, n, parts[3] if len(parts) == 4 else "topk")


def check_tree(tree, drafter, num_draft=None, governor=None) -> TreeSpec:
  """The TreeSpec a (tree, drafter) pair runs with; ValueError naming what is allowed.
  num_draft is ignored beside a tree, except "auto" (the governor picks a chain's K per round
  from a cost table of chains; it has no tree shapes to choose from), refused with governor=."""
  if not isinstance(tree, TreeSpec):
    raise ValueError(f"tree must be a spec_jax.TreeSpec(depth=, top_k=, num_nodes=) for tree "
                     f"drafting, or None; got {type(tree).__name__}")
  if drafter is None:
    raise ValueError("tree drafting needs a drafter (DraftModel, NGram, EAGLE, EAGLE3, "
                     "EAGLE3Fused or MTP); got drafter=None")
  if (isinstance(num_draft, str) and num_draft == "auto") or governor is not None:
    raise ValueError("tree drafting does not combine with num_draft='auto' or governor= (the "
                     "governor chooses among chain lengths K); allowed: tree=TreeSpec(...) with "
                     "an integer num_draft (ignored), or num_draft='auto' with tree=None")
  if not getattr(drafter, "supports_tree", False):
    raise ValueError(f"{type(drafter).__name__} cannot build draft trees; drafters that can: "
                     "DraftModel, NGram, EAGLE, EAGLE3, EAGLE3Fused, MTP (or pass tree=None for a "
                     "chain)")
  return tree


# ----------------------------------------------------------------------------- the tree

@flax.struct.dataclass
class DraftTree:
  """One draft tree per row, N+1 nodes (node 0 is the root: the last committed token).

  tokens: int32 [B, N+1] (padding nodes hold 0; the round writes the root's token).
  parents: int32 [B, N+1], parents[:, 0] = -1 and 0 <= parents[:, i] < i for i >= 1 (padding
    nodes point at the root); siblings are tried in index order.
  depths: int32 [B, N+1], 0 at the root, parent's depth + 1 elsewhere (<= D).
  valid: bool [B, N+1], the root and the real drafts.
  q: float32 [B, N+1, V] or None. With sampled candidates, q[b, i] is the distribution node i's
    children were drawn from; None for deterministic candidates (one-hot drafts).
  distinct: (static) the children were drawn from q without replacement, in index order.
  """
  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  valid: jax.Array
  q: Optional[jax.Array] = None
  distinct: bool = flax.struct.field(pytree_node=False, default=False)


def ancestor_mask(parents, steps: int):
  """bool [B, T, T]: mask[b, i, j] = node j is node i or one of its ancestors.

  parents: int32 [B, T], each node's parent index in the same list, -1 for none (the root, or
  a parent outside the list); steps: the largest number of ancestors a node has."""
  b, t = parents.shape
  idx = jnp.arange(t, dtype=jnp.int32)
  mask = jnp.broadcast_to(idx[:, None] == idx[None, :], (b, t, t))
  cur = jnp.broadcast_to(idx, (b, t))
  for _ in range(steps):
    cur = jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1)
    mask = mask | (cur[:, :, None] == idx[None, None, :])
  return mask


# ----------------------------------------------------------------------------- building

ExpandFn = Callable[[jax.Array, jax.Array, jax.Array, int, Any], tuple]


def build_dynamic_tree(root_logits, expand: ExpandFn, carry, spec: TreeSpec, *, key, sampling,
                       candidates: str = "topk", rank_by_score: bool = False):
  """EAGLE-2's dynamic tree (module docstring), with top-k or sampled candidates.

  Args:
    root_logits: float [B, V], the drafter's logits for the token after the last committed one.
    expand: the drafter's batched forward over the newest frontier,
      expand(tokens int32 [B, T], parents int32 [B, T] (index in the same list, -1 = the root),
      depths int32 [B, T] (1-based), start, carry) -> (logits [B, T-start, V] for the token
      after each of the nodes start..T-1, carry). The lists hold every frontier so far (they
      only grow at their end; nodes < start were passed to earlier calls, and a node's parent
      always comes before it). Called up to D-1 times, with T = k, 2k, ....
    carry: the drafter's pytree threaded through expand (its cache buffers).
    spec: TreeSpec (depth D, top_k k, num_nodes N). key: PRNG key (sampled candidates only).
    sampling: per-row Sampling [B]: q = sampling.probs(logits) for sampled candidates.
    candidates: "topk" (children: the top-k of log_softmax(logits); scores: EAGLE-2's
      cumulative log-probability), "sampled" (k i.i.d. draws from q) or "distinct" (k draws
      from q without replacement); the sampled kinds rank by the priority of the module
      docstring.
    rank_by_score: a test hook: rank sampled candidates by their score (EAGLE-2's rule, right
      for top-k candidates) instead of the priority; LOSSY for sampled candidates.

  Returns:
    (DraftTree with N+1 nodes (q set for sampled candidates), carry).
  """
  if candidates not in CANDIDATES:
    raise ValueError(f"candidates must be one of {CANDIDATES}, got {candidates!r}")
  b, v = root_logits.shape
  d_max, n = spec.depth, spec.num_nodes
  m = min(spec.top_k, v)
  sampled = candidates != "topk"
  keys = jax.random.split(key, d_max)
  rows = jnp.arange(b)[:, None]

  def children(logits, key_d, f_score, f_prio, f_valid):
    """Children of F frontier nodes: tokens [B, F*m], score, prio, valid, and q [B, F, V]."""
    f = logits.shape[1]
    flat = lambda x: x.reshape(b, f * m)
    if not sampled:
      logp = jnp.minimum(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), 0.0)
      lp, toks = jax.lax.top_k(logp, m)
      score = f_score[:, :, None] + lp
      # A token the drafter gives probability 0 (outside an EAGLE-3 draft vocabulary, when k
      # exceeds it) is no candidate.
      valid = f_valid[:, :, None] & (lp > -jnp.inf)
      return flat(toks.astype(jnp.int32)), flat(score), flat(score), flat(valid), None
    q = sampling_lib.probs(logits, sampling)
    logq = jnp.log(jnp.maximum(q, 0.0))
    # One key per row (fold_in(key, row)): a row's drafts do not depend on the batch.
    row_keys = jax.vmap(lambda i: jax.random.fold_in(key_d, i))(jnp.arange(b))
    if candidates == "distinct":     # Gumbel-top-k: sampling without replacement, in order
      gumbel = jax.vmap(lambda k_: jax.random.gumbel(k_, q.shape[1:], jnp.float32))(row_keys)
      toks = jax.lax.top_k(logq + gumbel, m)[1]
    else:
      draws = jax.vmap(lambda k_, lq: jax.random.categorical(
          k_, lq, axis=-1, shape=(m,) + lq.shape[:-1]))(row_keys, logq)    # [B, m, F]
      toks = jnp.moveaxis(draws, 1, -1)
    toks = toks.astype(jnp.int32)                                        # [B, F, m]
    qc = jnp.take_along_axis(q, toks, axis=-1)
    remaining = jnp.maximum(1.0 - (jnp.cumsum(qc, axis=-1) - qc), 0.0)   # R_i, before draw i
    score = f_score[:, :, None] + jnp.log(qc)
    prio = jnp.minimum(f_prio[:, :, None], f_score[:, :, None] + jnp.log(remaining))
    valid = f_valid[:, :, None] & (qc > 0)
    if rank_by_score:
      prio = score
    return flat(toks), flat(score), flat(prio), flat(valid), q

  zero = jnp.zeros((b, 1), jnp.float32)
  toks, score, prio, valid, q_root = children(root_logits[:, None], keys[0], zero, zero,
                                              jnp.ones((b, 1), bool))
  c_tok, c_score, c_prio, c_valid = [toks], [score], [prio], [valid]
  c_parent = [jnp.full((b, m), -1, jnp.int32)]
  n_cand = m
  frontier_q = []                      # (candidate ids [B, F], q [B, F, V]) for sampled trees
  f = min(spec.top_k, m)
  if d_max > 1:                        # depth-1 frontier: the f best by priority
    sel = jax.lax.top_k(c_prio[0], f)[1]
    pick = lambda xs, sel=sel: jnp.take_along_axis(xs, sel, axis=1)
    f_cand, f_score, f_prio, f_valid = sel.astype(jnp.int32), pick(score), pick(prio), pick(valid)
    proc_tok, proc_par = pick(toks), jnp.full(sel.shape, -1, jnp.int32)
    proc_depth = jnp.ones(sel.shape, jnp.int32)
  for d in range(2, d_max + 1):
    start = proc_tok.shape[1] - f                                        # this frontier's slots
    logits, carry = expand(proc_tok, proc_par, proc_depth, start, carry)
    toks, score, prio, valid, q = children(logits, keys[d - 1], f_score, f_prio, f_valid)
    if q is not None:
      frontier_q.append((f_cand, q))
    c_tok.append(toks)
    c_score.append(score)
    c_prio.append(prio)
    c_valid.append(valid)
    c_parent.append(jnp.repeat(f_cand, m, axis=1))
    offset = n_cand
    n_cand += f * m
    if d == d_max:
      break
    f_next = min(spec.top_k, f * m)
    sel = jax.lax.top_k(prio, f_next)[1]
    pick = lambda xs, sel=sel: jnp.take_along_axis(xs, sel, axis=1)
    f_cand, f_score, f_prio, f_valid = (offset + sel).astype(jnp.int32), pick(score), \
        pick(prio), pick(valid)
    proc_tok = jnp.concatenate([proc_tok, pick(toks)], 1)
    proc_par = jnp.concatenate([proc_par, (start + sel // m).astype(jnp.int32)], 1)
    proc_depth = jnp.concatenate([proc_depth, jnp.full(sel.shape, d, jnp.int32)], 1)
    f = f_next

  tok = jnp.concatenate(c_tok, 1)
  prio = jnp.concatenate(c_prio, 1)
  valid = jnp.concatenate(c_valid, 1)
  parent = jnp.concatenate(c_parent, 1)
  depth = np.concatenate([np.full(c.shape[1], i + 1, np.int32) for i, c in enumerate(c_tok)])
  depth = jnp.broadcast_to(jnp.asarray(depth), (b, n_cand))
  if n_cand > n:     # keep the N best by (priority desc, creation order): ancestor-closed
    order = jnp.argsort(-prio, axis=1, stable=True)[:, :n]
    chosen = jnp.sort(order, axis=1)                                     # topological order
  else:
    chosen = jnp.broadcast_to(jnp.arange(n_cand, dtype=jnp.int32), (b, n_cand))
  kept = chosen.shape[1]
  node_of = jnp.full((b, n_cand), -1, jnp.int32).at[rows, chosen].set(
      jnp.arange(1, kept + 1, dtype=jnp.int32))
  par_cand = jnp.take_along_axis(parent, chosen, axis=1)
  par_node = jnp.where(par_cand < 0, 0,
                       jnp.take_along_axis(node_of, jnp.maximum(par_cand, 0), axis=1))
  pad = n - kept

  def with_root(x, root_value, pad_value):
    parts = [jnp.full((b, 1), root_value, x.dtype), x]
    if pad:
      parts.append(jnp.full((b, pad), pad_value, x.dtype))
    return jnp.concatenate(parts, 1)

  kept_valid = jnp.take_along_axis(valid, chosen, axis=1)
  tree = DraftTree(
      tokens=with_root(jnp.where(kept_valid, jnp.take_along_axis(tok, chosen, axis=1), 0), 0, 0),
      parents=with_root(jnp.where(kept_valid, par_node, 0), -1, 0),
      depths=with_root(jnp.where(kept_valid, jnp.take_along_axis(depth, chosen, axis=1), 1),
                       0, 1),
      valid=with_root(kept_valid, True, False),
      distinct=candidates == "distinct")
  if sampled:
    q_all = jnp.zeros((b, n + 1, v), jnp.float32).at[:, 0].set(q_root[:, 0])
    for cands, q in frontier_q:
      # A frontier node that was not kept maps to -1: dropped by the scatter.
      at = jnp.take_along_axis(node_of, cands, axis=1)
      q_all = q_all.at[rows, jnp.where(at < 0, n + 1, at)].set(q, mode="drop")
    tree = tree.replace(q=q_all)
  return tree, carry


def trie_from_branches(branch_tokens, branch_valid, num_nodes: int) -> DraftTree:
  """Several continuations (best first) -> one deterministic tree: equal prefixes merge.

  Args:
    branch_tokens: int32 [B, R, D], R candidate continuations of up to D tokens.
    branch_valid: bool [B, R, D], a prefix of each branch (False = no token there).
    num_nodes: N; nodes are numbered branch by branch, depth by depth, and cut after N (a
      node's parent always comes first, so the cut keeps the tree ancestor-closed).
  Returns:
    DraftTree (q None): node (r, d) is kept when no earlier branch has the same first d+1
    tokens; its parent is the node of the earliest branch sharing its first d tokens.
  """
  b, r, d_max = branch_tokens.shape
  valid = jnp.cumprod(branch_valid.astype(jnp.int32), axis=2).astype(bool)
  same = branch_tokens[:, :, None, :] == branch_tokens[:, None, :, :]   # [B, R(i), R(j), D]
  same_prefix = jnp.cumprod(same.astype(jnp.int32), axis=3).astype(bool) & valid[:, None, :, :]
  earlier = jnp.arange(r)[None, :, None, None] >= jnp.arange(r)[None, None, :, None]
  # canonical[b, i, d]: the first branch j <= i sharing branch i's first d+1 tokens.
  canonical = jnp.argmax(same_prefix & earlier, axis=2).astype(jnp.int32)
  keep = valid & (canonical == jnp.arange(r, dtype=jnp.int32)[None, :, None])
  flat_keep = keep.reshape(b, r * d_max)
  node = jnp.cumsum(flat_keep.astype(jnp.int32), axis=1)               # 1-based where kept
  node = jnp.where(flat_keep & (node <= num_nodes), node, -1)
  node3 = node.reshape(b, r, d_max)
  # parent slot of (i, d): (canonical[i, d-1], d-1); depth 1 hangs off the root.
  par_branch = jnp.concatenate([jnp.zeros((b, r, 1), jnp.int32), canonical[:, :, :-1]], axis=2)
  par_slot = par_branch * d_max + jnp.arange(d_max)[None, None, :] - 1
  par_node = jnp.where(jnp.arange(d_max)[None, None, :] == 0, 0,
                       jnp.take_along_axis(node, jnp.maximum(par_slot, 0).reshape(b, -1),
                                           axis=1).reshape(b, r, d_max))
  target = jnp.where(node3 > 0, node3, num_nodes + 1).reshape(b, -1)   # dropped: out of range
  rows = jnp.arange(b)[:, None]

  def scatter(values, fill, dtype):
    base = jnp.full((b, num_nodes + 1), fill, dtype)
    return base.at[rows, target].set(values.reshape(b, -1).astype(dtype), mode="drop")

  depth = jnp.broadcast_to(jnp.arange(1, d_max + 1, dtype=jnp.int32)[None, None], (b, r, d_max))
  tokens = scatter(branch_tokens, 0, jnp.int32)
  parents = scatter(par_node, 0, jnp.int32).at[:, 0].set(-1)
  depths = scatter(depth, 1, jnp.int32).at[:, 0].set(0)
  valid_n = scatter(jnp.ones((b, r, d_max), bool), False, bool).at[:, 0].set(True)
  return DraftTree(tokens=tokens, parents=parents, depths=depths, valid=valid_n)


# ----------------------------------------------------------------------------- verification

def _normalised(x, fallback):
  """x / sum(x), or `fallback` where x has no mass (an event of probability 0)."""
  total = jnp.sum(x, axis=-1, keepdims=True)
  return jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), fallback)


def residual_deterministic(r, token, q_node):
  """After rejecting a one-hot draft `token`: r with that token zeroed, renormalised."""
  del q_node
  return _normalised(r.at[token].set(0.0), r)


def residual_sampled(r, token, q_node):
  """After rejecting a draft drawn from q: norm(max(r - q, 0)) (SpecInfer, Algorithm 2)."""
  del token
  return _normalised(jnp.maximum(r - q_node, 0.0), r)


def _verify_row(key, tokens, parents, valid, p, q, *, depth: int, distinct: bool = False,
                residual=None, accept_ratio=None):
  """One row of `verify_tree`: a single pass over nodes 1..N in index order.

  Carry: cur (the node the accepted path has reached), r (the distribution the next token
  follows: p[cur], reduced by the rejected children of cur), qc (the proposal of cur's next
  child: q[cur], without the rejected children when they were drawn without replacement), n,
  path. Node j is a candidate iff it is a child of cur; then it is accepted with probability
  min(1, r(t)/qc(t)) (r(t) for one-hot drafts, q None), else r (and qc) become the residuals.
  Children of an accepted node come later in the order; those of a rejected one never match."""
  n1 = tokens.shape[0]
  k_accept, k_final = jax.random.split(key)
  u = jax.random.uniform(k_accept, (n1,), jnp.float32)
  residual = residual or (residual_deterministic if q is None else residual_sampled)

  def body(j, carry):
    cur, r, qc, n, path = carry
    tok = tokens[j]
    is_child = valid[j] & (parents[j] == cur)
    r_tok = r[tok]
    if accept_ratio is not None:
      accept = is_child & accept_ratio(u[j], r, tok, qc, p[cur])
    elif q is None:
      accept = is_child & (u[j] < r_tok)
    else:
      accept = is_child & (u[j] * qc[tok] < r_tok)
    rejected_r = residual(r, tok, qc)
    r = jnp.where(accept, p[j], jnp.where(is_child, rejected_r, r))
    if q is not None:
      rejected_q = _normalised(qc.at[tok].set(0.0), qc) if distinct else qc
      qc = jnp.where(accept, q[j], jnp.where(is_child, rejected_q, qc))
    at = jnp.minimum(n, depth - 1)
    path = path.at[at].set(jnp.where(accept, j, path[at]))
    return jnp.where(accept, j, cur), r, qc, n + accept.astype(jnp.int32), path

  qc0 = jnp.zeros((), jnp.float32) if q is None else q[0]
  init = (jnp.int32(0), p[0], qc0, jnp.int32(0), jnp.full((depth,), -1, jnp.int32))
  cur, r, _, n, path = jax.lax.fori_loop(1, n1, body, init)
  final = sampling_lib.sample(k_final, r)
  return path, n, final


def _emitted(tokens, path, n, final, depth: int):
  """(emitted [B, D+1]: path tokens, then final, then -1) from per-row path [B, D], n, final."""
  pos = jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
  path_tok = jnp.take_along_axis(tokens, jnp.maximum(path, 0), axis=1)
  path_tok = jnp.pad(path_tok, ((0, 0), (0, 1)))
  return jnp.where(pos < n[:, None], path_tok,
                   jnp.where(pos == n[:, None], final[:, None], -1)).astype(jnp.int32)


def verify_tree(key, tree: DraftTree, target_probs, depth: int, *, residual=None,
                accept_ratio=None):
  """Lossless verification of a draft tree (module docstring), vectorised over rows.

  Args:
    key: PRNG key; row b uses fold_in(key, b) (split into the per-node uniforms and the final
      draw), so a row's randomness does not depend on the others.
    tree: DraftTree; tree.q None selects the deterministic-candidate rule, else SpecInfer's
      (tree.distinct: recursive rejection sampling without replacement).
    target_probs: float [B, N+1, V], p at every node (the distribution of the token after it).
    depth: D (static), the deepest node.
    residual, accept_ratio: test hooks (lossy variants in tests/test_tree.py); leave None.
  Returns:
    (emitted int32 [B, D+1]: the n accepted tokens, then the correction / bonus token, then -1;
     path int32 [B, D]: the accepted nodes' indices, -1 after n; n_accepted int32 [B]).
  """
  b = tree.tokens.shape[0]
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
  p = target_probs.astype(jnp.float32)
  fn = lambda k_, t, par, val, pp, qq: _verify_row(k_, t, par, val, pp, qq, depth=depth,
                                                    distinct=tree.distinct, residual=residual,
                                                    accept_ratio=accept_ratio)
  if tree.q is None:
    path, n, final = jax.vmap(lambda k_, t, par, val, pp: fn(k_, t, par, val, pp, None))(
        keys, tree.tokens, tree.parents, tree.valid, p)
  else:
    path, n, final = jax.vmap(fn)(keys, tree.tokens, tree.parents, tree.valid, p,
                                  tree.q.astype(jnp.float32))
  return _emitted(tree.tokens, path, n, final, depth), path, n


def verify_tree_greedy(tree: DraftTree, target_argmax, depth: int):
  """Greedy verification: the longest root-to-leaf path whose tokens are the target's argmax
  (the first matching child at each node), then the argmax at its end. No random draws.

  target_argmax: int32 [B, N+1]. Returns (emitted [B, D+1], path [B, D], n_accepted [B])."""
  n1 = tree.tokens.shape[1]

  def row(tokens, parents, valid, amax):
    def body(j, carry):
      cur, n, path = carry
      accept = valid[j] & (parents[j] == cur) & (tokens[j] == amax[cur])
      at = jnp.minimum(n, depth - 1)
      path = path.at[at].set(jnp.where(accept, j, path[at]))
      return jnp.where(accept, j, cur), n + accept.astype(jnp.int32), path

    cur, n, path = jax.lax.fori_loop(1, n1, body, (jnp.int32(0), jnp.int32(0),
                                                   jnp.full((depth,), -1, jnp.int32)))
    return path, n, amax[cur]

  path, n, final = jax.vmap(row)(tree.tokens, tree.parents, tree.valid,
                                 target_argmax.astype(jnp.int32))
  return _emitted(tree.tokens, path, n, final, depth), path, n


def verify_tree_reference(key, tree: DraftTree, target_probs, depth: int):
  """The verification written plainly, the test oracle of `verify_tree`: per row, walk down
  from the root; at each node try its children (explicit lists, index order) with the rule of
  the module docstring; draw the final token from the last r. Same keys and uniforms as
  verify_tree. Eager (not jittable: Python control flow on values). Returns numpy arrays
  (emitted [B, D+1], path [B, D], n_accepted [B])."""
  tokens = np.asarray(tree.tokens)
  parents = np.asarray(tree.parents)
  valid = np.asarray(tree.valid)
  p = jnp.asarray(target_probs, jnp.float32)
  q = None if tree.q is None else jnp.asarray(tree.q, jnp.float32)
  b, n1 = tokens.shape
  emitted = np.full((b, depth + 1), -1, np.int32)
  paths = np.full((b, depth), -1, np.int32)
  n_acc = np.zeros((b,), np.int32)
  for row in range(b):
    k_accept, k_final = jax.random.split(jax.random.fold_in(key, row))
    u = np.asarray(jax.random.uniform(k_accept, (n1,), jnp.float32))
    cur, r, n = 0, p[row, 0], 0
    while True:
      children = [j for j in range(1, n1) if valid[row, j] and parents[row, j] == cur]
      accepted = None
      qc = None if q is None else q[row, cur]     # the proposal of the next child
      for c in children:
        t = int(tokens[row, c])
        if q is None:            # one-hot draft: accept with probability r(t)
          ok = u[c] < float(r[t])
          rejected = r.at[t].set(0.0)
        else:                    # draft drawn from qc: accept with probability min(1, r/qc)
          ok = u[c] * float(qc[t]) < float(r[t])
          rejected = jnp.maximum(r - qc, 0.0)
        if ok:
          accepted = c
          break
        total = float(jnp.sum(rejected))
        r = rejected / total if total > 0 else r
        if q is not None and tree.distinct:       # without replacement: drop t from qc
          q_left = qc.at[t].set(0.0)
          q_total = float(jnp.sum(q_left))
          qc = q_left / q_total if q_total > 0 else qc
      if accepted is None:
        break
      paths[row, n] = accepted
      emitted[row, n] = tokens[row, accepted]
      n += 1
      cur, r = accepted, p[row, accepted]
    emitted[row, n] = int(sampling_lib.sample(k_final, r))
    n_acc[row] = n
  return emitted, paths, n_acc


# ----------------------------------------------------------------------------- the KV move

def move_accepted_kv(cache: KVCache, lengths, path, n_accepted) -> KVCache:
  """Moves the accepted nodes' KV entries to contiguous slots, in place.

  The verify wrote node i of row b at slot lengths[b]-1+i; the accepted path's j-th node
  (path[b, j], j < n_accepted[b]) belongs at slot lengths[b]+j (the root, node 0, is already at
  lengths[b]-1). One gather of the D entries per row and layer, then one scatter into the
  stacked cache (entries past n_accepted go out of range and are dropped).

  cache: KVCache [L, B, S, Hkv, Dh] (or head-major [L, B, Hkv, S, Dh]); lengths int32 [B]
  (before the round); path int32 [B, D]; n_accepted int32 [B]. Another cache type (the Gemma
  KV cache, spec_jax.models.gemma_cache) moves its own buffers (its move_accepted)."""
  if not isinstance(cache, KVCache):
    return cache.move_accepted(lengths, path, n_accepted)
  s = cache.capacity
  d = path.shape[1]
  rows = jnp.arange(path.shape[0])[:, None]
  j = jnp.arange(d, dtype=jnp.int32)[None, :]
  src = jnp.minimum(lengths[:, None] - 1 + jnp.maximum(path, 0), s - 1)
  dst = jnp.where(j < n_accepted[:, None], lengths[:, None] + j, s)

  def move(buf):
    if cache.head_major:     # advanced (rows, slots) around the head slice: [B, D, L, Hkv, Dh]
      return buf.at[:, rows, :, dst].set(buf[:, rows, :, src], mode="drop")
    picked = buf[:, rows, src]                                           # [L, B, D, Hkv, Dh]
    return buf.at[:, rows, dst].set(picked, mode="drop")

  return KVCache(k=move(cache.k), v=move(cache.v), head_major=cache.head_major)


# ----------------------------------------------------------------------------- one round

def tree_round(env, st, *, spec: TreeSpec):
  """One speculative round with a draft tree (module docstring): propose_tree -> one target
  forward over the N+1 nodes with the ancestor mask -> verify -> commit the path (tokens, KV
  move, drafter.commit_tree) -> statistics. env: engine.LoopEnv; st: engine.DecodeState (its
  accepted_at is [B, D])."""
  from spec_jax import engine                   # engine imports this module lazily too
  from spec_jax.drafters.base import DraftContext, VerifyInfo

  key, draft_key, accept_key = jax.random.split(st.key, 3)
  ctx = DraftContext(key=draft_key, tokens=st.tokens, lengths=st.lengths, sampling=env.sampling,
                     target_params=env.target_params, num_draft=spec.depth, greedy=env.greedy,
                     target_cache=st.cache)
  tree, dstate = env.drafter.propose_tree(env.drafter_params, st.drafter_state, ctx, spec)
  last = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)[:, 0]
  tree = tree.replace(tokens=jnp.where(tree.valid, tree.tokens, 0).at[:, 0].set(last))
  mask = ancestor_mask(tree.parents, spec.depth)
  positions = st.lengths[:, None] - 1 + tree.depths
  out = forward(env.target_params, env.config, tree.tokens, st.cache, st.lengths - 1,
                positions=positions, tree_mask=mask, return_layers=env.layers)
  if env.greedy:
    amax = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
    emitted, path, n_acc = verify_tree_greedy(tree, amax, spec.depth)
  else:
    p = sampling_lib.probs(out.logits, env.sampling)
    emitted, path, n_acc = verify_tree(accept_key, tree, p, spec.depth)
  tokens, lengths, done, n_emit = engine.commit_step(st.tokens, st.lengths, st.done, emitted,
                                                     n_acc, env.stop_tokens, env.limit)
  cache = move_accepted_kv(out.cache, st.lengths, path, n_acc)
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
                   key=key)
  return engine.update_stats(st, new, drafted, n_acc, n_emit)
