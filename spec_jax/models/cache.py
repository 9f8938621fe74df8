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

from jax.sharding import NamedSharding, PartitionSpec as P

import kernels_pallas
from spec_jax.models.config import ModelConfig
from spec_jax.models.gemma_layout import layout
from spec_jax.models.matmul import activation_dtype
from spec_jax.sharding import DATA, MODEL


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
    """head_major None: the layout config's attention reads in place (default_head_major).
    Gemma configs get their own cache (GemmaKVCache below: one buffer per
    attention type, since their layers differ in KV shape)."""
    if config.is_gemma:
      return GemmaKVCache.zeros(config, batch, capacity, head_major)
    if head_major is None:
      head_major = default_head_major(config)
    l, h, dh = config.num_layers, config.num_kv_heads, config.head_dim
    shape = (l, batch, h, capacity, dh) if head_major else (l, batch, capacity, h, dh)
    dtype = jnp.dtype(activation_dtype(config))
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), head_major=bool(head_major))

  def seq_major(self) -> "KVCache":
    """The same entries in the [L, B, S, Hkv, Dh] layout (a copy when head-major)."""
    if not self.head_major:
      return self
    return KVCache(k=jnp.swapaxes(self.k, 2, 3), v=jnp.swapaxes(self.v, 2, 3), head_major=False)


def default_head_major(config: ModelConfig) -> bool:
  """Whether config's cache is head-major [.., Hkv, S, Dh] on the platform being lowered for:
  where the jnp path or the TPU kernel reads it (both read it in place; on TPU the
  [S, Hkv, Dh] layout costs a relayout copy of the cache before every kernel call), not where
  the GPU kernel runs (which reads [B, S, Hkv, Dh] with strided loads)."""
  kernel, _ = kernels_pallas.dispatch.resolve(config.attention_impl)
  return kernel in (None, "tpu")


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


# ----------------------------------------------------------------------------- Gemma

# The Gemma KV cache: one stacked buffer per attention type, layers of different KV shapes apart.
#
# Gemma 4's sliding and full layers differ in head_dim and kv heads, and its KV-shared layers
# have no cache of their own (spec_jax.models.gemma_layout). So instead of one [L, B, S, Hkv, Dh]
# buffer, the cache holds one buffer per cache group (attention type):
#
#   k[g], v[g]: [L_g, B, S, Hkv_g, Dh_g], or head-major [L_g, B, Hkv_g, S, Dh_g]
#
# where L_g counts the layers of that type with their own K/V. The same conventions as
# transformer.KVCache hold: every layer's slot s is position s of the row (sliding layers keep all
# S slots too; the window is a mask), the valid entries are tracked by the caller's per-row
# lengths, the layout is the one the attention reads in place (head-major on the jnp path).

@flax.struct.dataclass
class GemmaKVCache:
  """k, v: tuples over cache groups (gemma_layout.layout(config).groups) of [L_g, B, S, Hkv_g,
  Dh_g] (head_major: [L_g, B, Hkv_g, S, Dh_g]) buffers."""
  k: tuple
  v: tuple
  head_major: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def seq_axis(self) -> int:
    """The axis of the S cache slots in every buffer."""
    return 3 if self.head_major else 2

  @property
  def capacity(self) -> int:
    return self.k[0].shape[self.seq_axis]

  @classmethod
  def zeros(cls, config, batch: int, capacity: int,
            head_major: Optional[bool] = None) -> "GemmaKVCache":
    """head_major None: the layout config's attention reads in place (default_head_major)."""
    if head_major is None:
      head_major = default_head_major(config)
    dtype = jnp.dtype(activation_dtype(config))
    ks, vs = [], []
    for g in layout(config).groups:
      shape = ((g.num_layers, batch, g.num_kv_heads, capacity, g.head_dim) if head_major else
               (g.num_layers, batch, capacity, g.num_kv_heads, g.head_dim))
      ks.append(jnp.zeros(shape, dtype))
      vs.append(jnp.zeros(shape, dtype))
    return cls(k=tuple(ks), v=tuple(vs), head_major=bool(head_major))

  def seq_major(self) -> "GemmaKVCache":
    """The same entries in the [L_g, B, S, Hkv_g, Dh_g] layout (a copy when head-major)."""
    if not self.head_major:
      return self
    swap = lambda bufs: tuple(jnp.swapaxes(b, 2, 3) for b in bufs)
    return GemmaKVCache(k=swap(self.k), v=swap(self.v), head_major=False)

  def move_accepted(self, lengths, path, n_accepted) -> "GemmaKVCache":
    """tree.move_accepted_kv for this cache: the accepted path's entries to contiguous slots.

    The verify wrote tree node i of row b at slot lengths[b]-1+i; the path's j-th node
    (path[b, j], j < n_accepted[b]) moves to slot lengths[b]+j, in every buffer (one gather
    and one in-place scatter each; entries past n_accepted are dropped).
    lengths int32 [B] (before the round); path int32 [B, D]; n_accepted int32 [B]."""
    s = self.capacity
    d = path.shape[1]
    rows = jnp.arange(path.shape[0])[:, None]
    j = jnp.arange(d, dtype=jnp.int32)[None, :]
    src = jnp.minimum(lengths[:, None] - 1 + jnp.maximum(path, 0), s - 1)
    dst = jnp.where(j < n_accepted[:, None], lengths[:, None] + j, s)

    def move(buf):
      if self.head_major:
        return buf.at[:, rows, :, dst].set(buf[:, rows, :, src], mode="drop")
      return buf.at[:, rows, dst].set(buf[:, rows, src], mode="drop")

    return GemmaKVCache(k=tuple(map(move, self.k)), v=tuple(map(move, self.v)),
                        head_major=self.head_major)

  def constrain(self, mesh) -> "GemmaKVCache":
    """sharding.constrain_cache for this cache: rows on "data", kv heads on "model" in each
    buffer whose kv heads divide the "model" size (others keep their heads whole)."""
    if mesh is None:
      return self

    def one(buf):
      head_axis = 2 if self.head_major else 3
      heads = MODEL if buf.shape[head_axis] % mesh.shape[MODEL] == 0 else None
      spec = (P(None, DATA, heads, None, None) if self.head_major else
              P(None, DATA, None, heads, None))
      return jax.lax.with_sharding_constraint(buf, NamedSharding(mesh, spec))

    return GemmaKVCache(k=tuple(map(one, self.k)), v=tuple(map(one, self.v)),
                        head_major=self.head_major)
