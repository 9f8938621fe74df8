"""Verify attention over many new tokens (prefill) in key blocks: bounded memory, pure jnp.

verify_attention_reference materialises float32 scores [B, Hq, T, S] over the whole cache
capacity S: for a prefill of T = 512 tokens into a 4096-slot cache at batch 8 with 32 heads that
is 2 GiB per layer (issue 35), most of it for slots no query can see. This computes the same
attention one block of `block` cache slots at a time with an online softmax (flash attention's
recurrence, in float32), in a `lax.while_loop` that visits only the blocks below the longest
row's kv_lengths (and, with a sliding window, none before the earliest visible key): the live
scores are [B, Hkv, G*T, block] float32. Same masking rules and arguments as the reference
(tree masks of width W >= T, sliding windows, both cache layouts); equal to it up to float
rounding (tests/test_kernels_blocked.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import lanes
from kernels_pallas.layout import NEG_INF, cdiv
from kernels_pallas.reference import visibility

BLOCK = 256          # cache slots per step (8B prefill, P = 512: 128 MiB of f32 scores)


def verify_attention_blocked(q, k_cache, v_cache, kv_lengths, tree_mask=None,
                             sliding_window=None, *, head_major: bool = False,
                             block: int = BLOCK, layer=None):
  """verify_attention_reference's contract (see it for the arguments) in key blocks.

  q [B, T, Hq, D]; k_cache, v_cache [B, S, Hkv, D] (head_major: [B, Hkv, S, D], or lane-packed
  [B, Hkv/p, S, p*D], kernels_pallas.lanes: each block unpacked as it is read); kv_lengths
  int32 [B]; tree_mask bool [B, T, W] or None; sliding_window int or None; block: cache slots
  per step (capped at S). layer: k_cache and v_cache are stacked [L, ...] caches and this
  (static) slab is attended to: each step slices its key block straight out of the stack (a
  slab k_cache[layer] carried into the loop was a copy of the layer's cache on TPU).
  Returns [B, T, Hq, D] in q's dtype.
  """
  b, t, hq, d = q.shape
  stack = (k_cache, v_cache)
  if layer is not None:
    k_cache, v_cache = k_cache[layer], v_cache[layer]    # for the shapes only
  # A lane-packed head-major cache [B, Hkv/p, S, p*D] (kernels_pallas.lanes): each key block
  # is unpacked as it is read, never the whole slab.
  packed = lanes.packing(k_cache.shape[-1], d) if head_major else 1
  if head_major:
    hkv, s = k_cache.shape[1] * packed, k_cache.shape[2]
  else:
    s, hkv = k_cache.shape[1], k_cache.shape[2]
  group = hq // hkv
  block = max(1, min(int(block), s))
  num_blocks = cdiv(s, block)
  dtype = jnp.promote_types(q.dtype, k_cache.dtype)
  acc_type = jnp.float32 if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else None
  qc = q.astype(dtype)
  seq_axis = 2 if head_major else 1
  m_rows = group * t
  qm = (qc.reshape(b, t, hkv, group, d).transpose(0, 2, 3, 1, 4)
        .reshape(b, hkv, m_rows, d))                                       # row = g * T + t
  lengths = kv_lengths.astype(jnp.int32)
  hi = jnp.minimum(cdiv_traced(jnp.max(lengths), block), num_blocks)
  lo = jnp.zeros((), jnp.int32)
  if sliding_window is not None:      # no key at or before (first query position - window)
    first_query = jnp.min(lengths) - t
    lo = jnp.clip((first_query - sliding_window + 1) // block, 0, num_blocks - 1)
  scale = d ** -0.5

  def body(carry):
    i, m, l, acc = carry
    # The last block of a ragged cache is shifted to end at S; keys it shares with the block
    # before are masked as already counted ("fresh").
    start = jnp.minimum(i * block, s - block)
    if layer is None:
      keys, vals = (jax.lax.dynamic_slice_in_dim(c, start, block, axis=seq_axis).astype(dtype)
                    for c in (k_cache, v_cache))
    else:
      at = [jnp.int32(layer)] + [jnp.int32(0)] * 4
      at[1 + seq_axis] = start
      size = list(stack[0].shape)
      size[0], size[1 + seq_axis] = 1, block
      keys, vals = (jax.lax.dynamic_slice(c, at, size)[0].astype(dtype) for c in stack)
    if not head_major:                                 # one block [B,blk,Hkv,D] -> [B,Hkv,blk,D]
      keys, vals = jnp.swapaxes(keys, 1, 2), jnp.swapaxes(vals, 1, 2)
    elif packed > 1:                                   # [B,Hkv/p,blk,p*D] -> [B,Hkv,blk,D]
      keys, vals = lanes.unpack(keys, packed), lanes.unpack(vals, packed)
    pos = start + jnp.arange(block, dtype=jnp.int32)
    # Slots past a row's length may hold anything; 0 * inf would be NaN in the second product.
    filled = pos[None, :] < lengths[:, None]                                # [B,blk]
    vals = jnp.where(filled[:, None, :, None], vals, jnp.zeros((), vals.dtype))
    vis = visibility(lengths, t, block, tree_mask, sliding_window, key_positions=pos)
    vis = vis & (pos >= i * block)[None, None, :]                           # [B,T,blk]
    vis = jnp.broadcast_to(vis[:, None, None], (b, 1, group, t, block)).reshape(
        b, 1, m_rows, block)
    scores = jnp.einsum("bhmd,bhkd->bhmk", qm, keys, preferred_element_type=acc_type)
    scores = jnp.where(vis, scores.astype(jnp.float32) * scale, NEG_INF)
    m_next = jnp.maximum(m, jnp.max(scores, axis=-1))
    alpha = jnp.exp(m - m_next)
    p = jnp.where(vis, jnp.exp(scores - m_next[..., None]), 0.0)
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bhmk,bhkd->bhmd", p.astype(vals.dtype), vals,
                    preferred_element_type=acc_type)
    return i + 1, m_next, l, acc * alpha[..., None] + pv.astype(jnp.float32)

  m0 = jnp.full((b, hkv, m_rows), NEG_INF, jnp.float32)
  init = (lo, m0, jnp.zeros_like(m0), jnp.zeros((b, hkv, m_rows, d), jnp.float32))
  _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < hi, body, init)
  out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
  out = out.reshape(b, hkv, group, t, d).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, t, hq, d).astype(q.dtype)


def cdiv_traced(a, b: int):
  """ceil(a / b) for a traced int32 a >= 0."""
  return (a + b - 1) // b
