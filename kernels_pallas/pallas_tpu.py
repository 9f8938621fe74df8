"""Verify attention on TPU: Pallas with the Mosaic lowering, flash-decoding style.

Grid (batch, kv-head block, cache block), the last one sequential ("arbitrary"): the output
block and the float32 online-softmax state (VMEM scratch) stay resident while the cache blocks
of one (row, kv head) stream through. kv_lengths is scalar-prefetched into SMEM, so the KV
index_map clamps every block past kv_lengths[b] to the last valid one: Pallas sees the same
block index again and issues no DMA, and `pl.when` skips the compute. Every KV byte below
kv_lengths is read from HBM once, for all T new queries and all query heads of its group at
once (folded into the rows of one [rows, D] x [D, block_k] matmul, see layout.py).

The cache [B, S, Hkv, D] is viewed as [B, S, Hkv * D] (a free reshape), so one KV head's block
is a [block_k, D] window: Mosaic wants the last two block dims divisible by (8, 128) or equal to
the array's. With D < 128 a block carries 128 // D heads (lane slices inside the kernel).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import lanes, layout
from kernels_pallas.lanes import LANES, heads_per_block

# Tuned defaults (bfloat16, D=128; see python -m kernels_pallas.bench).
BLOCK_K = 512          # cache entries per grid step; a multiple of 8 (128 is best for lanes)
MAX_ROWS = 512         # most folded query rows (T * group, padded) kept in VMEM
ROW_ALIGN = 16         # rows padded to a multiple of this (bfloat16 packs 16 sublanes)

SUPPORTED_DTYPES = ("float32", "bfloat16")


def unsupported_reason(q_shape, kv_shape, q_dtype, kv_dtype, block_k: int = BLOCK_K,
                       head_major: bool = False):
  """None when the TPU kernel handles these shapes, else why not (the dispatcher falls back).
  kv_shape: [B, S, Hkv, D] (a head-major cache's shape given in this order too)."""
  _, t, hq, d = q_shape
  hkv = kv_shape[2]
  if not head_major and heads_per_block(hkv, d) is None:
    return (f"head_dim {d} with {hkv} kv heads: need head_dim % {LANES} == 0, or "
            f"{LANES} % head_dim == 0 with kv heads a multiple of {LANES} // head_dim")
  if t > layout.MAX_NEW_TOKENS:
    return (f"T={t} new tokens > {layout.MAX_NEW_TOKENS} ({layout.MAX_WORDS} 32-bit mask words "
            f"per query row)")
  rows = layout.round_up(t * (hq // hkv), ROW_ALIGN)
  if rows > MAX_ROWS:
    return f"T * (Hq // Hkv) = {t * (hq // hkv)} query rows per kv head > {MAX_ROWS}"
  for name, dt in (("q", q_dtype), ("k/v cache", kv_dtype)):
    if jnp.dtype(dt).name not in SUPPORTED_DTYPES:
      return f"{name} dtype {jnp.dtype(dt).name} not in {SUPPORTED_DTYPES}"
  if block_k % 8:
    return f"block_k {block_k} is not a multiple of 8"
  return None


def _kernel(len_ref, q_ref, *refs, block_k: int, num_blocks: int, num_new: int,
            head_dim: int, sm_scale: float, compute_dtype, precision):
  # refs: num_words(T) bits refs, k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr.
  # len_ref: SMEM int32[B]; q_ref: [hpb, rows, D]; each bits ref: [rows, 1] (one mask word);
  # k_ref, v_ref: [block_k, hpb * D]; o_ref: [hpb, rows, D];
  # m_scr, l_scr: [hpb, rows, LANES] f32 (lane-replicated); acc_scr: [hpb, rows, D] f32.
  bits_refs, (k_ref, v_ref, o_ref, m_scr, l_scr, acc_scr) = refs[:-6], refs[-6:]
  b, i = pl.program_id(0), pl.program_id(2)
  length = len_ref[b]
  hpb = q_ref.shape[0]

  @pl.when(i == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, layout.NEG_INF, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(i * block_k < length)
  def _step():
    key_pos = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    vis = layout.visible(key_pos, length, num_new,
                         [r[...] for r in bits_refs])                      # [rows, block_k]
    # Rows of a partial last block (S % block_k) or past the length may hold anything.
    v_ok = (i * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)) < length
    for j in range(hpb):
      lanes = slice(j * head_dim, (j + 1) * head_dim)
      q = q_ref[j].astype(compute_dtype)
      k = k_ref[:, lanes].astype(compute_dtype)
      v = v_ref[:, lanes].astype(compute_dtype)
      s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                              preferred_element_type=jnp.float32) * sm_scale
      s = jnp.where(vis, s, layout.NEG_INF)
      m_prev = m_scr[j]                                                    # [rows, LANES]
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      alpha = jnp.exp(m_prev - m_next)
      p = jnp.where(vis, jnp.exp(s - m_next[:, :1]), 0.0)
      l_scr[j] = alpha * l_scr[j] + jnp.sum(p, axis=1, keepdims=True)
      m_scr[j] = m_next
      v = jnp.where(v_ok, v, jnp.zeros_like(v))
      pv = jax.lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)
      acc_scr[j] = acc_scr[j] * alpha[:, :1] + pv

  @pl.when(i == num_blocks - 1)
  def _finish():
    for j in range(hpb):
      l = l_scr[j][:, :1]
      o_ref[j] = (acc_scr[j] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_k", "interpret", "layer", "head_major"))
def verify_attention_pallas_tpu(q, k_cache, v_cache, kv_lengths, tree_mask=None, *,
                                block_k: int = BLOCK_K, interpret=False,
                                layer: int | None = None, head_major: bool = False):
  """Verify attention (DESIGN.md semantics) with the Mosaic-lowered Pallas kernel.

  Shapes as in kernels_pallas.verify_attention; inputs are assumed valid (the dispatcher checks
  them). block_k: cache entries per grid step (a multiple of 8, capped at S); interpret: run
  the kernel with the Pallas interpreter (any backend, e.g. CPU tests). layer: k_cache and
  v_cache are a stacked cache [L, B, ...] and the kernel reads slab `layer` in place (a slice
  k_cache[layer] handed to a custom call is a copy of that layer's cache, every call).
  head_major: the caches are [B, Hkv, S, D] ([L, B, Hkv, S, D] with layer), spec_jax's TPU
  layout: one head's [block_k, D] window is a legal Mosaic block for any D, read in place; or
  lane-packed [B, Hkv / p, S, p * D] (kernels_pallas.lanes: a cache minor dim p times q's D),
  whose [block_k, p * D] windows carry p heads, sliced out of the lanes in the kernel. (The
  [B, S, Hkv, D] layout is viewed as [B, S, Hkv * D], which on TPU is not free: the tiled
  layout of the two minor dims changes, so XLA copies the cache before every call.)
  """
  lead = 1 if layer is None else k_cache.shape[0] * k_cache.shape[1]
  if layer is not None:                                   # free: merges the two major dims
    k_cache, v_cache = (c.reshape((lead,) + c.shape[2:]) for c in (k_cache, v_cache))
  b, t, hq, d = q.shape
  # A head-major cache may pack p heads along its lanes: [., Hkv / p, S, p * D] (lanes.py).
  packed = lanes.packing(k_cache.shape[-1], d) if head_major else 1
  s, hkv = (k_cache.shape[2], k_cache.shape[1] * packed) if head_major else k_cache.shape[1:3]
  row0 = 0 if layer is None else layer * b                # the layer's first row of [L*B, ...]
  view = (k_cache.shape[0], s, hkv, d)
  reason = unsupported_reason(q.shape, view, q.dtype, k_cache.dtype, block_k,
                              head_major=head_major)
  if reason is not None:
    raise ValueError(f"verify_attention_pallas_tpu: {reason}")
  group = hq // hkv
  hpb = packed if head_major else heads_per_block(hkv, d)
  block_k = min(block_k, s)          # a block as long as the cache is always legal
  num_blocks = layout.cdiv(s, block_k)
  rows = layout.round_up(t * group, ROW_ALIGN)

  compute_dtype = jnp.promote_types(q.dtype, k_cache.dtype)
  q_rows = layout.fold_queries(q, hkv, rows)                      # [B, Hkv, rows, D]
  bits = [w[..., None] for w in layout.row_bits(tree_mask, b, t, group, rows)]  # [B, rows, 1]
  lengths = kv_lengths.astype(jnp.int32)
  if head_major:
    k_flat, v_flat = k_cache, v_cache                             # [., Hkv / p, S, p * D]
    kv_block = (None, None, block_k, hpb * d)
  else:
    k_flat = k_cache.reshape(-1, s, hkv * d)                      # merges minor dims
    v_flat = v_cache.reshape(-1, s, hkv * d)
    kv_block = (None, block_k, hpb * d)

  def kv_index(bi, h, i, lens):
    last = jnp.maximum(jax.lax.div(lens[bi] + block_k - 1, block_k) - 1, 0)
    block = jnp.minimum(jnp.minimum(i, last), num_blocks - 1)
    return (row0 + bi, h, block, 0) if head_major else (row0 + bi, block, h)

  kernel = functools.partial(
      _kernel, block_k=block_k, num_blocks=num_blocks, num_new=t, head_dim=d,
      sm_scale=1.0 / math.sqrt(d), compute_dtype=compute_dtype,
      precision=layout.dot_precision(compute_dtype))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, hkv // hpb, num_blocks),
      in_specs=[
          pl.BlockSpec((None, hpb, rows, d), lambda bi, h, i, lens: (bi, h, 0, 0)),
          *[pl.BlockSpec((None, rows, 1), lambda bi, h, i, lens: (bi, 0, 0))] * len(bits),
          pl.BlockSpec(kv_block, kv_index),
          pl.BlockSpec(kv_block, kv_index),
      ],
      out_specs=pl.BlockSpec((None, hpb, rows, d), lambda bi, h, i, lens: (bi, h, 0, 0)),
      scratch_shapes=[
          pltpu.VMEM((hpb, rows, LANES), jnp.float32),
          pltpu.VMEM((hpb, rows, LANES), jnp.float32),
          pltpu.VMEM((hpb, rows, d), jnp.float32),
      ],
  )
  o = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, hkv, rows, d), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="verify_attention_tpu",
  )(lengths, q_rows, *bits, k_flat, v_flat)
  return layout.unfold_output(o, t, hq)
