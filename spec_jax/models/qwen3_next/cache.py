"""The hybrid family's cache: KV for the attention layers, recurrent state and conv window for
the Gated DeltaNet layers, and what a verify needs to keep only the accepted prefix.

A KV cache rolls back for free (rejected slots are masked by the lengths and overwritten); a
recurrent state does not: after a verify over T = K+1 tokens only the accepted prefix may
advance it. The forward over T <= VERIFY_SLOTS tokens therefore records the state after every
position (state_steps) and the conv inputs it saw (conv_steps), and `commit_cache` selects
position n_accepted: exact, no recompute. One buffer of VERIFY_SLOTS positions serves every
chain length up to K = VERIFY_SLOTS - 1 (the shapes stay fixed across a governor's K).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from spec_jax.models import cache as cache_lib
from spec_jax.models.cache import KVCache
from spec_jax.models.matmul import activation_dtype
from spec_jax.models.qwen3_next import deltanet
from spec_jax.models.qwen3_next import plan as hplan
from spec_jax.sharding import DATA

VERIFY_SLOTS = 16     # the longest verify (K + 1) whose per-position states are recorded


@flax.struct.dataclass
class HybridCache:
  """kv: KVCache of the full-attention layers, k / v [L_full, B, S, Hkv, Dh] (head-major:
  [L_full, B, Hkv, S, Dh]).
  state: float32 [L_lin, B, Hv, Dk, Dv], the recurrent state after the last absorbed token.
  conv: [L_lin, B, W-1, C], the last W - 1 conv inputs (C = 2 Hk Dk + Hv Dv).
  state_steps: float32 [L_lin, B, P, Hv, Dk, Dv], the state after each position of the last
    forward over T <= P = VERIFY_SLOTS tokens (slots >= T stale).
  conv_steps: [L_lin, B, W-1+P, C], that forward's [previous window, T inputs]."""
  kv: KVCache
  state: Any
  conv: Any
  state_steps: Any
  conv_steps: Any

  @property
  def capacity(self) -> int:
    return self.kv.capacity

  @property
  def head_major(self) -> bool:
    return self.kv.head_major


def init_cache(config, batch: int, capacity: int, head_major=None) -> HybridCache:
  """Zeros: KV for the attention layers, zero state and window for the linear ones."""
  lay = hplan.layout(config)
  kv = KVCache.of_groups(config, batch, capacity,
                         [(lay.num_full, config.num_kv_heads, config.head_dim)], head_major,
                         stacked=True)
  n = lay.num_linear
  c = config
  if n:
    conv_dim, w1 = hplan.linear_sizes(c)["conv_dim"], c.linear_conv_kernel_dim - 1
    state_shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
  else:
    conv_dim, w1, state_shape = 0, 0, (0, 0, 0)
  dtype = jnp.dtype(activation_dtype(config))
  return HybridCache(
      kv=kv, state=jnp.zeros((n, batch) + state_shape, jnp.float32),
      conv=jnp.zeros((n, batch, w1, conv_dim), dtype),
      state_steps=jnp.zeros((n, batch, VERIFY_SLOTS) + state_shape, jnp.float32),
      conv_steps=jnp.zeros((n, batch, w1 + VERIFY_SLOTS, conv_dim), dtype))


def commit_cache(cache: HybridCache, lengths, n_accepted) -> HybridCache:
  """After a chain round: the state and conv window after verify position n_accepted[b] (the
  last token the round keeps in the cache: the verify fed lengths-1 .. lengths-1+K, the round
  keeps lengths-1 .. lengths-1+n_accepted). lengths int32 [B] (unused: the buffers are
  per-round); n_accepted int32 [B] in [0, K]."""
  del lengths
  n = n_accepted.astype(jnp.int32)
  idx = n[None, :, None, None, None, None]
  state = jnp.take_along_axis(cache.state_steps, idx, axis=2)[:, :, 0]
  w1 = cache.conv.shape[2]
  conv = jax.vmap(lambda steps: deltanet.window_of(steps, n + 1, w1))(cache.conv_steps)
  return cache.replace(state=state, conv=conv.astype(cache.conv.dtype))


def constrain_cache(mesh, cache: HybridCache) -> HybridCache:
  """Sharding annotations: the KV as every family's (cache_lib.constrain_cache), the recurrent
  buffers' rows on "data" (axis 1), the rest replicated."""
  if mesh is None:
    return cache
  def rows(x):
    spec = P(None, DATA, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return cache.replace(kv=cache_lib.constrain_cache(mesh, cache.kv), state=rows(cache.state),
                       conv=rows(cache.conv), state_steps=rows(cache.state_steps),
                       conv_steps=rows(cache.conv_steps))
