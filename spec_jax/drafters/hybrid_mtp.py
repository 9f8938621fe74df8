"""The native MTP head of a hybrid target (Qwen3-Next / Qwen3.5: `mtp.*` in the target's own
folder, which transformers drops on load), as a drafter.

The module, as vLLM's Qwen3NextMultiTokenPredictor runs it (all norms zero-centred,
x_hat * (1 + w)):

    x_j = fc(concat(pre_fc_norm_embedding(embed(token_{j+1})), pre_fc_norm_hidden(f_j)))
    o_j = norm(decoder_layer(x_j))        one full-attention layer of the target's kind: gated
                                          attention with partial RoPE, q/k norms; MoE MLP
                                          (Qwen3-Next) or dense (Qwen3.5)
    logits_j = lm_head(o_j)               the target's LM head

f_j is the target's hidden state after its final norm (what its LM head reads); for the next
draft the module's own output o_j takes its place, so one module is chained for K > 1 (the
serving code's recursion: vLLM's spec_step_idx % num_mtp_layers with one layer). Slots,
positions and the module's own KV cache follow spec_jax.drafters.feature_head (slot j holds
(f_j, token_{j+1}) at RoPE position j).

  mtp.fc.weight                     [D, 2D]   fc (transposed)
  mtp.pre_fc_norm_embedding.weight  [D]       enorm
  mtp.pre_fc_norm_hidden.weight     [D]       hnorm
  mtp.layers.0.<decoder layer>                layer (models.qwen3_next.hf.read_layer)
  mtp.norm.weight                   [D]       norm

Chains only (supports_tree False): the hybrid target refuses trees anyway.
"""

from __future__ import annotations

import jax.numpy as jnp

from spec_jax.drafters.feature_head import FeatureHead
from spec_jax.drafters.base import frozen_drafter
from spec_jax.models import matmul
from spec_jax.models.blocks import embed, lm_head, rope_tables
from spec_jax.models.cache import KVCache
from spec_jax.models.qwen3_next import forward as hforward
from spec_jax.models.qwen3_next import hf as hhf
from spec_jax.models.qwen3_next import plan as hplan

_TOP = {"fc": "mtp.fc.weight", "enorm": "mtp.pre_fc_norm_embedding.weight",
        "hnorm": "mtp.pre_fc_norm_hidden.weight", "norm": "mtp.norm.weight"}
_LAYER = "mtp.layers.0."


def is_hybrid(config) -> bool:
  return config.model_type in hplan.MODEL_TYPES


def layer_config(target_config, sparse: bool):
  """The MTP decoder layer's one-layer config: a full-attention layer of the target's shapes,
  float32, its MLP sparse (the target's MoE sizes) or dense."""
  return target_config.replace(
      num_layers=1, layer_types=(hplan.FULL,), dtype="float32", num_mtp_layers=0,
      mlp_only_layers=() if sparse else (0,), decoder_sparse_step=1)


@frozen_drafter
class HybridMTP(FeatureHead):
  """The native MTP drafter of a hybrid target (module docstring). layer_config: the one-layer
  config of layer_config(target, sparse)."""

  kind = "mtp"
  supports_tree = False

  @classmethod
  def from_model(cls, model, greedy_drafts: bool = False) -> "HybridMTP":
    """The checkpoint's MTP module (Model.mtp_params, the raw mtp.* tensors sj.load keeps)."""
    raw = model.mtp_params or {}
    if not any(name.startswith("mtp.") for name in raw):
      raise ValueError(f"{model.source or 'this model'} carries no mtp.* tensors (the native "
                       "MTP head): load a checkpoint with its MTP weights")
    params = params_from_hf(raw, model.config)
    sparse = "router" in params["layer"]
    return cls(params, model.config, layer_config(model.config, sparse), (), greedy_drafts)

  def target_feature(self, params, hidden, layer_hidden):
    return hidden.astype(jnp.float32)                     # after the target's final norm

  def prepare(self, params):
    """As they are: the layer is the Qwen3-Next kind (gated attention), which reads its own
    layout, not the llama execution layout FeatureHead.prepare builds."""
    return params

  def combine(self, params, target_params, tokens, feature):
    eps = self.target_config.rms_norm_eps
    e = embed(target_params, tokens).astype(jnp.float32)
    cat = jnp.concatenate([hforward.norm(e, params["enorm"], eps),
                           hforward.norm(feature.astype(jnp.float32), params["hnorm"], eps)], -1)
    return matmul.dense(cat, params["fc"])

  def logits(self, params, target_params, out):
    """o (already normed by the module) -> float32 logits through the target's LM head."""
    return lm_head(target_params, self.target_config, out.astype(target_params["embed"].dtype))

  def _layer(self, params, x, k, v, offsets, positions=None, tree_mask=None):
    if tree_mask is not None:
      raise ValueError("the hybrid MTP head drafts chains only (no trees)")
    cfg = self.layer_config
    t = x.shape[1]
    if positions is None:
      positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    rope = rope_tables(positions, hplan.rope_inv_freq(cfg))
    lp, eps = params["layer"], cfg.rms_norm_eps
    plan = hplan.layout(cfg).layers[0]
    h = hforward.norm(x, lp["attn_norm"], eps)
    kv = KVCache(k=k[None], v=v[None], head_major=self.head_major_cache)
    attn, kv = hforward.attention_mixer(cfg, lp, h, rope, kv, 0, offsets)
    x = x + attn
    x = x + hforward.mlp(cfg, plan, lp, hforward.norm(x, lp["mlp_norm"], eps))
    return hforward.norm(x, params["norm"], eps), kv.k[0], kv.v[0]

  def unroll(self, *args, **kwargs):
    raise ValueError("the hybrid MTP head is the checkpoint's own; it is not trained here")


def params_from_hf(raw: dict, target_config) -> dict:
  """Raw mtp.* tensors {name: array} -> HybridMTP params (float32); ValueError naming what is
  missing, unknown or misshapen."""
  d = target_config.hidden_size
  params = {}
  for leaf, name in _TOP.items():
    if name not in raw:
      raise ValueError(f"the checkpoint's MTP weights lack {name}")
    value = jnp.asarray(raw[name], jnp.float32)
    value = value.T if leaf == "fc" else value
    want = (2 * d, d) if leaf == "fc" else (d,)
    if tuple(value.shape) != want:
      raise ValueError(f"MTP tensor {name} has shape {tuple(jnp.asarray(raw[name]).shape)}; "
                       f"the target (hidden size {d}) needs "
                       f"{tuple(reversed(want)) if leaf == 'fc' else want}")
    params[leaf] = value
  layer = {n[len(_LAYER):]: v for n, v in raw.items() if n.startswith(_LAYER)}
  extra = sorted(n for n in raw if n not in _TOP.values() and not n.startswith(_LAYER))
  if extra:
    raise ValueError(f"MTP tensors this reader does not know (one MTP layer is read): "
                     f"{', '.join(extra[:8])}")
  sparse = "mlp.gate.weight" in layer
  if sparse and not target_config.num_experts:
    raise ValueError("the MTP layer has an MoE MLP (mlp.gate.weight) but the target config has "
                     "no experts")
  cfg = layer_config(target_config, sparse)
  read = hhf.read_layer(cfg, layer, "the MTP layer (mtp.layers.0.*)")
  params["layer"] = {k: jnp.asarray(v, jnp.float32) for k, v in read.items()}
  return params

