"""Lane-packed head-major caches: head_dim < 128 without the 2x (or 4x) of TPU lane padding.

XLA:TPU tiles the two minor dims of a buffer in (8 or 16, 128) tiles, so a head-major cache
[.., Hkv, S, D] with D = 64 (Llama-3.2-1B, SmolLM2, Qwen2.5-0.5B) takes twice its size in HBM:
every [S, 64] slab is padded to 128 lanes (seen in the AOT buffer reports, docs/accelerators.md).
Packing p = 128 // D consecutive KV heads along the lanes,

  [.., Hkv, S, D]  <->  [.., Hkv / p, S, p * D],   lanes j*D .. (j+1)*D-1 of group g = head g*p+j,

stores the same entries with no padding. The TPU attention kernel reads one group's
[block_k, p * D] window and slices its p heads out of the lanes (as it does for the
[B, S, Hkv * D] view); the cache kernels (kv_write_tpu) see a cache of Hkv / p heads of width
p * D and new rows [B, T, Hkv, D] reshaped to [B, T, Hkv / p, p * D] (a free reshape: the heads
of one group are adjacent). The jnp paths unpack one layer's slab (a copy, where on TPU the
padded slab was relaid out anyway, blocks.attention).

The packing is not a field: a head-major buffer whose minor dim is p times the head_dim of the
queries (or rows) it meets is packed by p. Only the TPU kernel's layout packs
(models.cache.default_lane_pack); under a mesh only where the groups still split evenly over
"model", so no head is split across chips.
"""

from __future__ import annotations

LANES = 128


def heads_per_block(num_kv_heads: int, head_dim: int) -> int | None:
  """KV heads per lane-aligned block of 128 lanes (1 for head_dim a multiple of 128, or one
  head), or None when the heads do not fill whole blocks: the TPU kernel's [B, S, Hkv * D]
  view and the packed cache group heads by this rule."""
  if head_dim % LANES == 0 or num_kv_heads == 1:
    return 1
  if LANES % head_dim == 0 and num_kv_heads % (LANES // head_dim) == 0:
    return LANES // head_dim
  return None


def lane_pack(num_kv_heads: int, head_dim: int, model_size: int = 1) -> int:
  """p: KV heads per 128-lane group of a head-major TPU cache (1: not packed). Packs when
  head_dim divides 128, the heads fill whole groups, and the groups divide the "model" axis."""
  p = heads_per_block(num_kv_heads, head_dim) or 1
  return p if (num_kv_heads // p) % model_size == 0 else 1


def packing(cache_minor: int, head_dim: int) -> int:
  """p of a head-major buffer whose minor dim is cache_minor, read with head_dim-wide heads."""
  if cache_minor % head_dim:
    raise ValueError(f"a cache of minor dim {cache_minor} cannot hold heads of dim {head_dim}")
  return cache_minor // head_dim


def unpacked(buf, head_dim: int):
  """A head-major buffer [.., Hkv / p, S, p * D] read with head_dim-wide heads, as
  [.., Hkv, S, D] (itself when not packed; a copy otherwise)."""
  return unpack(buf, packing(buf.shape[-1], head_dim))


def pack_rows(new, p: int):
  """new [.., H, D] -> [.., H / p, p * D] (free: the p heads of a group are adjacent)."""
  if p == 1:
    return new
  *lead, h, d = new.shape
  return new.reshape(*lead, h // p, p * d)


def unpack(buf, p: int):
  """A packed head-major buffer [.., Hkv / p, S, p * D] -> [.., Hkv, S, D] (a copy)."""
  if p == 1:
    return buf
  *lead, g, s, pd = buf.shape
  d = pd // p
  x = buf.reshape(*lead, g, s, p, d)
  x = x.swapaxes(-3, -2)                                     # [.., G, p, S, D]
  return x.reshape(*lead, g * p, s, d)


def pack(buf, p: int):
  """The inverse of unpack: [.., Hkv, S, D] -> [.., Hkv / p, S, p * D] (a copy)."""
  if p == 1:
    return buf
  *lead, h, s, d = buf.shape
  x = buf.reshape(*lead, h // p, p, s, d).swapaxes(-3, -2)   # [.., G, S, p, D]
  return x.reshape(*lead, h // p, s, p * d)
