"""The DFlash drafter's static shape: its layers' config, fresh params, and the checks of both.

  default_target_layers(L, N)   the published default captured layers
  layer_config(target, N, ...)  the drafter layers' ModelConfig (q/k norms, the target's width)
  init_layers(cfg, key, std)    stacked [N, ...] layer params
  expected_shapes(drafter)      the shape of every param leaf of a configuration
  check_shape(drafter, params)  ValueError naming what does not fit
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from spec_jax.drafters import head_layer
from spec_jax.drafters.dflash_layers import LAYER_TYPES, SLIDING
from spec_jax.models.config import ModelConfig


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple:
  """The published default (z-lab `build_target_layer_ids`): the middle layer for a one-layer
  drafter, else num_draft_layers ids spread evenly from layer 1 to L - 3."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  start, end = 1, num_target_layers - 3
  return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1)))
               for i in range(num_draft_layers))


def layer_config(target_config: ModelConfig, num_layers: int,
                 intermediate_size: Optional[int] = None, num_heads: Optional[int] = None,
                 num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 rms_norm_eps: Optional[float] = None, rope_theta: Optional[float] = None,
                 rope_scaling=None) -> ModelConfig:
  """The drafter layers' ModelConfig (float32, q/k norms, no biases): the target's width;
  heads, MLP, eps and RoPE default to the target's (head_layer.layer_config)."""
  base = target_config.family.llama_view(target_config)   # llama-style layers for any family
  return head_layer.layer_config(base, num_layers, intermediate_size, num_heads,
                                 num_kv_heads, head_dim, qkv_bias=False, qk_norm=True,
                                 rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                                 rope_scaling=rope_scaling)


def init_layers(cfg: ModelConfig, key, std: float) -> dict:
  """Stacked [N, ...] layer params in the llama family's names (models.llama.forward), plus
  q_norm / k_norm: normal(std) weights, unit norms."""
  return head_layer.init_layer_params(cfg, key, std, stacked=True)


def expected_shapes(drafter) -> dict:
  """The shape of every param leaf of `drafter`'s configuration (a DFlash)."""
  c, t = drafter.layer_config, drafter.target_config
  d = c.hidden_size
  layers = jax.eval_shape(lambda k: init_layers(c, k, 0.02), jax.random.key(0))
  shapes = {"fc": (len(drafter.target_layers) * t.hidden_size, d), "hidden_norm": (d,),
            "norm": (d,), "layers": jax.tree.map(lambda x: tuple(x.shape), layers)}
  if drafter.mask_token_id is None:
    shapes["mask_embed"] = (d,)
  return shapes


def check_shape(drafter, params) -> None:
  """Raises ValueError naming what does not fit: the static configuration or a param shape."""
  t, c = drafter.target_config, drafter.layer_config
  if isinstance(drafter.block_size, bool) or drafter.block_size < 2:
    raise ValueError(f"dflash: block_size must be an integer >= 2 (the last committed token and "
                     f"at least one mask slot), got {drafter.block_size}")
  if not drafter.target_layers:
    raise ValueError("dflash: target_layers must name at least one target layer")
  bad = [i for i in drafter.target_layers if not 0 <= i < t.num_layers]
  if bad:
    raise ValueError(f"dflash: target_layers {bad} outside the target's {t.num_layers} layers; "
                     f"allowed: 0 <= id < {t.num_layers} (id = the output of decoder layer id)")
  if c.hidden_size != t.hidden_size:
    raise ValueError(f"dflash: the drafter's hidden_size {c.hidden_size} must be the target's "
                     f"{t.hidden_size} (it reads the target's embedding and LM head)")
  if len(drafter.layer_types) != c.num_layers:
    raise ValueError(f"dflash: layer_types has {len(drafter.layer_types)} entries for "
                     f"{c.num_layers} drafter layers; allowed: one per layer")
  unknown = sorted(set(drafter.layer_types) - set(LAYER_TYPES))
  if unknown:
    raise ValueError(f"dflash: layer_types {unknown}; allowed: {', '.join(LAYER_TYPES)}")
  if SLIDING in drafter.layer_types and (drafter.sliding_window is None or
                                         drafter.sliding_window < 1):
    raise ValueError(f"dflash: sliding_attention layers need a sliding_window >= 1, got "
                     f"{drafter.sliding_window}")
  m = drafter.mask_token_id
  if m is not None and not 0 <= m < t.vocab_size:
    raise ValueError(f"dflash: mask_token_id={m} outside the target's vocabulary [0, "
                     f"{t.vocab_size}); allowed: a reserved id of the vocabulary, or None for a "
                     f"learned mask embedding")
  want = drafter.param_shapes() if hasattr(drafter, "param_shapes") else expected_shapes(drafter)
  got = jax.tree.map(lambda x: tuple(np.shape(x)), params)
  if got != want:
    raise ValueError(f"dflash: params have shapes {got}; this configuration needs {want}")
