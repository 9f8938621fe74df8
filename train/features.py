"""The frozen target's features, computed once for every training window (offline distillation).

Every step of train.distill_heads needs the target's outputs over its batch: the final hidden
state (what the LM head reads), the residual stream after the head's `target_layers`, and the
soft labels p = softmax(lm_head(hidden)). Online, each step runs the whole target for them, so
a run of S steps of B windows over N windows runs the target S * B / N times over each window
(its epochs). With `train.precompute_features: true` the target runs once over every window
before the first step, its hidden states are kept on the host, and a step runs only the LM head
for the labels (the same `lm_head` the forward ends with, on the same hidden state: the same
labels) and the head itself. EAGLE's own pipeline (its `ge_data` scripts) and SpecForge's
offline mode train the same way.

Host memory: N * T * (1 + len(target_layers)) * D values in the target's dtype (SmolLM2-135M,
160k tokens, 3 layers: 0.74 GB in bfloat16); `feature_bytes` says how much before it is spent.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sharding
from spec_jax.models.blocks import ForwardOutput, lm_head
from spec_jax.models.transformer import KVCache, forward


class Features(NamedTuple):
  """hidden [N, T, D] (after the final norm); layer_hidden: one [N, T, D] per target layer."""
  hidden: np.ndarray
  layer_hidden: tuple

  def rows(self, idx) -> "Features":
    """The windows idx (int [B]) of every array."""
    return Features(self.hidden[idx], tuple(x[idx] for x in self.layer_hidden))


def feature_bytes(num_windows: int, window: int, dim: int, num_layers: int, dtype) -> int:
  """Host bytes the precomputed features of num_windows windows take."""
  return num_windows * window * dim * (1 + num_layers) * jnp.dtype(dtype).itemsize


def target_outputs(target_params, target_config, tokens, layers, features=None):
  """ForwardOutput of the frozen target over tokens [B, T] (gradients stopped): the whole
  forward, or with `features` (Features of these rows) only the LM head over their hidden
  state. The cache is None in either case (training never reads it)."""
  if features is None:
    b, t = tokens.shape
    out = forward(target_params, target_config, tokens, KVCache.zeros(target_config, b, t),
                  jnp.zeros((b,), jnp.int32), return_layers=layers)
    out = out._replace(cache=None)
  else:
    hidden, layer_hidden = features
    out = ForwardOutput(lm_head(target_params, target_config, hidden), hidden,
                        tuple(layer_hidden), None)
  return jax.lax.stop_gradient(out)


def precompute(target, windows: np.ndarray, layers, batch: int, mesh=None, log=None) -> Features:
  """The target's Features over every window (int32 [N, T]), batch windows per forward (one
  compiled shape: the last batch is padded with window 0 and its rows dropped)."""
  layers = tuple(int(i) for i in layers)
  config = target.config

  @jax.jit
  def run(params, tokens):
    out = target_outputs(params, config, tokens, layers)
    return out.hidden, out.layer_hidden

  params = sharding.shard_params(mesh, target.params)
  n = len(windows)
  hidden, layer_hidden = None, None
  started, last = time.perf_counter(), 0.0
  for start in range(0, n, batch):
    idx = np.arange(start, start + batch)
    idx[idx >= n] = 0
    h, lh = run(params, sharding.shard_rows(mesh, np.asarray(windows[idx])))
    h, lh = np.asarray(h), [np.asarray(x) for x in lh]
    if hidden is None:
      hidden = np.empty((n,) + h.shape[1:], h.dtype)
      layer_hidden = tuple(np.empty((n,) + x.shape[1:], x.dtype) for x in lh)
    keep = min(batch, n - start)
    hidden[start:start + keep] = h[:keep]
    for dst, src in zip(layer_hidden, lh):
      dst[start:start + keep] = src[:keep]
    now = time.perf_counter() - started
    if log and (now - last > 30 or start + keep == n):
      last = now
      log(f"target features: {start + keep}/{n} windows ({now:.0f} s)")
  return Features(hidden, layer_hidden)
