"""Lossless tree verification: greedy, one-hot candidates (recursive rejection), sampled
candidates (SpecInfer), distinct candidates (recursive rejection sampling); the plain oracle.
The package docstring has the math and the references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sampling as sampling_lib
from spec_jax.tree.build import DraftTree, expand_q


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
                residual=None, accept_ratio=None, q_vocab=None):
  """One row of `verify_tree`: a single pass over nodes 1..N in index order.

  Carry: cur (the node the accepted path has reached), r (the distribution the next token
  follows: p[cur], reduced by the rejected children of cur), qc (the proposal of cur's next
  child: q[cur], without the rejected children when they were drawn without replacement), n,
  path. Node j is a candidate iff it is a child of cur; then it is accepted with probability
  min(1, r(t)/qc(t)) (r(t) for one-hot drafts, q None), else r (and qc) become the residuals.
  Children of an accepted node come later in the order; those of a rejected one never match.
  q_vocab: q's rows are over these target ids (DraftTree.q_vocab); each is expanded to all V
  when the walk reaches its node."""
  n1 = tokens.shape[0]
  full = lambda q_row: expand_q(q_row, q_vocab, p.shape[-1])
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
      qc = jnp.where(accept, full(q[j]), jnp.where(is_child, rejected_q, qc))
    at = jnp.minimum(n, depth - 1)
    path = path.at[at].set(jnp.where(accept, j, path[at]))
    return jnp.where(accept, j, cur), r, qc, n + accept.astype(jnp.int32), path

  qc0 = jnp.zeros((), jnp.float32) if q is None else full(q[0])
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
                                                    accept_ratio=accept_ratio,
                                                    q_vocab=tree.q_vocab)
  if tree.q is None:
    path, n, final = jax.vmap(lambda k_, t, par, val, pp: fn(k_, t, par, val, pp, None))(
        keys, tree.tokens, tree.parents, tree.valid, p)
  else:
    path, n, final = jax.vmap(fn)(keys, tree.tokens, tree.parents, tree.valid, p,
                                  tree.q.astype(jnp.float32))
  return _emitted(tree.tokens, path, n, final, depth), path, n


def verify_tree_logits(key, tree: DraftTree, target_logits, sampling, depth: int, *,
                       residual=None, accept_ratio=None):
  """`verify_tree` with p = sampling.probs(target_logits) computed one row at a time.

  The same result, bit for bit (the same per-row keys and the same row computation), but only
  one row's [N+1, V] probabilities and filter buffers (top-k / top-p's sort) exist at a time
  rather than the batch's: at B = 8, a 32-node tree and a 128k vocabulary each [B, N+1, V]
  float32 buffer is 125 MiB, and the batched transform kept about ten of them live (XLA:TPU's
  buffer report, docs/accelerators.md). Without the penalties' history (with one, call
  sampling.probs and verify_tree).

  Args:
    target_logits: float [B, N+1, V] the target's logits at every node.
    sampling: the per-row Sampling (leaves [B, ...] or scalars).
    key, tree, depth, residual, accept_ratio: as verify_tree.
  Returns: as verify_tree.
  """
  b = tree.tokens.shape[0]
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
  rows = jax.tree.map(lambda x: jnp.broadcast_to(x, (b,)) if jnp.ndim(x) == 0 else x, sampling)
  q = None if tree.q is None else tree.q.astype(jnp.float32)

  def one_row(xs):
    key_, tokens, parents, valid, logits, q_row, setting = xs
    p = sampling_lib.probs(logits[None], jax.tree.map(lambda x: x[None], setting))[0]
    return _verify_row(key_, tokens, parents, valid, p, q_row, depth=depth,
                       distinct=tree.distinct, residual=residual, accept_ratio=accept_ratio,
                       q_vocab=tree.q_vocab)

  path, n, final = jax.lax.map(one_row, (keys, tree.tokens, tree.parents, tree.valid,
                                         target_logits, q, rows))
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
  q = None if tree.q is None else expand_q(jnp.asarray(tree.q, jnp.float32), tree.q_vocab,
                                           p.shape[-1])
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
