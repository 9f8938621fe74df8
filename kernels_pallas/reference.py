"""Pure-jnp verify attention: the test oracle and the fallback of every kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _products(q, k_cache, v_cache):
  """(q, k, v, preferred element type) for the two products: in the promoted dtype of q and
  the cache, with a float32 accumulator when that is bfloat16 / float16 (the kernels' rule:
  bf16 operands, f32 accumulation; a float32 query on a bf16 cache computes in float32)."""
  dtype = jnp.promote_types(q.dtype, k_cache.dtype)
  low = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return (q.astype(dtype), k_cache.astype(dtype), v_cache.astype(dtype),
          jnp.float32 if low else None)


def visibility(kv_lengths, t: int, s: int, tree_mask=None, sliding_window=None,
               key_positions=None):
  """bool [B, T, S]: which cache entries each of the T new queries may attend to (the masking
  rules of verify_attention_reference, shared by both cache layouts). key_positions: optional
  int32 [S] cache slots of the S keys asked about (default 0 .. S-1; the blocked attention
  asks one block at a time)."""
  b = kv_lengths.shape[0]
  kv_lengths = kv_lengths.astype(jnp.int32)
  if key_positions is None:
    key_positions = jnp.arange(s, dtype=jnp.int32)
  key_pos = key_positions.astype(jnp.int32)[None, None, :]                  # [1,1,S]
  query_pos = (kv_lengths[:, None] - t + jnp.arange(t, dtype=jnp.int32))[:, :, None]  # [B,T,1]
  w = t if tree_mask is None else tree_mask.shape[-1]
  prefix = key_pos < (kv_lengths[:, None, None] - w)                         # [B,1,S]
  new_idx = key_pos - (kv_lengths[:, None, None] - w)                        # [B,1,S] in [0,W)
  is_new = (new_idx >= 0) & (key_pos < kv_lengths[:, None, None])
  if tree_mask is None:
    new_ok = new_idx <= jnp.arange(t, dtype=jnp.int32)[None, :, None]
  else:
    clipped = jnp.clip(new_idx, 0, w - 1)
    new_ok = jnp.take_along_axis(tree_mask, jnp.broadcast_to(clipped, (b, t, s)), axis=2)
  visible = prefix | (is_new & new_ok)                                       # [B,T,S]
  if sliding_window is not None:
    visible &= key_pos > query_pos - sliding_window
  return visible


def verify_attention_reference(q, k_cache, v_cache, kv_lengths, tree_mask=None,
                               sliding_window=None, *, head_major: bool = False):
  """T new queries per row attend to a KV cache whose last T valid entries are the new tokens.

  Args:
    q: [B, T, Hq, D] queries (already RoPE'd).
    k_cache, v_cache: [B, S, Hkv, D]; Hq is a multiple of Hkv (grouped-query attention). With
      head_major=True they are [B, Hkv, S, D] instead (spec_jax's KV cache on the jnp path:
      the attention's batched dots then read each head's keys in place, where the [B, S, Hkv,
      D] layout costs XLA:CPU a transposing copy of every layer's cache per step).
    kv_lengths: int32 [B], valid cache entries INCLUDING the T new tokens, which sit at
      positions kv_lengths[b]-T .. kv_lengths[b]-1.
    tree_mask: optional bool [B, T, W] with T <= W: tree_mask[b, t, j] lets new query t see
      cache entry kv_lengths[b]-W+j, one of the last W entries (which end with the T new
      tokens); entries before them are all visible. W = T (the kernels' form): among the new
      tokens only. None means causal (j <= t). (W > T lets draft trees add nodes to a tree
      whose earlier nodes are already in the cache.)
    sliding_window: optional int; key positions <= query position - window are hidden.

  Returns:
    [B, T, Hq, D] in q's dtype; scores, softmax and the weighted sum accumulate in float32 (with
    bf16 q and cache: bf16 operands, f32 accumulators, the weights rounded to bf16 for the
    second product, as the kernels do).
  """
  b, t, hq, d = q.shape
  if head_major:
    hkv, s = k_cache.shape[1], k_cache.shape[2]
  else:
    s, hkv = k_cache.shape[1], k_cache.shape[2]
  group = hq // hkv
  visible = visibility(kv_lengths, t, s, tree_mask, sliding_window)          # [B,T,S]
  # Slots past a row's length may hold anything (a rejected draft's non-finite K/V): their
  # weight is 0, and 0 * inf would still be NaN in the second product, so V is zeroed there
  # too, as the kernels do.
  filled = jnp.arange(s, dtype=jnp.int32)[None, :] < kv_lengths.astype(jnp.int32)[:, None]
  if head_major:
    return _head_major_attention(q, k_cache, v_cache, visible, group, filled)
  qc, kc, vc, acc = _products(q, k_cache, v_cache)
  vc = jnp.where(filled[:, :, None, None], vc, jnp.zeros((), vc.dtype))
  qg = qc.reshape(b, t, hkv, group, d)
  scores = jnp.einsum("bthgd,bshd->bhgts", qg, kc, preferred_element_type=acc)
  scores = scores.astype(jnp.float32) * (d ** -0.5)
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  # A query always sees itself, so no row is all -inf when inputs are valid.
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhgts,bshd->bthgd", weights.astype(vc.dtype), vc, preferred_element_type=acc)
  return out.reshape(b, t, hq, d).astype(q.dtype)


def _head_major_attention(q, k_cache, v_cache, visible, group: int, filled):
  """The same attention over k_cache, v_cache [B, Hkv, S, D]. Each kv head's G query heads and
  T queries are folded into one M = G*T axis, so both products are plain batched matmuls over
  (B, Hkv) with no operand relaid out (an einsum keeping g and t apart was 2x slower on
  XLA:CPU, measured)."""
  b, t, hq, d = q.shape
  hkv, s = k_cache.shape[1], k_cache.shape[2]
  qc, kc, vc, acc = _products(q, k_cache, v_cache)
  vc = jnp.where(filled[:, None, :, None], vc, jnp.zeros((), vc.dtype))     # [B,S] -> [B,1,S,1]
  qm = (qc.reshape(b, t, hkv, group, d)
        .transpose(0, 2, 3, 1, 4).reshape(b, hkv, group * t, d))           # [B,Hkv,G*T,D]
  scores = jnp.einsum("bhmd,bhsd->bhms", qm, kc, preferred_element_type=acc)
  scores = scores.astype(jnp.float32) * (d ** -0.5)
  mask = jnp.broadcast_to(visible[:, None, None], (b, 1, group, t, s)).reshape(b, 1, group * t, s)
  scores = jnp.where(mask, scores, -jnp.inf)
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhms,bhsd->bhmd", weights.astype(vc.dtype), vc,
                   preferred_element_type=acc)                               # [B,Hkv,G*T,D]
  out = out.reshape(b, hkv, group, t, d).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, t, hq, d).astype(q.dtype)
