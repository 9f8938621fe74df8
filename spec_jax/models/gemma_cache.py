"""The Gemma KV cache: one stacked buffer per attention type, layers of different KV shapes apart.

Gemma 4's sliding and full layers differ in head_dim and kv heads, and its KV-shared layers
have no cache of their own (spec_jax.models.gemma_layout). So instead of one [L, B, S, Hkv, Dh]
buffer, the cache holds one buffer per cache group (attention type):

  k[g], v[g]: [L_g, B, S, Hkv_g, Dh_g], or head-major [L_g, B, Hkv_g, S, Dh_g]

where L_g counts the layers of that type with their own K/V. The same conventions as
transformer.KVCache hold: every layer's slot s is position s of the row (sliding layers keep all
S slots too; the window is a mask), the valid entries are tracked by the caller's per-row
lengths, the layout is the one the attention reads in place (head-major on the jnp path).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax.models.gemma_layout import layout


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
    from spec_jax.models.transformer import default_head_major
    if head_major is None:
      head_major = default_head_major(config)
    dtype = jnp.dtype(config.dtype)
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
    from jax.sharding import NamedSharding, PartitionSpec as P
    from spec_jax.sharding import DATA, MODEL

    def one(buf):
      head_axis = 2 if self.head_major else 3
      heads = MODEL if buf.shape[head_axis] % mesh.shape[MODEL] == 0 else None
      spec = (P(None, DATA, heads, None, None) if self.head_major else
              P(None, DATA, None, heads, None))
      return jax.lax.with_sharding_constraint(buf, NamedSharding(mesh, spec))

    return GemmaKVCache(k=tuple(map(one, self.k)), v=tuple(map(one, self.v)),
                        head_major=self.head_major)
