"""Gemma 3 / Gemma 4 Hugging Face folders -> ModelConfig and gemma.py's param layout.

Read: config.json of model_type gemma3_text / gemma4_text (CausalLM checkpoints) or gemma3 /
gemma4 (the multimodal ConditionalGeneration checkpoints the hub ships: the text config is used,
the vision and audio towers are skipped). Tensor names, below `model.` (CausalLM),
`model.language_model.` or `language_model.model.` (ConditionalGeneration, new and legacy);
HF [out, in] Linear weights are transposed into our [in, out]:

  embed_tokens.weight                          embed           norm.weight   final_norm
  layers.N.input_layernorm / post_attention_layernorm / pre_feedforward_layernorm /
    post_feedforward_layernorm .weight         attn_norm / post_attn_norm / mlp_norm / post_mlp_norm
  layers.N.self_attn.{q,k,v,o}_proj.weight     wq, wk, wv, wo  self_attn.{q,k}_norm.weight  q/k_norm
  layers.N.mlp.{gate,up,down}_proj.weight      w_gate, w_up, w_down
  layers.N.per_layer_input_gate / per_layer_projection .weight    ple_gate, ple_proj
  layers.N.post_per_layer_input_norm.weight    ple_norm        layers.N.layer_scalar  layer_scalar
  embed_tokens_per_layer.weight                embed_per_layer
  per_layer_model_projection.weight            per_layer_proj  per_layer_projection_norm.weight
  lm_head.weight (or language_model.lm_head.weight)   lm_head, unless tied

KV-shared layers' k/v projections and norms (some hub checkpoints store them; transformers
ignores them too) are skipped. Unsupported variants raise ValueError before any weight is read:
the MoE block (`enable_moe_block`, Gemma 4 26B-A4B), bidirectional attention, attention biases,
an unknown layer type or RoPE type.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Optional

import jax
import numpy as np

from spec_jax.models import hf_files
from spec_jax.models.config import ModelConfig
from spec_jax.models.gemma_layout import layout

HF_MODEL_TYPES = {"gemma3": "gemma3", "gemma3_text": "gemma3", "gemma4": "gemma4",
                  "gemma4_text": "gemma4"}
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
_SKIPPED_TOWERS = re.compile(r"^(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio|"
                             r"multi_modal_projector)\.")
_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "per_layer_input_gate.weight": ("ple_gate", True),
    "per_layer_projection.weight": ("ple_proj", True),
    "post_per_layer_input_norm.weight": ("ple_norm", False),
    "layer_scalar": ("layer_scalar", False),
}
_KV_ONLY = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight",
            "self_attn.v_norm.weight")
_TOP_NAMES = {
    "embed_tokens.weight": ("embed", False),
    "norm.weight": ("final_norm", False),
    "embed_tokens_per_layer.weight": ("embed_per_layer", False),
    "per_layer_model_projection.weight": ("per_layer_proj", True),
    "per_layer_projection_norm.weight": ("per_layer_proj_norm", False),
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def is_gemma_type(model_type) -> bool:
  return model_type in HF_MODEL_TYPES


def _get(cfg, name, default=None):
  value = getattr(cfg, name, default)
  return default if value is None else value


def text_config(cfg):
  """The text decoder's config of a Gemma config object (itself for *_text configs)."""
  if getattr(cfg, "model_type", None) in ("gemma3", "gemma4"):
    return cfg.get_text_config()
  return cfg


def _kv_by_type(t, family: str, source: str) -> tuple:
  """((layer_type, num_kv_heads, head_dim), ...) from the per-layer overrides (Gemma 4)."""
  if family == "gemma3":
    return tuple((kind, int(t.num_key_value_heads), int(t.head_dim))
                 for kind in sorted(set(t.layer_types)))
  shapes = {}
  for i, kind in enumerate(t.layer_types):
    lc = t.per_layer_config[i]
    shape = (int(_get(lc, "num_key_value_heads", t.num_attention_heads)),
             int(_get(lc, "head_dim", t.hidden_size // t.num_attention_heads)))
    if shapes.setdefault(kind, shape) != shape:
      raise ValueError(f"{source}: {kind} layers differ in KV shape ({shapes[kind]} vs {shape} "
                       f"at layer {i}); spec_jax supports one (num_kv_heads, head_dim) per "
                       "layer type")
  return tuple((kind, h, d) for kind, (h, d) in sorted(shapes.items()))


def _rope_by_type(t, source: str) -> tuple:
  params = getattr(t, "rope_parameters", None) or {}
  out = []
  for kind in sorted(set(t.layer_types)):
    p = dict(params.get(kind) or {})
    if "rope_theta" not in p:
      raise ValueError(f"{source}: rope_parameters has no rope_theta for {kind} layers")
    theta = p.pop("rope_theta")
    items = tuple(sorted((str(k), v) for k, v in p.items()
                         if v is not None and not isinstance(v, (dict, list))))
    out.append((kind, float(theta), items or None))
  return tuple(out)


def config_from_hf(cfg, dtype: str = "float32", source: str = "config.json",
                   tie_embeddings: Optional[bool] = None) -> ModelConfig:
  """A transformers Gemma 3 / Gemma 4 config (text or multimodal) -> ModelConfig.
  ValueError (one line) for what spec_jax does not run."""
  top = cfg
  t = text_config(cfg)
  family = HF_MODEL_TYPES.get(getattr(t, "model_type", None))
  if family is None:
    raise ValueError(f"{source}: not a Gemma 3 / Gemma 4 config (model_type "
                     f"{getattr(cfg, 'model_type', None)!r})")
  if getattr(t, "enable_moe_block", False):
    raise ValueError(f"{source}: enable_moe_block is true (the Gemma 4 MoE models, e.g. "
                     "26B-A4B): spec_jax supports the dense and E2B/E4B Gemma 4 models only")
  if getattr(t, "use_bidirectional_attention", None):
    raise ValueError(f"{source}: use_bidirectional_attention="
                     f"{t.use_bidirectional_attention!r}: spec_jax decodes causal models only")
  if getattr(t, "attention_bias", False):
    raise ValueError(f"{source}: attention_bias is true; Gemma models in spec_jax have no "
                     "attention biases")
  act = _get(t, "hidden_activation", _get(t, "hidden_act", "gelu_pytorch_tanh"))
  if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(f"{source}: unsupported hidden_activation {act!r}; supported: "
                     "gelu_pytorch_tanh")
  layer_types = tuple(str(x) for x in t.layer_types)
  from spec_jax.models.gemma_layout import LAYER_TYPES
  unknown = sorted(set(layer_types) - set(LAYER_TYPES))
  if unknown:
    raise ValueError(f"{source}: unsupported layer type(s) {unknown}; supported: "
                     f"{', '.join(LAYER_TYPES)}")
  kv = _kv_by_type(t, family, source)
  first = dict((k, (h, d)) for k, h, d in kv)[layer_types[0]]
  gemma4 = family == "gemma4"
  if tie_embeddings is None:
    tie_embeddings = bool(_get(top, "tie_word_embeddings", _get(t, "tie_word_embeddings", True)))
  bos = getattr(t, "bos_token_id", None)
  return ModelConfig(
      vocab_size=int(t.vocab_size), hidden_size=int(t.hidden_size),
      intermediate_size=int(t.intermediate_size), num_layers=int(t.num_hidden_layers),
      num_heads=int(t.num_attention_heads), num_kv_heads=first[0], head_dim=first[1],
      rms_norm_eps=float(_get(t, "rms_norm_eps", 1e-6)), tie_embeddings=tie_embeddings,
      sliding_window=int(t.sliding_window) if "sliding_attention" in layer_types else None,
      max_position_embeddings=int(_get(t, "max_position_embeddings", 8192)), model_type=family,
      bos_token_id=None if bos is None else int(bos),
      eos_token_ids=hf_files.token_ids(getattr(t, "eos_token_id", None)), dtype=dtype,
      hidden_act="gelu_tanh", embed_scale=True, norm_plus_one=not gemma4,
      attention_scale=1.0 if gemma4 else float(_get(t, "query_pre_attn_scalar", 256)) ** -0.5,
      final_logit_softcap=_softcap(top, t),
      layer_types=layer_types, rope_by_type=_rope_by_type(t, source), kv_by_type=kv,
      v_norm=gemma4, k_eq_v=bool(gemma4 and getattr(t, "attention_k_eq_v", False)),
      layer_scalar=gemma4, num_kv_shared_layers=int(_get(t, "num_kv_shared_layers", 0)),
      double_wide_mlp=bool(gemma4 and getattr(t, "use_double_wide_mlp", False)),
      per_layer_input_size=int(_get(t, "hidden_size_per_layer_input", 0)) if gemma4 else 0,
      per_layer_vocab_size=(int(_get(t, "vocab_size_per_layer_input", 0)) if gemma4 and
                            _get(t, "hidden_size_per_layer_input", 0) else 0))


def _softcap(top, t) -> Optional[float]:
  """The final logit soft-cap. transformers' Gemma3ForConditionalGeneration (model_type
  "gemma3") never applies its text config's final_logit_softcapping (the released Gemma 3
  configs set none), so neither do we for those checkpoints; every other class does."""
  cap = getattr(t, "final_logit_softcapping", None)
  if cap is None or getattr(top, "model_type", None) == "gemma3":
    return None
  return float(cap)


def read_config(folder: pathlib.Path):
  """config.json through transformers.AutoConfig (ValueError when it cannot parse it)."""
  import transformers
  try:
    return transformers.AutoConfig.from_pretrained(os.fspath(folder))
  except Exception as e:  # noqa: BLE001 - surface any parse problem at the boundary
    raise ValueError(f"{folder / 'config.json'}: transformers could not read this config: "
                     f"{e}") from e


def expected_shapes(config) -> dict:
  from spec_jax.models.gemma import init_params
  abstract = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
  return jax.tree.map(lambda s: tuple(s.shape), abstract)


def _prefix(names) -> str:
  for p in _PREFIXES:
    if p + "embed_tokens.weight" in names:
      return p
  raise ValueError("no Gemma text embedding found (looked for "
                   + ", ".join(p + "embed_tokens.weight" for p in _PREFIXES) + ")")


def load_gemma(folder, dtype: Optional[str] = None) -> tuple:
  """A Gemma Hugging Face folder -> (ModelConfig, numpy params, None)."""
  folder = pathlib.Path(folder)
  source = str(folder / "config.json")
  config = config_from_hf(read_config(folder), source=source)
  extra = tuple(x for x in hf_files.generation_eos(folder) if x not in config.eos_token_ids)
  if extra:
    config = config.replace(eos_token_ids=config.eos_token_ids + extra)
  paths, _ = hf_files.tensor_files(folder)
  where = {}
  for p in paths:
    f = hf_files.TensorFile(p)
    for name in f.names:
      where.setdefault(name, f)
  prefix = _prefix(where)
  if dtype is None:
    dtype = hf_files.checkpoint_dtype(where[prefix + "embed_tokens.weight"].meta[
        prefix + "embed_tokens.weight"][0])
  config = config.replace(dtype=dtype)
  shapes = expected_shapes(config)
  plans = layout(config).layers

  plan, unknown = [], []          # (name, file, (leaf path), transpose)
  for name, f in where.items():
    if _SKIPPED_TOWERS.match(name) or name.endswith("rotary_emb.inv_freq"):
      continue
    if name in _HEADS:
      if config.tie_embeddings:
        continue
      plan.append((name, f, ("lm_head",), True))
      continue
    if not name.startswith(prefix):
      unknown.append(name)
      continue
    rel = name[len(prefix):]
    m = _LAYER_RE.match(rel)
    if m:
      i, suffix = int(m.group(1)), m.group(2)
      if i < config.num_layers and plans[i].kv_shared and suffix in _KV_ONLY:
        continue
      if i >= config.num_layers or suffix not in _LAYER_NAMES or \
          _LAYER_NAMES[suffix][0] not in shapes["layers"][i]:
        unknown.append(name)
        continue
      leaf, transpose = _LAYER_NAMES[suffix]
      plan.append((name, f, ("layers", i, leaf), transpose))
    elif rel in _TOP_NAMES and _TOP_NAMES[rel][0] in shapes:
      leaf, transpose = _TOP_NAMES[rel]
      plan.append((name, f, (leaf,), transpose))
    else:
      unknown.append(name)
  if unknown:
    shown = ", ".join(sorted(unknown)[:8]) + (" ..." if len(unknown) > 8 else "")
    raise ValueError(f"{folder}: {len(unknown)} tensor(s) this {config.model_type} config does "
                     f"not use: {shown}")

  def want(target):
    node = shapes
    for part in target:
      node = node[part]
    return node

  filled = set()
  for name, f, target, transpose in plan:
    shape = want(target)
    hf_shape = tuple(reversed(shape)) if transpose else tuple(shape)
    if tuple(f.meta[name][1]) != hf_shape:
      raise ValueError(f"{f.path}: tensor {name} has shape {tuple(f.meta[name][1])} but "
                       f"config.json implies {hf_shape}")
    filled.add(target)
  needed = [("layers", i, leaf) for i, lp in enumerate(shapes["layers"]) for leaf in lp]
  needed += [(leaf,) for leaf in shapes if leaf != "layers"]
  missing = ["/".join(map(str, t)) for t in needed if t not in filled]
  if missing:
    shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
    raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensor(s) (spec_jax names): "
                     f"{shown}")

  np_dtype = hf_files.np_dtype(dtype)
  params = {"layers": [dict() for _ in range(config.num_layers)]}
  for name, f, target, transpose in plan:
    value = f.read(name)
    value = (value.T if transpose else value).astype(np_dtype, copy=False)
    if target[0] == "layers":
      params["layers"][target[1]][target[2]] = np.ascontiguousarray(value)
    else:
      params[target[0]] = np.ascontiguousarray(value)
  return config, params, None


def folder_model_type(folder: pathlib.Path):
  """model_type of config.json, or None when unreadable (the generic loader reports that)."""
  try:
    return json.loads((folder / "config.json").read_text()).get("model_type")
  except (OSError, json.JSONDecodeError, AttributeError):
    return None
