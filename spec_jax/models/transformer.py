"""The decoder-only transformer of any family: sj.forward, init_params and the cache type.

Each call asks the config's family (spec_jax.models.families) once, at trace time: the compiled
program is the family's own forward, nothing is added per step.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from spec_jax.models import hf_reader
from spec_jax.models.blocks import ForwardOutput
from spec_jax.models.cache import KVCache
from spec_jax.models.config import ModelConfig

__all__ = ["ForwardOutput", "KVCache", "expected_shapes", "forward", "init_params"]


def forward(params, config: ModelConfig, tokens, cache, offsets, *, positions=None,
            tree_mask=None, return_layers: Sequence[int] = (), logits_index=None) -> ForwardOutput:
  """Runs T new tokens per row through the model, writing their KV at per-row offsets.

  Args:
    params: the model pytree (its family's layout, canonical or execution layout).
    config: ModelConfig (static).
    tokens: int32 [B, T]; entries must be valid ids (pad with any valid id).
    cache: KVCache.zeros(config, B, S) (either layout) with S >= offsets + T for every row.
    offsets: int32 [B], where row b's new tokens go: positions offsets[b] .. offsets[b]+T-1.
      Row b attends to cache entries < offsets[b] plus its new tokens (causally). A hybrid
      model's (Qwen3-Next / Qwen3.5) recurrent state does not roll back with the offsets: a
      second call at an earlier offset overwrites KV slots but continues the state (rounds
      roll it back themselves: spec_jax.models.qwen3_next, docs/hybrid.md).
    positions: optional int32 [B, T] RoPE positions (defaults to offsets[:,None] + arange(T));
      tree drafts pass offset + depth here.
    tree_mask: optional bool [B, T, T] visibility among the new tokens (default causal), or
      [B, T, W] (W > T) over the last W cache entries ending with the new tokens (a draft tree
      growing in the cache; see kernels_pallas.reference).
    return_layers: indices of layers whose output residual stream to return (EAGLE-3 features).
    logits_index: optional int32 [B]: compute the logits of new token logits_index[b] of row b
      only (logits [B,1,V]; a prefill needs the last prompt token's, not the LM head over
      every position).

  Returns:
    ForwardOutput(logits [B,T,V] f32 ([B,1,V] with logits_index), hidden [B,T,D],
    layer_hidden, cache).
  """
  _check_room(cache, tokens, offsets)
  return config.family.forward(params, config, tokens, cache, offsets, positions=positions,
                               tree_mask=tree_mask, return_layers=return_layers,
                               logits_index=logits_index)


def _check_room(cache, tokens, offsets) -> None:
  """ValueError when concrete offsets put new tokens outside the cache: writes past S are
  dropped (the scatter's mode="drop") and those positions would attend without their own key
  and value, silently. Traced offsets (inside a jit: decode's own) are the caller's."""
  if isinstance(offsets, jax.core.Tracer) or not getattr(offsets, "is_fully_addressable", True):
    return
  caches = jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, KVCache))
  kv = next((c for c in caches if isinstance(c, KVCache)), None)
  values = np.asarray(offsets)
  if kv is None or values.size == 0:
    return
  t, s = tokens.shape[1], kv.capacity
  if values.min() < 0 or values.max() + t > s:
    raise ValueError(f"offsets {values.tolist()} with T = {t} new tokens write outside the "
                     f"cache of {s} slots: every row needs 0 <= offset and offset + T <= {s}")


def init_params(config: ModelConfig, key):
  """Random weights (normal, std 0.02; norms at their identity) in the family's layout."""
  return config.family.init_params(config, key)


def expected_shapes(config: ModelConfig):
  """The shape of every param leaf (same tree as init_params), for loaders to check against."""
  return hf_reader.param_shapes(config.family.init_params, config)
