"""Draft trees in fixed shapes: DraftTree, ancestor masks, EAGLE-2's dynamic tree, DDTree's
best-first tree, n-gram tries (the package docstring has the math)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sampling as sampling_lib
from spec_jax.tree.spec import TreeSpec

DYNAMIC_CANDIDATES = ("topk", "sampled", "distinct")     # what build_dynamic_tree draws


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
  q_vocab: int32 [V_d] or None. With a drafter that proposes only V_d tokens (an EAGLE-3 draft
    vocabulary), q is [B, N+1, V_d] over these target ids (zero elsewhere): at a 128k
    vocabulary and 32,000 draft tokens a 4x smaller buffer (the largest of an 8B tree round
    beside the target's logits, docs/accelerators.md). None: q spans all V.
  distinct: (static) the children were drawn from q without replacement, in index order.
  """
  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  valid: jax.Array
  q: Optional[jax.Array] = None
  q_vocab: Optional[jax.Array] = None
  distinct: bool = flax.struct.field(pytree_node=False, default=False)


def expand_q(q_rows, q_vocab, vocab_size: int):
  """q rows [..., V_d] over the target ids q_vocab -> [..., V] (zero elsewhere); q_vocab None:
  the rows as they are."""
  if q_vocab is None:
    return q_rows
  full = jnp.zeros(q_rows.shape[:-1] + (vocab_size,), q_rows.dtype)
  return full.at[..., q_vocab].set(q_rows)


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


ExpandFn = Callable[[jax.Array, jax.Array, jax.Array, int, Any], tuple]


def build_dynamic_tree(root_logits, expand: ExpandFn, carry, spec: TreeSpec, *, key, sampling,
                       candidates: str = "topk", rank_by_score: bool = False, vocab=None):
  """EAGLE-2's dynamic tree (module docstring), with top-k or sampled candidates.

  Args:
    root_logits: float [B, V], the drafter's logits for the token after the last committed one
      (with vocab: [B, V_d], over vocab's ids).
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
    vocab: int32 [V_d] target ids, or None: the only tokens the drafter proposes (an EAGLE-3
      draft vocabulary); root_logits and expand's logits are then over these ids only (the
      logit -inf everywhere else, implied), candidates are drawn among them and mapped to
      target ids, and a sampled tree keeps q over them only (DraftTree.q_vocab), q being
      sampling.probs(..., columns=vocab): nothing V-wide is built (at 128k tokens and a
      32,000-token draft vocabulary, the full-vocabulary logits and q of a frontier were the
      largest buffers of an 8B tree round on TPU, docs/accelerators.md).

  Returns:
    (DraftTree with N+1 nodes (q set for sampled candidates), carry).
  """
  if candidates not in DYNAMIC_CANDIDATES:
    raise ValueError(f"build_dynamic_tree draws candidates of kind {DYNAMIC_CANDIDATES} "
                     f"(resolve 'auto' with TreeSpec.candidates_for; 'best_first' trees come "
                     f"from build_best_first_tree), got {candidates!r}")
  b, v = root_logits.shape
  if vocab is not None:
    vocab = jnp.asarray(vocab, jnp.int32)
    if v != vocab.shape[0]:
      raise ValueError(f"build_dynamic_tree with a draft vocabulary of {vocab.shape[0]} ids "
                       f"takes logits over those ids, got logits over {v} tokens")
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
      if vocab is not None:                            # draft ids -> target ids
        toks = jnp.take(vocab, toks)
      score = f_score[:, :, None] + lp
      # A token the drafter gives probability 0 is no candidate.
      valid = f_valid[:, :, None] & (lp > -jnp.inf)
      return flat(toks.astype(jnp.int32)), flat(score), flat(score), flat(valid), None
    q = sampling_lib.probs(logits, sampling, columns=vocab)
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
    if vocab is not None:                              # draft ids -> target ids
      toks = jnp.take(vocab, toks)
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
    q_all = jnp.zeros((b, n + 1, q_root.shape[-1]), jnp.float32).at[:, 0].set(q_root[:, 0])
    for cands, q in frontier_q:
      # A frontier node that was not kept maps to -1: dropped by the scatter.
      at = jnp.take_along_axis(node_of, cands, axis=1)
      q_all = q_all.at[rows, jnp.where(at < 0, n + 1, at)].set(q, mode="drop")
    tree = tree.replace(q=q_all, q_vocab=vocab)
  return tree, carry


NodeLogitsFn = Callable[[jax.Array, jax.Array], jax.Array]


def _sorted_children(logits, k: int):
  """The k likeliest children, best first: logits float [..., V] -> (log q float32 [..., k],
  tokens int32 [..., k]); log q = log_softmax(logits) (the drafter's own distribution)."""
  logp = jnp.minimum(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), 0.0)
  lp, toks = jax.lax.top_k(logp, k)
  return lp, toks.astype(jnp.int32)


def build_best_first_tree(slot_logits, spec: TreeSpec,
                          node_logits: Optional[NodeLogitsFn] = None) -> DraftTree:
  """DDTree's best-first draft tree: the N likeliest root-to-node sequences (package docstring).

  Ringel & Romano 2026, "Accelerating Speculative Decoding with Block Diffusion Draft Trees"
  (liranringel/ddtree `ddtree.py` build_ddtree_tree): a node's score is the sum of the log q of
  its path's tokens; with every child list sorted once (best first), the classic k-best
  enumeration pops the best frontier entry and pushes its first child and its next sibling.
  Every sequence but the root's first child has one predecessor of no lower score (its previous
  sibling, or its parent when it is a first child), so the pops come in score order and the N
  popped nodes are exactly the N best sequences, a prefix-closed set (ties: the earlier
  frontier slot). Fixed shapes: a `lax.fori_loop` over the N pops with a frontier of N + 1
  slots (each pop frees one slot for the sibling and fills one new slot with the child).

  Args:
    slot_logits: float [B, D, V] (D >= spec.depth): slot_logits[:, d] is the child
      distribution of the nodes at depth d (d = 0: the root's children), as a block drafter's
      slot d + 1 gives it (DFlash: one marginal per depth, the same for every node there; each
      depth's tokens are sorted once).
    spec: TreeSpec; depth D bounds the nodes' depth, num_nodes N is the budget, top_k caps the
      children of one node (rank < top_k; DDTree's tree is top_k >= num_nodes: no cap).
    node_logits: None (the factorized q above), or a function (tokens int32 [B], depths int32
      [B], 1 <= depth) -> logits float [B, V] of the children of a node holding that token at
      that depth (DSpark: the Markov head conditions slot d on the token at slot d - 1; then a
      node's children are computed and sorted when it is popped, and the tree is the best-first
      search over the drafter's autoregressive q; slot_logits[:, 0] still gives the root's).

  Returns:
    DraftTree with N+1 nodes in pop order (a node's parent comes before it: topological),
    deterministic candidates (q None; verified like top-k trees, lossless at every
    temperature). Nodes beyond the sequences of positive probability are invalid padding.
  """
  b, d_slots, v = slot_logits.shape
  d_max, n = spec.depth, spec.num_nodes
  if d_slots < d_max:
    raise ValueError(f"build_best_first_tree: slot_logits has {d_slots} slots, TreeSpec.depth "
                     f"is {d_max}")
  k = min(spec.top_k, n, v)
  rows = jnp.arange(b)
  neg = jnp.float32(-jnp.inf)
  if node_logits is None:
    presorted = _sorted_children(slot_logits[:, :d_max], k)            # [B, D, k] each
    root_lp, root_tok = presorted[0][:, 0], presorted[1][:, 0]
  else:
    root_lp, root_tok = _sorted_children(slot_logits[:, 0], k)

  def children_of(tokens, depths):
    """Sorted children of B nodes (one per row) -> log q [B, k], tokens [B, k]."""
    if node_logits is None:
      at = jnp.minimum(depths, d_max - 1)
      return presorted[0][rows, at], presorted[1][rows, at]
    return _sorted_children(node_logits(tokens, depths), k)

  zeros = lambda dtype: jnp.zeros((b, n + 1), dtype)
  nodes = dict(tok=zeros(jnp.int32), par=zeros(jnp.int32).at[:, 0].set(-1),
               depth=zeros(jnp.int32), score=zeros(jnp.float32),
               valid=zeros(bool).at[:, 0].set(True),
               kid_lp=jnp.full((b, n + 1, k), neg).at[:, 0].set(root_lp),
               kid_tok=jnp.zeros((b, n + 1, k), jnp.int32).at[:, 0].set(root_tok))
  frontier = dict(score=jnp.full((b, n + 1), neg).at[:, 0].set(root_lp[:, 0]),
                  par=jnp.zeros((b, n + 1), jnp.int32), rank=jnp.zeros((b, n + 1), jnp.int32))

  def pop(i, carry):
    nodes, frontier = carry
    new = i + 1                                      # this pop's node id (and child slot)
    j = jnp.argmax(frontier["score"], axis=1)        # ties: the earlier slot
    score = frontier["score"][rows, j]
    par, rank = frontier["par"][rows, j], frontier["rank"][rows, j]
    valid = score > neg
    tok = nodes["kid_tok"][rows, par, rank]
    depth = nodes["depth"][rows, par] + 1
    kid_lp, kid_tok = children_of(tok, depth)
    nodes = dict(
        tok=nodes["tok"].at[:, new].set(jnp.where(valid, tok, 0)),
        par=nodes["par"].at[:, new].set(jnp.where(valid, par, 0)),
        depth=nodes["depth"].at[:, new].set(jnp.where(valid, depth, 1)),
        score=nodes["score"].at[:, new].set(score),
        valid=nodes["valid"].at[:, new].set(valid),
        kid_lp=nodes["kid_lp"].at[:, new].set(kid_lp),
        kid_tok=nodes["kid_tok"].at[:, new].set(kid_tok))
    # The next sibling takes the popped slot; the first child a fresh one (slot `new`).
    sib_rank = jnp.minimum(rank + 1, k - 1)
    sib = nodes["score"][rows, par] + nodes["kid_lp"][rows, par, sib_rank]
    sib = jnp.where(valid & (rank + 1 < k), sib, neg)
    child = jnp.where(valid & (depth < d_max), score + kid_lp[:, 0], neg)
    frontier = dict(
        score=frontier["score"].at[rows, j].set(sib).at[:, new].set(child),
        par=frontier["par"].at[rows, j].set(par).at[:, new].set(new),
        rank=frontier["rank"].at[rows, j].set(sib_rank).at[:, new].set(0))
    return nodes, frontier

  nodes, _ = jax.lax.fori_loop(0, n, pop, (nodes, frontier))
  return DraftTree(tokens=nodes["tok"], parents=nodes["par"], depths=nodes["depth"],
                   valid=nodes["valid"])


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
