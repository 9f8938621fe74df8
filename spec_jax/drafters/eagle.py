"""EAGLE (Li et al. 2024) and EAGLE-3 (Li et al. 2025) draft heads.

EAGLE: x_j = fc(concat(embed(token_{j+1}), f_j)) + fc_b -> one decoder layer -> o_j, with f_j
the target's hidden state after its final norm (what the LM head reads; EAGLE-1's reference
code takes the base LlamaModel's output, which is normed). o_j is the predicted f_{j+1}; the
draft distribution is the target's frozen LM head applied to o_j. The next draft step feeds
(o_j, drafted token) back: autoregression at the feature level. Trained with smooth-L1 on the
features plus soft cross-entropy against the target (train/losses.py).

EAGLE-3: the same drafter, fed a fusion f_j = concat(low, mid, high)_j @ fuse of three target
layers' outputs (pre-norm residual streams, `target_layers`, default (1, L//2, L-1) clipped
to the target), with its own output RMSNorm before the target's LM head, trained without the
feature loss and with the training-time-test unroll (its own outputs fed back).

Cache / position conventions are those of `spec_jax.drafters.feature_head`: head-cache slot j
holds (f_j, token_{j+1}) at RoPE position j, and o_j predicts token j+2.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from spec_jax.drafters.feature_head import FeatureHead, head_layer_config, init_layer_params


def _eye_block(d, parts, which, scale=1.0):
  """[parts*D, D] with an identity at block `which` (scale) and zeros elsewhere."""
  blocks = [jnp.eye(d) * scale if i == which else jnp.zeros((d, d)) for i in range(parts)]
  return jnp.concatenate(blocks, axis=0)


def default_eagle3_layers(num_layers: int) -> tuple:
  """Low, middle, high: (1, L//2, L-1), clipped to [0, L-1]."""
  top = num_layers - 1
  return (min(1, top), min(num_layers // 2, top), top)


class EAGLE(FeatureHead):
  """EAGLE-1 head: feature = the target's normed final hidden state."""

  kind = "eagle"

  @classmethod
  def init(cls, target, key=None, intermediate_size: Optional[int] = None,
           num_heads: Optional[int] = None, init_std: float = 0.02,
           greedy_drafts: bool = False, **kw) -> "EAGLE":
    """Fresh head for `target` (a Model). init_std scales the random weights (tests use a large
    one for varied drafts); fc starts as the identity on the feature."""
    if kw:
      raise ValueError(f"unknown EAGLE option(s): {', '.join(sorted(kw))}")
    key = jax.random.key(0) if key is None else key
    cfg = head_layer_config(target.config, intermediate_size, num_heads)
    d = cfg.hidden_size
    k1, k2 = jax.random.split(key)
    params = {
        "fc": _eye_block(d, 2, 1) + init_std * jax.random.normal(k1, (2 * d, d)),
        "fc_b": jnp.zeros((d,)),
        "layer": init_layer_params(cfg, k2, init_std),
    }
    return cls(params, target.config, cfg, (), greedy_drafts)


class EAGLE3(FeatureHead):
  """EAGLE-3 head: feature = a linear fusion of low / middle / high target layers."""

  kind = "eagle3"

  @classmethod
  def init(cls, target, key=None, target_layers: Optional[Sequence[int]] = None,
           intermediate_size: Optional[int] = None, num_heads: Optional[int] = None,
           init_std: float = 0.02, greedy_drafts: bool = False, **kw) -> "EAGLE3":
    if kw:
      raise ValueError(f"unknown EAGLE-3 option(s): {', '.join(sorted(kw))}")
    key = jax.random.key(0) if key is None else key
    layers = tuple(target_layers) if target_layers is not None else \
        default_eagle3_layers(target.config.num_layers)
    if len(layers) < 1:
      raise ValueError("EAGLE-3 needs at least one target layer to fuse")
    cfg = head_layer_config(target.config, intermediate_size, num_heads)
    d, n = cfg.hidden_size, len(layers)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "fuse": _eye_block(d, n, n - 1) + init_std * jax.random.normal(k1, (n * d, d)),
        "fc": _eye_block(d, 2, 1) + init_std * jax.random.normal(k2, (2 * d, d)),
        "fc_b": jnp.zeros((d,)),
        "layer": init_layer_params(cfg, k3, init_std),
        "out_norm": jnp.ones((d,)),
    }
    return cls(params, target.config, cfg, layers, greedy_drafts)
