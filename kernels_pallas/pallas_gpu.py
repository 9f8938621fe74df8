"""Verify attention on GPU: Pallas with the Triton lowering, flash-decoding style.

Grid (batch, kv head, row block, split). A program owns one KV head of one row, the
`block_rows` folded query rows of that head (T new queries x group query heads, see layout.py),
and one contiguous split of the cache. It loops (`lax.fori_loop`) over the `block_k` blocks of
its split that lie below kv_lengths[b], never touching the blocks past it, with an online softmax
in float32, and writes an unnormalised partial (acc, max, sum). A log-sum-exp combine in jnp
merges the splits. Splitting the cache is what lets batch 1 with a long cache fill the chip:
B * Hkv programs alone leave most SMs idle.

The cache is read in place ([B, S, Hkv, D] with strided loads: no transpose, no padding copy).
When S is not a multiple of block_k, the last block is shifted left to end at S and the keys it
shares with the previous block are masked, so no load ever leaves the array.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import layout

# Tuned defaults (for D=128 bfloat16 on Hopper; see python -m kernels_pallas.bench).
BLOCK_K = 64            # keys per inner step; a power of 2 >= 16
BLOCK_ROWS = 64         # most folded query rows per program; more rows make more row blocks
NUM_WARPS = 4
NUM_STAGES = 2
TARGET_PROGRAMS = 264   # aim for ~2 programs per SM (H100/H200: 132 SMs) when picking splits
MIN_BLOCKS_PER_SPLIT = 4  # below this the partial-output traffic outweighs the extra programs

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 512
# Heads wider than 256 (Gemma 4's 512-wide global layers): a program's q, accumulator and K / V
# tiles grow with D, so they take smaller tiles and more warps: at D = 512, block_k 16 and 16
# rows, the f32 accumulator is 16 x 512 over 8 warps (32 registers a thread) and each K / V
# tile 16 x 512 bf16. Lowered to Triton and checked in interpret mode here; register use and
# speed on a GPU were never measured (docs/accelerators.md).
WIDE_HEAD_DIM = 256
WIDE_BLOCK_K, WIDE_BLOCK_ROWS, WIDE_NUM_WARPS = 16, 16, 8


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _pow2_floor(n: int) -> int:
  return 1 << (n.bit_length() - 1)


def unsupported_reason(q_shape, kv_shape, q_dtype, kv_dtype, block_k: int = BLOCK_K):
  """None when the GPU kernel handles these shapes, else why not (the dispatcher falls back)."""
  _, t, _, d = q_shape
  s = kv_shape[1]
  if not (_is_pow2(d) and MIN_HEAD_DIM <= d <= MAX_HEAD_DIM):
    return f"head_dim {d} is not a power of 2 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (Triton tiles)"
  if s < 16:
    return f"cache length {s} < 16 (Triton dot tiles need 16 keys)"
  if t > layout.MAX_NEW_TOKENS:
    return (f"T={t} new tokens > {layout.MAX_NEW_TOKENS} ({layout.MAX_WORDS} 32-bit mask words "
            f"per query row)")
  for name, dt in (("q", q_dtype), ("k/v cache", kv_dtype)):
    if jnp.dtype(dt).name not in SUPPORTED_DTYPES:
      return f"{name} dtype {jnp.dtype(dt).name} not in {SUPPORTED_DTYPES}"
  if not (_is_pow2(block_k) and block_k >= 16):
    return f"block_k {block_k} is not a power of 2 >= 16"
  return None


def _kernel(len_ref, q_ref, *refs, block_k: int, blocks_per_split: int, seq_len: int,
            num_new: int, sm_scale: float, compute_dtype, precision):
  # refs: num_words(T) bits refs, k_ref, v_ref, o_ref, m_ref, l_ref.
  # len_ref: [] int32; q_ref: [rows, D]; each bits ref: [rows] (one mask word);
  # k_ref, v_ref: [S, D] (one KV head); o_ref: [rows, D] f32; m_ref, l_ref: [rows] f32 (this
  # split's partials).
  bits_refs, (k_ref, v_ref, o_ref, m_ref, l_ref) = refs[:-5], refs[-5:]
  split = pl.program_id(3)
  length = len_ref[()]
  q = q_ref[...].astype(compute_dtype)
  bits = [r[...][:, None] for r in bits_refs]
  rows, head_dim = q.shape
  num_blocks = layout.cdiv(seq_len, block_k)
  lo = split * blocks_per_split
  hi = jnp.minimum(jnp.minimum(lo + blocks_per_split, num_blocks),
                   jax.lax.div(length + block_k - 1, block_k))
  offsets = jnp.arange(block_k, dtype=jnp.int32)

  def body(i, carry):
    acc, m_prev, l_prev = carry
    # The last block of a ragged cache is shifted left to end at S; its overlap is masked below.
    start = jnp.minimum(i * block_k, seq_len - block_k)
    k = k_ref[pl.ds(start, block_k), :].astype(compute_dtype)
    v = v_ref[pl.ds(start, block_k), :].astype(compute_dtype)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * sm_scale
    pos = start + offsets
    fresh = pos >= i * block_k
    vis = layout.visible(pos[None, :], length, num_new, bits) & fresh[None, :]
    s = jnp.where(vis, s, layout.NEG_INF)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(vis, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    # Stale entries past the length are masked out of p; zero them too so that a non-finite
    # stale value cannot turn 0 * x into NaN.
    v = jnp.where(((pos < length) & fresh)[:, None], v, jnp.zeros_like(v))
    pv = jax.lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
    return alpha[:, None] * acc + pv, m_next, l_next

  acc = jnp.zeros((rows, head_dim), jnp.float32)
  m = jnp.full((rows,), layout.NEG_INF, jnp.float32)
  l = jnp.zeros((rows,), jnp.float32)
  acc, m, l = jax.lax.fori_loop(lo, hi, body, (acc, m, l))
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def pick_num_splits(batch: int, num_kv_heads: int, row_blocks: int, num_blocks: int) -> int:
  """Enough cache splits for ~TARGET_PROGRAMS programs, each with >= MIN_BLOCKS_PER_SPLIT."""
  base = batch * num_kv_heads * row_blocks
  want = layout.cdiv(TARGET_PROGRAMS, base)
  most = max(1, num_blocks // MIN_BLOCKS_PER_SPLIT)
  return max(1, min(want, most))


def combine_splits(o, m, l):
  """Log-sum-exp merge of split partials: o [P,...,R,D], m, l [P,...,R] -> [...,R,D] float32."""
  m_all = jnp.max(m, axis=0)
  # As in jax's decode_attention: keeps XLA from fusing this max into NaN-prone forms.
  m_all = jax.lax.optimization_barrier(m_all)
  w = jnp.exp(m - m_all[None])
  l_all = jnp.sum(w * l, axis=0)
  o_all = jnp.sum(w[..., None] * o, axis=0)
  return o_all / jnp.where(l_all == 0.0, 1.0, l_all)[..., None]


@functools.partial(jax.jit, static_argnames=("block_k", "block_rows", "num_splits",
                                             "num_warps", "num_stages", "interpret", "layer"))
def verify_attention_pallas_gpu(q, k_cache, v_cache, kv_lengths, tree_mask=None, *,
                                block_k: int = BLOCK_K, block_rows: int = BLOCK_ROWS,
                                num_splits: int | None = None, num_warps: int = NUM_WARPS,
                                num_stages: int = NUM_STAGES, interpret: bool = False,
                                layer: int | None = None):
  """Verify attention (DESIGN.md semantics) with the Triton-lowered Pallas kernel.

  Shapes as in kernels_pallas.verify_attention; inputs are assumed valid (the dispatcher checks
  them). block_k: keys per step (power of 2 >= 16, capped at S); block_rows: most folded query
  rows per program (power of 2 >= 16); num_splits: cache splits, None = pick_num_splits;
  interpret: run the kernel with the Pallas interpreter (any backend, e.g. CPU tests);
  layer: k_cache, v_cache are a stacked [L, B, S, Hkv, D] cache read at slab `layer` in place.
  """
  if layer is not None:
    num_layers = k_cache.shape[0]
    k_cache, v_cache = (c.reshape((num_layers * c.shape[1],) + c.shape[2:])
                        for c in (k_cache, v_cache))      # free: merges the two major dims
  b, t, hq, d = q.shape
  s, hkv = k_cache.shape[1], k_cache.shape[2]
  row0 = 0 if layer is None else layer * b
  reason = unsupported_reason(q.shape, k_cache.shape, q.dtype, k_cache.dtype, block_k)
  if reason is not None:
    raise ValueError(f"verify_attention_pallas_gpu: {reason}")
  if not (_is_pow2(block_rows) and block_rows >= 16):
    raise ValueError(f"block_rows must be a power of 2 >= 16, got {block_rows}")
  group = hq // hkv
  if d > WIDE_HEAD_DIM:
    block_k, block_rows = min(block_k, WIDE_BLOCK_K), min(block_rows, WIDE_BLOCK_ROWS)
    num_warps = max(num_warps, WIDE_NUM_WARPS)
  block_k = min(block_k, _pow2_floor(s))
  num_blocks = layout.cdiv(s, block_k)
  row_tile = min(block_rows, max(16, 1 << (t * group - 1).bit_length()))
  row_blocks = layout.cdiv(t * group, row_tile)
  rows = row_blocks * row_tile
  if num_splits is None:
    num_splits = pick_num_splits(b, hkv, row_blocks, num_blocks)
  num_splits = max(1, min(num_splits, num_blocks))
  blocks_per_split = layout.cdiv(num_blocks, num_splits)

  compute_dtype = jnp.promote_types(q.dtype, k_cache.dtype)
  q_rows = layout.fold_queries(q, hkv, rows)
  bits = layout.row_bits(tree_mask, b, t, group, rows)
  lengths = kv_lengths.astype(jnp.int32)

  kernel = functools.partial(
      _kernel, block_k=block_k, blocks_per_split=blocks_per_split, seq_len=s, num_new=t,
      sm_scale=1.0 / math.sqrt(d), compute_dtype=compute_dtype,
      precision=layout.dot_precision(compute_dtype))
  kv_spec = pl.BlockSpec((None, s, None, d), lambda bi, h, r, p: (row0 + bi, 0, h, 0))
  o, m, l = pl.pallas_call(
      kernel,
      grid=(b, hkv, row_blocks, num_splits),
      in_specs=[
          pl.BlockSpec((None,), lambda bi, h, r, p: (bi,)),
          pl.BlockSpec((None, None, row_tile, d), lambda bi, h, r, p: (bi, h, r, 0)),
          *[pl.BlockSpec((None, row_tile), lambda bi, h, r, p: (bi, r))] * len(bits),
          kv_spec,
          kv_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, row_tile, d), lambda bi, h, r, p: (p, bi, h, r, 0)),
          pl.BlockSpec((None, None, None, row_tile), lambda bi, h, r, p: (p, bi, h, r)),
          pl.BlockSpec((None, None, None, row_tile), lambda bi, h, r, p: (p, bi, h, r)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((num_splits, b, hkv, rows, d), jnp.float32),
          jax.ShapeDtypeStruct((num_splits, b, hkv, rows), jnp.float32),
          jax.ShapeDtypeStruct((num_splits, b, hkv, rows), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="verify_attention_gpu",
  )(lengths, q_rows, *bits, k_cache, v_cache)
  out = combine_splits(o, m, l)
  return layout.unfold_output(out, t, hq).astype(q.dtype)
