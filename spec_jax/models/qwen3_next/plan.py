"""The static plan of a hybrid Qwen3-Next / Qwen3.5 stack: config checks, per-layer kinds, sizes.

A layer is "linear_attention" (a Gated DeltaNet: recurrent state [Hv, Dk, Dv] and a causal
conv window of W - 1 inputs) or "full_attention" (gated softmax attention over a KV cache);
its MLP is dense (Qwen3.5, and Qwen3-Next's mlp_only_layers) or Qwen3-Next's sparse MoE.

  layout(config)     per layer: kind, its slot among the layers of its kind (the row of the
                     stacked KV buffer or recurrent state), whether its MLP is sparse
  rope_inv_freq      the attention layers' partial RoPE (the first rotary_dim of head_dim)
  check_config       ValueError naming the field for anything the forward cannot run
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from spec_jax.models.family import check_layer_types

LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = (LINEAR, FULL)
MODEL_TYPES = ("qwen3_next", "qwen3_5_text")
# ModelConfig fields only this family reads, with the value that means "not used" (layer_types
# is shared with the Gemma family).
HYBRID_ONLY = {"layer_types": None, "partial_rotary_factor": 1.0, "linear_num_key_heads": 0,
               "linear_num_value_heads": 0, "linear_key_head_dim": 0, "linear_value_head_dim": 0,
               "linear_conv_kernel_dim": 0, "num_experts": 0, "num_experts_per_tok": 0,
               "moe_intermediate_size": 0, "shared_expert_intermediate_size": 0,
               "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": ()}


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """One layer: kind (LINEAR / FULL), slot (its row among the layers of its kind), sparse
  (Qwen3-Next's MoE MLP rather than the dense SwiGLU)."""
  index: int
  kind: str
  slot: int
  sparse: bool


@dataclasses.dataclass(frozen=True)
class HybridLayout:
  layers: tuple
  num_linear: int
  num_full: int


def _positive(config, *names) -> None:
  for name in names:
    value = getattr(config, name)
    if not isinstance(value, (int, np.integer)) or int(value) < 1:
      raise ValueError(f"a {config.model_type} ModelConfig needs a positive integer {name}, got "
                       f"{value!r}")


def check_config(config) -> None:
  """Normalises the hybrid fields (lists -> tuples) and raises ValueError naming the field for
  what the forward cannot run. Called by ModelConfig.__post_init__."""
  c = config
  types = check_layer_types(c, LAYER_TYPES)
  if LINEAR in types:
    _positive(c, "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim")
    if c.linear_num_value_heads % c.linear_num_key_heads:
      raise ValueError(f"linear_num_value_heads ({c.linear_num_value_heads}) must be a multiple "
                       f"of linear_num_key_heads ({c.linear_num_key_heads})")
  rotary = rotary_dim(c)
  if not 0 < float(c.partial_rotary_factor) <= 1 or rotary % 2 or rotary < 2:
    raise ValueError(f"partial_rotary_factor ({c.partial_rotary_factor}) times head_dim "
                     f"({c.head_dim}) must be an even rotary dimension in [2, head_dim]")
  if c.rope_scaling:
    kind = dict(c.rope_scaling).get("rope_type", "default")
    if kind != "default":
      raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} for {c.model_type}; "
                       "supported: default")
  object.__setattr__(c, "mlp_only_layers", tuple(int(i) for i in c.mlp_only_layers))
  if c.num_experts:
    _positive(c, "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step")
    if c.num_experts_per_tok > c.num_experts:
      raise ValueError(f"num_experts_per_tok ({c.num_experts_per_tok}) must be <= num_experts "
                       f"({c.num_experts})")
    if c.shared_expert_intermediate_size < 0:
      raise ValueError("shared_expert_intermediate_size must be >= 0")


def rotary_dim(config) -> int:
  """How many leading dims of each attention head RoPE rotates (transformers:
  int(head_dim * partial_rotary_factor))."""
  return int(config.head_dim * float(config.partial_rotary_factor))


@functools.lru_cache(maxsize=None)
def layout(config) -> HybridLayout:
  """The per-layer plan of a checked hybrid config."""
  c = config
  counts = {LINEAR: 0, FULL: 0}
  plans = []
  for i, kind in enumerate(c.layer_types):
    sparse = (c.num_experts > 0 and i not in c.mlp_only_layers
              and (i + 1) % c.decoder_sparse_step == 0)
    plans.append(LayerPlan(index=i, kind=kind, slot=counts[kind], sparse=sparse))
    counts[kind] += 1
  return HybridLayout(layers=tuple(plans), num_linear=counts[LINEAR], num_full=counts[FULL])


@functools.lru_cache(maxsize=None)
def rope_inv_freq(config) -> np.ndarray:
  """float32 [rotary_dim / 2]: 1 / theta ** (arange(0, r, 2) / r), in float32 as transformers'
  compute_default_rope_parameters (over the rotary dim, not head_dim)."""
  r = rotary_dim(config)
  exps = np.arange(0, r, 2).astype(np.float32) / np.float32(r)
  return (np.float32(1.0) / (np.float32(config.rope_theta) ** exps)).astype(np.float32)


def linear_sizes(config) -> dict:
  """The Gated DeltaNet sizes: key_dim Hk*Dk, value_dim Hv*Dv, conv channels 2 key_dim +
  value_dim (q, k, v go through the conv), the head ratio r = Hv / Hk."""
  c = config
  kd = c.linear_num_key_heads * c.linear_key_head_dim
  vd = c.linear_num_value_heads * c.linear_value_head_dim
  return {"key_dim": kd, "value_dim": vd, "conv_dim": 2 * kd + vd,
          "ratio": c.linear_num_value_heads // max(c.linear_num_key_heads, 1)}


def num_params(config) -> int:
  """Parameter count (embedding counted once when tied; the MTP head not counted)."""
  c = config
  d, v = c.hidden_size, c.vocab_size
  total = v * d * (1 if c.tie_embeddings else 2) + d
  for p in layout(c).layers:
    total += 2 * d
    if p.kind == LINEAR:
      s = linear_sizes(c)
      hv = c.linear_num_value_heads
      total += (d * s["conv_dim"] + d * s["value_dim"] + 2 * d * hv
                + s["conv_dim"] * c.linear_conv_kernel_dim + 2 * hv + c.linear_value_head_dim
                + s["value_dim"] * d)
    else:
      q = c.num_heads * c.head_dim
      total += 2 * d * q + 2 * d * c.num_kv_heads * c.head_dim + q * d + 2 * c.head_dim
    if p.sparse:
      total += d * c.num_experts + 3 * c.num_experts * d * c.moe_intermediate_size
      if c.shared_expert_intermediate_size:
        total += 3 * d * c.shared_expert_intermediate_size + d
    else:
      total += 3 * d * c.intermediate_size
  return total


def llama_view(config):
  """A llama-family ModelConfig of this model's sizes (width, vocabulary, attention heads,
  head_dim, RoPE theta, full rotary): what draft heads with a llama-style layer of their own
  (EAGLE, EAGLE-3, DFlash) build on for a hybrid target."""
  return dataclasses.replace(config, model_type="llama", qk_norm=False, rope_scaling=None,
                             num_mtp_layers=0, **HYBRID_ONLY)
