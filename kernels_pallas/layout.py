"""Query-row layout shared by the Pallas kernels.

Both kernels fold the T new queries and the Hq/Hkv query heads of one KV head into the row
dimension of one block matmul, so that every KV block is read once for all of them:

  q [B, T, Hq, D]  ->  rows [B, Hkv, R, D],  row r = t * group + g  (r < T * group; the rows
                                             past T * group are zero padding)

and encode which of the T new cache entries each row may see as int32 bit sets, one word per
32 new tokens (bit j of word w set: new token 32 w + j is visible), so a kernel builds its mask
from integer ops alone:

  row_bits -> W = ceil(T / 32) words, each int32 [B, R],
  word w [b, r] = sum_j tree_mask[b, r // group, 32 w + j] << j.

A chain of K <= 31 drafts, or a tree of up to 31 nodes, is one word, as before; a DDTree of 63
nodes two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A row's visibility of the new tokens is WORD_BITS-bit sets, at most MAX_WORDS of them: at most
# 64 new tokens per row (a 63-node tree and its root).
WORD_BITS = 32
MAX_WORDS = 2
MAX_NEW_TOKENS = WORD_BITS * MAX_WORDS

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


def num_words(num_new: int) -> int:
  """Mask words per query row for T = num_new new tokens."""
  return cdiv(num_new, WORD_BITS)


def new_token_bits(tree_mask, batch: int, num_new: int):
  """int32 [W, B, T], W = num_words(T): bit j of word w of [b, t] is set when new query t sees
  new token 32 w + j.

  tree_mask None means causal (j <= t).
  """
  if num_new > MAX_NEW_TOKENS:
    raise ValueError(f"at most {MAX_NEW_TOKENS} new tokens per row, got T={num_new}")
  words = num_words(num_new)
  if tree_mask is None:
    full = [(1 << (t + 1)) - 1 for t in range(num_new)]
    causal = np.array([[(f >> (WORD_BITS * w)) & 0xFFFFFFFF for f in full]
                       for w in range(words)], np.uint64)
    bits = jnp.asarray(causal.astype(np.uint32))                       # [W, T]
    bits = jnp.broadcast_to(bits[:, None], (words, batch, num_new))
  else:
    mask = jnp.pad(tree_mask.astype(jnp.uint32),
                   ((0, 0), (0, 0), (0, words * WORD_BITS - num_new)))
    mask = mask.reshape(batch, num_new, words, WORD_BITS)
    shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32)
    bits = jnp.sum(mask << shifts, axis=-1, dtype=jnp.uint32)          # [B, T, W]
    bits = jnp.moveaxis(bits, -1, 0)
  return jax.lax.bitcast_convert_type(bits, jnp.int32)


def row_bits(tree_mask, batch: int, num_new: int, group: int, rows: int):
  """num_words(T) int32 [B, rows] words: new_token_bits per folded row (0 on padding rows)."""
  bits = jnp.repeat(new_token_bits(tree_mask, batch, num_new), group, axis=2)
  if rows > num_new * group:
    bits = jnp.pad(bits, ((0, 0), (0, 0), (0, rows - num_new * group)))
  return tuple(bits)


def visible(positions, length, num_new: int, words):
  """Which keys each row may see; pure jnp on values, lowered inside both kernels.

  positions: int32 [1, N] cache positions of the keys; length: int32 scalar, kv_lengths[b];
  words: num_words(T) int32 [R, 1] row bit sets. Returns bool [R, N]: a key is visible when it
  is in the prefix (position < length - T), or it is new token j = position - (length - T) < T
  and bit j % 32 of the row's word j // 32 is set.
  """
  first_new = length - num_new
  rel = positions - first_new
  in_prefix = positions < first_new
  in_new = (rel >= 0) & (positions < length)
  shift = jnp.clip(rel, 0, WORD_BITS * len(words) - 1)
  word = words[0]
  for w in range(1, len(words)):                 # the word that holds new token `shift`
    word = jnp.where(shift >= WORD_BITS * w, words[w], word)
  if len(words) > 1:
    shift = jnp.bitwise_and(shift, WORD_BITS - 1)
  # Arithmetic vs logical shift does not matter: bit j <= 31 is then masked with & 1.
  bit = jnp.right_shift(word, shift) & 1
  return in_prefix | (in_new & (bit != 0))


def dot_precision(dtype):
  """float32 inputs get exact float32 matmuls (no TF32 / bf16 passes); others the default."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
