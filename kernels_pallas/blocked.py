"""Blocked jnp verify attention: reads the KV cache only up to the longest row's length.

The reference (kernels_pallas.reference) scores every one of the S cache slots and masks the
unused ones, so a step costs the same at 50 tokens as at S; on the jnp path (CPU) that makes a
generous capacity bucket cost real time and favours speculation (a verify reads the cache once
for K+1 tokens, a plain step once per token). This version walks the cache in blocks of
`block` slots inside a `lax.while_loop` whose trip count is ceil(max(kv_lengths) / block),
merging blocks with the online softmax (Milakov & Gimelshein 2018; FlashAttention's
recurrence):

    m' = max(m, max_j s_j),   l' = l e^(m - m') + sum_j e^(s_j - m'),
    acc' = acc e^(m - m') + sum_j e^(s_j - m') v_j,   out = acc / l.

Same masking rules and dtypes as the reference (bf16 operands, f32 accumulation, the weights
rounded to the value dtype for the second product); results equal it to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.reference import _products, visibility

BLOCK = 256


def use_blocked(s: int, block: int = BLOCK) -> bool:
  """Whether a cache of S slots is walked in blocks (more than one block, and whole blocks)."""
  return s > block and s % block == 0


def verify_attention_blocked(q, k_cache, v_cache, kv_lengths, tree_mask=None, *,
                             head_major: bool = True, block: int = BLOCK):
  """verify_attention_reference's contract (no sliding window; tree_mask square [B, T, T] or
  None) over k_cache, v_cache [B, Hkv, S, D] (head_major) or [B, S, Hkv, D], S a multiple of
  `block`. Returns [B, T, Hq, D] in q's dtype."""
  b, t, hq, d = q.shape
  seq_axis = 2 if head_major else 1
  s = k_cache.shape[seq_axis]
  hkv = k_cache.shape[1] if head_major else k_cache.shape[2]
  if s % block:
    raise ValueError(f"blocked attention needs S ({s}) to be a multiple of block ({block})")
  group = hq // hkv
  qc, kc, vc, acc_type = _products(q, k_cache, v_cache)
  qm = (qc.reshape(b, t, hkv, group, d)
        .transpose(0, 2, 3, 1, 4).reshape(b, hkv, group * t, d))           # [B,Hkv,G*T,D]
  kv_lengths = kv_lengths.astype(jnp.int32)
  n_blocks = (jnp.max(kv_lengths) + block - 1) // block
  scale = d ** -0.5

  def body(i, carry):
    m, l, acc = carry
    start = i * block
    kb = jax.lax.dynamic_slice_in_dim(kc, start, block, axis=seq_axis)
    vb = jax.lax.dynamic_slice_in_dim(vc, start, block, axis=seq_axis)
    if not head_major:
      kb, vb = jnp.swapaxes(kb, 1, 2), jnp.swapaxes(vb, 1, 2)            # [B,Hkv,blk,D]
    scores = jnp.einsum("bhmd,bhsd->bhms", qm, kb, preferred_element_type=acc_type)
    scores = scores.astype(jnp.float32) * scale
    visible = visibility(kv_lengths, t, block, tree_mask, key_start=start)  # [B,T,blk]
    mask = jnp.broadcast_to(visible[:, None, None], (b, 1, group, t, block)).reshape(
        b, 1, group * t, block)
    scores = jnp.where(mask, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)     # a row that saw nothing yet
    p = jnp.exp(scores - m_safe[..., None])
    correction = jnp.exp(m - m_safe)
    l = l * correction + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bhms,bhsd->bhmd", p.astype(vc.dtype), vb, preferred_element_type=acc_type)
    acc = acc * correction[..., None] + pv.astype(jnp.float32)
    return m_new, l, acc

  init = (jnp.full((b, hkv, group * t), -jnp.inf, jnp.float32),
          jnp.zeros((b, hkv, group * t), jnp.float32),
          jnp.zeros((b, hkv, group * t, d), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
  out = acc / l[..., None]
  out = out.reshape(b, hkv, group, t, d).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, t, hq, d).astype(q.dtype)
