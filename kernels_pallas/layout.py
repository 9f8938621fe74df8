"""Query-row layout shared by the Pallas kernels.

Both kernels fold the T new queries and the Hq/Hkv query heads of one KV head into the row
dimension of one block matmul, so that every KV block is read once for all of them:

  q [B, T, Hq, D]  ->  rows [B, Hkv, R, D],  row r = t * group + g  (r < T * group; the rows
                                             past T * group are zero padding)

and encode which of the T new cache entries each row may see as one int32 bit set per row
(bit j set: new token j is visible), so a kernel builds its mask from integer ops alone:

  row_bits [B, R] int32,  row_bits[b, r] = sum_j tree_mask[b, r // group, j] << j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A row's visibility of the new tokens is a 32-bit set: at most 32 new tokens per row.
MAX_NEW_TOKENS = 32

# Finite stand-in for -inf in the online softmax: exp(NEG_INF - m) underflows to 0 for any real
# m, and NEG_INF - NEG_INF = 0 never makes a NaN (masked weights are zeroed explicitly anyway).
NEG_INF = -1e30


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def fold_queries(q, num_kv_heads: int, rows: int):
  """q [B,T,Hq,D] -> [B, Hkv, rows, D] with row = t * group + g, zero-padded to `rows`."""
  b, t, hq, d = q.shape
  group = hq // num_kv_heads
  x = q.reshape(b, t, num_kv_heads, group, d).transpose(0, 2, 1, 3, 4)
  x = x.reshape(b, num_kv_heads, t * group, d)
  if rows > t * group:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))
  return x


def unfold_output(o, num_new: int, num_heads: int):
  """[B, Hkv, rows, D] -> [B, T, Hq, D] (drops the padding rows)."""
  b, hkv, _, d = o.shape
  group = num_heads // hkv
  o = o[:, :, :num_new * group].reshape(b, hkv, num_new, group, d).transpose(0, 2, 1, 3, 4)
  return o.reshape(b, num_new, num_heads, d)


def new_token_bits(tree_mask, batch: int, num_new: int):
  """int32 [B, T]: bit j of [b, t] is set when new query t sees new token j.

  tree_mask None means causal (j <= t).
  """
  if num_new > MAX_NEW_TOKENS:
    raise ValueError(f"at most {MAX_NEW_TOKENS} new tokens per row, got T={num_new}")
  if tree_mask is None:
    causal = np.array([(1 << (t + 1)) - 1 for t in range(num_new)], np.uint64)
    bits = jnp.asarray(causal.astype(np.uint32))
    bits = jnp.broadcast_to(bits[None], (batch, num_new))
  else:
    shifts = jnp.arange(num_new, dtype=jnp.uint32)
    bits = jnp.sum(tree_mask.astype(jnp.uint32) << shifts, axis=-1, dtype=jnp.uint32)
  return jax.lax.bitcast_convert_type(bits, jnp.int32)


def row_bits(tree_mask, batch: int, num_new: int, group: int, rows: int):
  """int32 [B, rows]: new_token_bits per folded row (0 on padding rows)."""
  bits = jnp.repeat(new_token_bits(tree_mask, batch, num_new), group, axis=1)
  if rows > num_new * group:
    bits = jnp.pad(bits, ((0, 0), (0, rows - num_new * group)))
  return bits


def visible(positions, length, num_new: int, bits):
  """Which keys each row may see; pure jnp on values, lowered inside both kernels.

  positions: int32 [1, N] cache positions of the keys; length: int32 scalar, kv_lengths[b];
  bits: int32 [R, 1] row bit sets. Returns bool [R, N]: a key is visible when it is in the
  prefix (position < length - T), or it is new token j = position - (length - T) < T and bit j
  of the row is set.
  """
  first_new = length - num_new
  rel = positions - first_new
  in_prefix = positions < first_new
  in_new = (rel >= 0) & (positions < length)
  shift = jnp.clip(rel, 0, MAX_NEW_TOKENS - 1)
  # Arithmetic vs logical shift does not matter: bit j <= 31 is then masked with & 1.
  bit = jnp.right_shift(bits, shift) & 1
  return in_prefix | (in_new & (bit != 0))


def dot_precision(dtype):
  """float32 inputs get exact float32 matmuls (no TF32 / bf16 passes); others the default."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
