"""The KV cache of spec_jax.models: its layout, the in-place write of new entries, the tree move.

The core reaches the cache only through the target protocol (spec_jax.decoding.target):
`ModelTarget.init_cache` makes one, the forward writes it, `ModelTarget.move_kv` compacts a
tree round's accepted path. Other JAX models bring their own cache pytree.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

import kernels_pallas
from spec_jax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Stacked key/value cache.

  k, v: [L, B, S, Hkv, Dh], or with head_major [L, B, Hkv, S, Dh]. Which entries are valid is
  tracked by the caller (per-row lengths); entries past a row's length are stale and masked by
  attention. The layout is the one the attention reads without relaying it out: the Pallas
  kernels' [B, S, Hkv, Dh] where a kernel runs, head-major where the jnp attention runs (CPU):
  there the [S, Hkv] layout cost a transposing copy of every layer's keys and values per step,
  ~1.3 of the 16.6 ms of a plain step of the 78M widened model (profiled; README Speed).
  """
  k: jax.Array
  v: jax.Array
  head_major: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def seq_axis(self) -> int:
    """The axis of the S cache slots in k and v."""
    return 3 if self.head_major else 2

  @property
  def capacity(self) -> int:
    return self.k.shape[self.seq_axis]

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, capacity: int,
            head_major: Optional[bool] = None) -> "KVCache":
    """head_major None: the layout config's attention reads in place (default_head_major)."""
    if head_major is None:
      head_major = default_head_major(config)
    l, h, dh = config.num_layers, config.num_kv_heads, config.head_dim
    shape = (l, batch, h, capacity, dh) if head_major else (l, batch, capacity, h, dh)
    dtype = jnp.dtype(config.dtype)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), head_major=bool(head_major))

  def seq_major(self) -> "KVCache":
    """The same entries in the [L, B, S, Hkv, Dh] layout (a copy when head-major)."""
    if not self.head_major:
      return self
    return KVCache(k=jnp.swapaxes(self.k, 2, 3), v=jnp.swapaxes(self.v, 2, 3), head_major=False)


def default_head_major(config: ModelConfig) -> bool:
  """Whether config's verify attention runs the jnp path on this backend (then the cache is
  head-major), rather than a Pallas kernel (which reads [B, S, Hkv, Dh])."""
  kernel, _ = kernels_pallas.dispatch.resolve(config.attention_impl)
  return kernel is None


def write_rows(cache, layer: int, new, offsets, head_major: bool = False):
  """cache [L,B,S,H,Dh] (head_major: [L,B,H,S,Dh]) <- new [B,T,H,Dh] at layer, row b, slots
  offsets[b] .. offsets[b]+T-1.

  One scatter into the stacked buffer, which XLA performs in place (slicing a layer out, updating
  it and stacking it back would copy the whole cache every layer)."""
  b, t = new.shape[:2]
  rows = jnp.arange(b, dtype=jnp.int32)[:, None]
  cols = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if head_major:   # the advanced indices (rows, cols) around the head slice index [B, T, H, Dh]
    return cache.at[layer, rows, :, cols].set(new.astype(cache.dtype), mode="drop")
  return cache.at[layer, rows, cols].set(new.astype(cache.dtype), mode="drop")


_write_rows = write_rows      # the name the layers and heads import


def move_kv(cache: KVCache, lengths, path, n_accepted) -> KVCache:
  """Moves the accepted nodes' KV entries to contiguous slots, in place.

  The verify wrote node i of row b at slot lengths[b]-1+i; the accepted path's j-th node
  (path[b, j], j < n_accepted[b]) belongs at slot lengths[b]+j (the root, node 0, is already at
  lengths[b]-1). One gather of the D entries per row and layer, then one scatter into the
  stacked cache (entries past n_accepted go out of range and are dropped).

  cache: KVCache [L, B, S, Hkv, Dh] (or head-major [L, B, Hkv, S, Dh]); lengths int32 [B]
  (before the round); path int32 [B, D]; n_accepted int32 [B]."""
  s = cache.capacity
  d = path.shape[1]
  rows = jnp.arange(path.shape[0])[:, None]
  j = jnp.arange(d, dtype=jnp.int32)[None, :]
  src = jnp.minimum(lengths[:, None] - 1 + jnp.maximum(path, 0), s - 1)
  dst = jnp.where(j < n_accepted[:, None], lengths[:, None] + j, s)

  def move(buf):
    if cache.head_major:     # advanced (rows, slots) around the head slice: [B, D, L, Hkv, Dh]
      return buf.at[:, rows, :, dst].set(buf[:, rows, :, src], mode="drop")
    picked = buf[:, rows, src]                                           # [L, B, D, Hkv, Dh]
    return buf.at[:, rows, dst].set(picked, mode="drop")

  return KVCache(k=move(cache.k), v=move(cache.v), head_major=cache.head_major)
