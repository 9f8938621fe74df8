"""Multi-token prediction heads (DeepSeek-V3, Qwen3-Next style), native or distilled.

    h'_j = fc(concat(enorm(embed(token_{j+1})), hnorm(h_j)))  ->  one transformer block  ->  o_j
    logits_j = lm_head(norm(o_j))                                (the target's LM head, shared)

h_j is the target's last-layer output before its final norm (the residual stream the main
model hands its MTP module); for the next draft the block's own output o_j takes its place,
so one module is applied recursively for K drafts. Cache / position conventions are those of
`spec_jax.drafters.feature_head` (slot j holds (h_j, token_{j+1}), o_j predicts token j+2).

A checkpoint that carries MTP weights wakes its dormant head with one call:

    target = sj.load(folder)                  # config: num_nextn_predict_layers or
    drafter = sj.drafters.MTP.from_model(target)     # mtp_num_hidden_layers > 0

Layouts read (HF [out, in] weights are transposed; the block uses the target's attention
flags, e.g. q/k norms for qwen3). DeepSeek's norms are plain RMSNorm with the stored weight w;
Qwen3-Next's are zero-centred, x / rms(x) * (1 + w) (vLLM: GemmaRMSNorm as Qwen3NextRMSNorm),
so every norm weight of the `mtp.*` layout (the four below and the block's input, post-attention
and q/k norms) is read as 1 + w. Only dense blocks are read: Qwen3-Next's gated attention and
MoE MLP have other shapes and are refused.

  Qwen3-Next                         DeepSeek-V3 (N = num_hidden_layers)    ours
  mtp.fc.weight                      model.layers.N.eh_proj.weight          fc [2D, D]
  mtp.pre_fc_norm_embedding.weight   model.layers.N.enorm.weight            enorm [D]
  mtp.pre_fc_norm_hidden.weight      model.layers.N.hnorm.weight            hnorm [D]
  mtp.layers.0.<layer weights>       model.layers.N.<layer weights>         layer/...
  mtp.norm.weight                    model.layers.N.shared_head.norm.weight out_norm [D]

Only the first MTP module is used (recursively); DeepSeek's optional shared_head.head and
embed_tokens copies are ignored in favour of the target's own (they are the same tensors).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters.feature_head import FeatureHead, head_layer_config
from spec_jax.drafters.head_layer import init_layer_params
from spec_jax.models.config import ModelConfig
from spec_jax.models.llama import hf as llama_hf


class MTP(FeatureHead):
  """MTP drafter: feature = the target's last-layer output (pre-norm)."""

  kind = "mtp"

  @classmethod
  def init(cls, target, key=None, init_std: float = 0.02, greedy_drafts: bool = False,
           intermediate_size=None, num_heads=None, **kw) -> "MTP":
    """A fresh (untrained) MTP module for `target`, to distill with train.distill_heads. Its
    block has the target's attention shape (num_heads, if given, must be the target's)."""
    if kw:
      raise ValueError(f"unknown MTP option(s): {', '.join(sorted(kw))}")
    if num_heads is not None and num_heads != target.config.num_heads:
      raise ValueError(f"an MTP block uses the target's {target.config.num_heads} attention "
                       f"heads, got num_heads={num_heads}")
    key = jax.random.key(0) if key is None else key
    cfg = head_layer_config(target.config, intermediate_size, copy_attention_flags=True)
    d = cfg.hidden_size
    k1, k2 = jax.random.split(key)
    eye = jnp.concatenate([jnp.zeros((d, d)), jnp.eye(d)], axis=0)
    params = {"fc": eye + init_std * jax.random.normal(k1, (2 * d, d)),
              "enorm": jnp.ones((d,)), "hnorm": jnp.ones((d,)),
              "layer": init_layer_params(cfg, k2, init_std), "out_norm": jnp.ones((d,))}
    return cls(params, target.config, cfg, (target.config.num_layers - 1,), greedy_drafts)

  @classmethod
  def from_model(cls, model, greedy_drafts: bool = False) -> "MTP":
    """The checkpoint's own MTP module (Model.mtp_params from sj.load); no training needed."""
    if not model.mtp_params:
      raise ValueError(f"{model.source or 'this model'} carries no MTP weights (config "
                       "num_nextn_predict_layers / mtp_num_hidden_layers is 0 or absent, or no "
                       "mtp.* tensors): train MTP heads with train.distill_heads instead")
    cfg = head_layer_config(model.config, copy_attention_flags=True)
    params = params_from_hf(model.mtp_params, model.config, cfg)
    return cls(params, model.config, cfg, (model.config.num_layers - 1,), greedy_drafts)


_LAYER_SUFFIX = llama_hf.LAYER_NAMES  # one HF -> ours name table, shared with the loader
_NORM_LEAVES = ("attn_norm", "mlp_norm", "q_norm", "k_norm")


def params_from_hf(raw: dict, target_config: ModelConfig, layer_config: ModelConfig) -> dict:
  """Raw MTP tensors {HF name: array} (either layout above) -> our MTP params (float32)."""
  n = target_config.num_layers
  zero_centred = any(name.startswith("mtp.") for name in raw)   # Qwen3-Next: norm = 1 + w
  if zero_centred:
    top = {"fc": "mtp.fc.weight", "enorm": "mtp.pre_fc_norm_embedding.weight",
           "hnorm": "mtp.pre_fc_norm_hidden.weight", "out_norm": "mtp.norm.weight"}
    layer_re = re.compile(r"^mtp\.layers\.0\.(.+)$")
  else:
    top = {"fc": f"model.layers.{n}.eh_proj.weight", "enorm": f"model.layers.{n}.enorm.weight",
           "hnorm": f"model.layers.{n}.hnorm.weight",
           "out_norm": f"model.layers.{n}.shared_head.norm.weight"}
    layer_re = re.compile(rf"^model\.layers\.{n}\.(.+)$")
  expected = jax.eval_shape(lambda k: init_layer_params(layer_config, k), jax.random.key(0))
  d = target_config.hidden_size
  want_top = {"fc": (2 * d, d), "enorm": (d,), "hnorm": (d,), "out_norm": (d,)}
  params: dict = {"layer": {}}
  missing = []
  for leaf, name in top.items():
    if name not in raw:
      missing.append(name)
      continue
    value = np.asarray(raw[name], np.float32)
    value = value.T if leaf == "fc" else value
    if value.shape != want_top[leaf]:
      raise ValueError(f"MTP tensor {name} has shape {np.asarray(raw[name]).shape}; the target "
                       f"(hidden size {d}) needs {tuple(reversed(want_top[leaf])) if leaf == 'fc' else want_top[leaf]}")
    if zero_centred and leaf != "fc":
      value = 1.0 + value
    params[leaf] = jnp.asarray(value)
  prefix = next(iter(top.values())).rsplit(".", 2)[0]
  for name, value in raw.items():
    m = layer_re.match(name)
    if not m or m.group(1) not in _LAYER_SUFFIX:
      continue
    leaf, transpose = _LAYER_SUFFIX[m.group(1)]
    if leaf not in expected:
      raise ValueError(f"MTP tensor {name} is present but the target's config does not use it")
    value = np.asarray(value, np.float32)
    value = value.T if transpose else value
    if value.shape != tuple(expected[leaf].shape):
      raise ValueError(f"MTP tensor {name} has shape {value.shape} (after transposing HF's "
                       f"[out, in]); expected {tuple(expected[leaf].shape)}")
    if zero_centred and leaf in _NORM_LEAVES:
      value = 1.0 + value
    params["layer"][leaf] = jnp.asarray(value)
  for leaf in expected:
    if leaf not in params["layer"]:
      suffix = next(s for s, (l, _) in _LAYER_SUFFIX.items() if l == leaf)
      missing.append(f"<mtp layer>.{suffix}")
  if missing:
    raise ValueError(f"the checkpoint's MTP weights ({prefix}...) lack {len(missing)} "
                     f"tensor(s): {', '.join(missing[:8])}")
  return params
