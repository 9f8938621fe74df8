"""The decoder layers a trained drafter runs beside its target: their shape, init and checks.

EAGLE / EAGLE-3 / MTP heads (`feature_head`) run one llama-style layer, DFlash
(`dflash`) N of them stacked on a leading [N] axis; all read the target's width, default to
its heads, MLP and RoPE, and run in float32:

  layer_config(base, ...)        the drafter layers' ModelConfig from the target's (or its
                                 family's llama view)
  init_layer_params(cfg, key)    normal(std) weights, unit norms, zero biases, in the llama
                                 family's names (models.llama.forward); stacked: [N, ...] leaves
  check_target_shape(...)        ValueError when a target is not the shape the drafter was
                                 built for
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from spec_jax.models.config import ModelConfig

# The target fields a drafter built for one target needs of another (its embedding, LM head
# and captured layers).
TARGET_SHAPE = ("hidden_size", "vocab_size", "num_layers", "tie_embeddings")


def layer_config(base: ModelConfig, num_layers: int = 1, intermediate_size: Optional[int] = None,
                 num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, qkv_bias: bool = False, qk_norm: bool = False,
                 rms_norm_eps: Optional[float] = None, rope_theta: Optional[float] = None,
                 rope_scaling=None) -> ModelConfig:
  """The drafter layers' ModelConfig (float32, no sliding window, no MTP): `base`'s width and
  RoPE; heads default to base's (kv heads too when the head count is base's, else one per
  head), head_dim to base's (D / heads for another head count), the MLP to base's; eps and
  RoPE overridden when given (rope_theta with rope_scaling, a list of pairs or None)."""
  heads = int(num_heads or base.num_heads)
  kv = int(num_kv_heads or (base.num_kv_heads if heads == base.num_heads else heads))
  dh = int(head_dim or (base.head_dim if heads == base.num_heads else base.hidden_size // heads))
  out = base.replace(num_layers=int(num_layers), num_heads=heads, num_kv_heads=kv, head_dim=dh,
                     intermediate_size=int(intermediate_size or base.intermediate_size),
                     qkv_bias=bool(qkv_bias), qk_norm=bool(qk_norm), sliding_window=None,
                     dtype="float32", num_mtp_layers=0)
  if rms_norm_eps is not None:
    out = out.replace(rms_norm_eps=float(rms_norm_eps))
  if rope_theta is not None:
    scaling = None if rope_scaling is None else tuple(tuple(x) for x in rope_scaling)
    out = out.replace(rope_theta=float(rope_theta), rope_scaling=scaling)
  return out


def init_layer_params(cfg: ModelConfig, key, std: float = 0.02, stacked: bool = False) -> dict:
  """Decoder-layer params in the llama family's layout (models.llama.forward): normal(std)
  weights, unit norms, zero biases (qkv_bias), q_norm / k_norm (qk_norm). One layer (no [L]
  axis), or with stacked=True cfg.num_layers of them on a leading [N] axis."""
  d, f, hq, hkv, dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                       cfg.head_dim)
  lead = (cfg.num_layers,) if stacked else ()
  ks = iter(jax.random.split(key, 8))

  def normal(*shape):
    return std * jax.random.normal(next(ks), lead + shape, jnp.float32)

  ones = lambda *shape: jnp.ones(lead + shape)
  zeros = lambda *shape: jnp.zeros(lead + shape)
  p = {"attn_norm": ones(d), "mlp_norm": ones(d),
       "wq": normal(d, hq * dh), "wk": normal(d, hkv * dh), "wv": normal(d, hkv * dh),
       "wo": normal(hq * dh, d), "w_gate": normal(d, f), "w_up": normal(d, f),
       "w_down": normal(f, d)}
  if cfg.qkv_bias:
    p.update(bq=zeros(hq * dh), bk=zeros(hkv * dh), bv=zeros(hkv * dh))
  if cfg.qk_norm:
    p.update(q_norm=ones(dh), k_norm=ones(dh))
  return p


def check_target_shape(what: str, built_for: ModelConfig, target_config: ModelConfig) -> None:
  """ValueError naming the first TARGET_SHAPE field where `target_config` differs from the
  target the drafter (`what`, e.g. "eagle heads") was built for."""
  for name in TARGET_SHAPE:
    if getattr(target_config, name) != getattr(built_for, name):
      raise ValueError(f"{what}: built for a target with {name}={getattr(built_for, name)}; "
                       f"this target has {getattr(target_config, name)}")
