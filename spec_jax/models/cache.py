"""The KV cache of spec_jax.models: one type for every family, its buffers laid out by the family.

The core reaches the cache only through the target protocol (spec_jax.decoding.target):
`ModelTarget.init_cache` makes one (the config's family lays out its buffers), the forward
writes it, `ModelTarget.move_kv` compacts a tree round's accepted path. Other JAX models bring
their own cache pytree; so may a family whose cache is not (only) a KV cache (families.py).
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from jax.sharding import NamedSharding, PartitionSpec as P

import kernels_pallas
from kernels_pallas import lanes
from spec_jax.models.matmul import activation_dtype
from spec_jax.sharding import DATA, MODEL


@flax.struct.dataclass
class KVCache:
  """Key/value buffers, laid out by the config's family (KVCache.zeros).

  k, v: one stacked buffer [L, B, S, Hkv, Dh] each (the llama family), or a tuple of such
  buffers [L_g, B, S, Hkv_g, Dh_g], one per group of layers that share a KV shape (the Gemma
  family: one per attention type). head_major: every buffer is [.., Hkv, S, Dh] instead, or,
  lane-packed for the TPU kernel when Dh < 128, [.., Hkv / p, S, p * Dh] with p = 128 // Dh
  heads side by side in the lanes (kernels_pallas.lanes: the [S, 64] slab of a head_dim-64
  cache is otherwise padded to 128 lanes in HBM, twice its size). A buffer is packed when its
  minor dim is p times the head_dim of the rows written to it; `seq_major` unpacks.

  Every layer's slot s is position s of the row; which entries are valid is tracked by the
  caller (per-row lengths); entries past a row's length are stale and masked by attention.
  The layout is the one the attention reads without relaying it out: the Pallas kernels'
  [B, S, Hkv, Dh] where a kernel runs, head-major where the jnp attention runs (CPU): there the
  [S, Hkv] layout cost a transposing copy of every layer's keys and values per step, ~1.3 of
  the 16.6 ms of a plain step of the 78M widened model (profiled; README Speed).
  """
  k: Any
  v: Any
  head_major: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def seq_axis(self) -> int:
    """The axis of the S cache slots in every buffer."""
    return 3 if self.head_major else 2

  @property
  def capacity(self) -> int:
    return jax.tree.leaves(self.k)[0].shape[self.seq_axis]

  @classmethod
  def zeros(cls, config, batch: int, capacity: int, head_major: Optional[bool] = None):
    """The cache of `config`'s family for B rows of S slots (config.family.init_cache: a
    KVCache for attention-only families). head_major None: the layout config's attention reads
    in place (default_head_major)."""
    return config.family.init_cache(config, batch, capacity, head_major)

  @classmethod
  def of_groups(cls, config, batch: int, capacity: int, groups,
                head_major: Optional[bool] = None, stacked: bool = False,
                lane_pack: Optional[bool] = None) -> "KVCache":
    """Zero buffers for `groups`, a sequence of (num_layers, num_kv_heads, head_dim): a tuple
    of buffers, or with stacked (one group) k and v as the one buffer itself. lane_pack (only
    with head_major): pack head_dim < 128 heads into 128 lanes where they fit; None: where the
    TPU kernel reads the cache (default_lane_pack)."""
    if head_major is None:
      head_major = default_head_major(config)
    if lane_pack is None:
      lane_pack = head_major and default_lane_pack(config)
    dtype = jnp.dtype(activation_dtype(config))
    model = kernels_pallas.platform.mesh_axis_size(MODEL)

    def shape(l, h, d):
      if not head_major:
        return (l, batch, capacity, h, d)
      p = lanes.lane_pack(h, d, model) if lane_pack else 1
      return (l, batch, h // p, capacity, p * d)

    shapes = [shape(l, h, d) for l, h, d in groups]
    ks = tuple(jnp.zeros(s, dtype) for s in shapes)
    vs = tuple(jnp.zeros(s, dtype) for s in shapes)
    if stacked:
      (ks,), (vs,) = ks, vs
    return cls(k=ks, v=vs, head_major=bool(head_major))

  def map(self, fn) -> "KVCache":
    """fn applied to every buffer (k's and v's), the layout kept."""
    return KVCache(k=jax.tree.map(fn, self.k), v=jax.tree.map(fn, self.v),
                   head_major=self.head_major)

  def seq_major(self, head_dims=None) -> "KVCache":
    """The same entries in the [L, B, S, Hkv, Dh] layout (a copy when head-major). head_dims:
    each buffer's Dh (an int for all, or a tuple for the groups), needed for a lane-packed
    cache; None: the buffers are not packed."""
    if not self.head_major:
      return self
    dims = jax.tree.map(lambda b: b.shape[-1], self.k) if head_dims is None else head_dims
    if isinstance(dims, int) and isinstance(self.k, tuple):
      dims = tuple(dims for _ in self.k)
    seq = lambda b, d: jnp.swapaxes(lanes.unpacked(b, d), 2, 3)
    return KVCache(k=jax.tree.map(seq, self.k, dims), v=jax.tree.map(seq, self.v, dims),
                   head_major=False)


def default_head_major(config) -> bool:
  """Whether config's cache is head-major [.., Hkv, S, Dh] on the platform being lowered for:
  where the jnp path or the TPU kernel reads it (both read it in place; on TPU the
  [S, Hkv, Dh] layout costs a relayout copy of the cache before every kernel call), not where
  the GPU kernel runs (which reads [B, S, Hkv, Dh] with strided loads)."""
  kernel, _ = kernels_pallas.dispatch.resolve(config.attention_impl)
  return kernel in (None, "tpu")


def default_lane_pack(config) -> bool:
  """Whether config's head-major cache packs head_dim < 128 heads into the 128 lanes
  (kernels_pallas.lanes): where the TPU kernel reads it, on the platform being lowered for.
  The jnp path (CPU) reads whole heads; packing there would cost an unpacking copy per call."""
  kernel, _ = kernels_pallas.dispatch.resolve(config.attention_impl)
  return kernel == "tpu"


def write_rows(cache, layer: int, new, offsets, head_major: bool = False):
  """cache [L,B,S,H,Dh] (head_major: [L,B,H,S,Dh], or lane-packed [L,B,H/p,S,p*Dh]) <- new
  [B,T,H,Dh] at layer, row b, slots offsets[b] .. offsets[b]+T-1.

  One scatter into the stacked buffer, which XLA performs in place (slicing a layer out, updating
  it and stacking it back would copy the whole cache every layer). In a TPU program a
  head-major cache is written by the Pallas kernel instead (whatever attention_impl says: the
  cache layout is the kernels'), so that XLA:TPU keeps it row-major."""
  if head_major:           # a lane-packed cache takes the rows as H / p heads of p * Dh
    new = lanes.pack_rows(new, lanes.packing(cache.shape[-1], new.shape[-1]))
  if head_major and kernels_pallas.platform.current() == "tpu":
    # The TPU kernel writes in place and keeps the cache row-major (kernels_pallas.kv_write_tpu:
    # this scatter made XLA:TPU copy every layer's cache before each attention call).
    written = kernels_pallas.dispatch.write_kv(cache, layer, new, offsets)
    if written is not None:
      return written
  b, t = new.shape[:2]
  rows = jnp.arange(b, dtype=jnp.int32)[:, None]
  cols = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if head_major:   # the advanced indices (rows, cols) around the head slice index [B, T, H, Dh]
    return cache.at[layer, rows, :, cols].set(new.astype(cache.dtype), mode="drop")
  return cache.at[layer, rows, cols].set(new.astype(cache.dtype), mode="drop")


def move_kv(cache: KVCache, lengths, path, n_accepted) -> KVCache:
  """Moves the accepted nodes' KV entries to contiguous slots, in place, in every buffer.

  The verify wrote node i of row b at slot lengths[b]-1+i; the accepted path's j-th node
  (path[b, j], j < n_accepted[b]) belongs at slot lengths[b]+j (the root, node 0, is already at
  lengths[b]-1). One gather of the D entries per row and buffer, then one scatter into the
  stacked buffer (entries past n_accepted go out of range and are dropped).

  cache: a KVCache; lengths int32 [B] (before the round); path int32 [B, D]; n_accepted [B]."""
  s = cache.capacity
  d = path.shape[1]
  rows = jnp.arange(path.shape[0])[:, None]
  j = jnp.arange(d, dtype=jnp.int32)[None, :]
  src = jnp.minimum(lengths[:, None] - 1 + jnp.maximum(path, 0), s - 1)
  dst = jnp.where(j < n_accepted[:, None], lengths[:, None] + j, s)

  def move(buf):
    if cache.head_major and kernels_pallas.platform.current() == "tpu":
      moved = kernels_pallas.dispatch.move_kv(buf, lengths, src, n_accepted)
      if moved is not None:
        return moved
    # Every index explicit but the [Hkv, Dh] window, as write_rows writes the buffer: with the
    # layers in the window ([L, .., Hkv, Dh]) XLA:TPU relaid the whole cache out for this one
    # move and kept both copies (+1 GiB a chip for an 8B tree under model=4).
    layer = jnp.arange(buf.shape[0], dtype=jnp.int32)[:, None, None]
    if cache.head_major:     # advanced (layer, rows, slots) around the head slice
      return buf.at[layer, rows[None], :, dst[None]].set(buf[layer, rows[None], :, src[None]],
                                                         mode="drop")
    return buf.at[layer, rows[None], dst[None]].set(buf[layer, rows[None], src[None]],
                                                    mode="drop")

  return cache.map(move)


def constrain_cache(mesh, cache: KVCache) -> KVCache:
  """Sharding annotations of a KVCache: rows on "data", kv heads on "model" in each buffer
  whose kv heads divide the "model" size (others keep their heads whole)."""
  if mesh is None:
    return cache
  head_axis = 2 if cache.head_major else 3

  def one(buf):
    heads = MODEL if buf.shape[head_axis] % mesh.shape[MODEL] == 0 else None
    spec = (P(None, DATA, heads, None, None) if cache.head_major else
            P(None, DATA, None, heads, None))
    return jax.lax.with_sharding_constraint(buf, NamedSharding(mesh, spec))

  return cache.map(one)
