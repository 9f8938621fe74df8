"""The llama family's Hugging Face reading: config.json fields and tensors -> our layout.

model_types llama, mistral, qwen2, qwen3. Names (HF [out, in] Linear weights are transposed into
our [in, out]):

  model.embed_tokens.weight                        embed [V, D]
  lm_head.weight                                   lm_head [D, V]  (or embed, when tied and the
                                                                    embedding is not stored)
  model.norm.weight                                final_norm
  model.layers.N.<LAYER_NAMES suffix>              layers/<leaf>[N] (hf_reader.DECODER_LAYER
                                                   plus the q/k/v biases of qkv_bias)
  mtp.*                                            collected raw into Model.mtp_params
  model.layers.{L+i}.* (i < num_mtp_layers)        DeepSeek-V3-layout MTP modules, likewise raw

num_mtp_layers comes from config `num_nextn_predict_layers` (DeepSeek-V3) or
`mtp_num_hidden_layers` (Qwen3-Next); `spec_jax.drafters.MTP.from_model` converts the raw tensors.
Every tensor's shape is checked against the config before any data is read.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from spec_jax.models import hf_reader
from spec_jax.models.hf_reader import Tensor, get, listing
from spec_jax.models.llama.forward import init_params

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# HF per-layer suffix -> (our leaf name, transpose?)
LAYER_NAMES = hf_reader.layer_names(add={
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False)})
TOP_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "lm_head.weight": ("lm_head", True),
    "model.norm.weight": ("final_norm", False),
}
# Biases our layout has no slot for: accepted only when all zero (HF initialises them so).
_ZERO_ONLY = ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias",
              "mlp.down_proj.bias")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


# ----------------------------------------------------------------------------- config

def rope_from_hf(cfg) -> tuple:
  """(rope_theta, rope_scaling tuple or None) from a transformers config.

  transformers >= 5 keeps everything in `rope_parameters` (rope_theta, rope_type, factor, ...);
  older versions (and older config objects) use `rope_theta` and `rope_scaling`.
  """
  params = getattr(cfg, "rope_parameters", None)
  if isinstance(params, dict) and params:
    scaling = dict(params)
    theta = scaling.pop("rope_theta", None)
    if theta is None:
      theta = get(cfg, "rope_theta", 10000.0)
  else:
    theta = get(cfg, "rope_theta", 10000.0)
    scaling = dict(getattr(cfg, "rope_scaling", None) or {})
  if "type" in scaling and "rope_type" not in scaling:
    scaling["rope_type"] = scaling.pop("type")
  scaling.pop("type", None)
  kind = scaling.get("rope_type", "default")
  if kind not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")
  if kind == "default":
    return float(theta), None
  if kind == "linear" and "factor" not in scaling:
    raise ValueError("linear rope scaling needs 'factor'")
  if kind == "llama3":
    missing = [k for k in _LLAMA3_KEYS if scaling.get(k) is None]
    if missing:
      raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
  return float(theta), hf_reader.rope_items(scaling)


def _sliding_window(cfg, model_type: str, num_layers: int) -> Optional[int]:
  window = getattr(cfg, "sliding_window", None)
  if model_type == "mistral":
    return int(window) if window else None
  if model_type not in ("qwen2", "qwen3") or not getattr(cfg, "use_sliding_window", False):
    return None
  if not window:
    return None
  layer_types = getattr(cfg, "layer_types", None)
  if layer_types is None:  # transformers < 5: sliding from layer max_window_layers on
    start = int(get(cfg, "max_window_layers", 0))
    layer_types = ["full_attention" if i < start else "sliding_attention"
                   for i in range(num_layers)]
  kinds = set(layer_types)
  if kinds == {"full_attention"}:
    return None
  if kinds == {"sliding_attention"}:
    return int(window)
  raise ValueError(f"{model_type} config mixes sliding-window and full-attention layers "
                   f"({list(layer_types)}); spec_jax supports one window for every layer")


def config_fields(cfg, source: str = "config.json") -> dict:
  """A transformers PretrainedConfig (or anything with its attributes) -> ModelConfig fields."""
  model_type = getattr(cfg, "model_type", None)
  act = get(cfg, "hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{source}: unsupported hidden_act {act!r}; supported: silu")
  heads = int(cfg.num_attention_heads)
  hidden = int(cfg.hidden_size)
  num_layers = int(cfg.num_hidden_layers)
  theta, scaling = rope_from_hf(cfg)
  # Mistral has no attention biases (transformers' MistralAttention ignores the key).
  qkv_bias = True if model_type == "qwen2" else (
      model_type != "mistral" and bool(getattr(cfg, "attention_bias", False)))
  num_mtp = int(get(cfg, "num_nextn_predict_layers", 0) or get(cfg, "mtp_num_hidden_layers", 0))
  bos = getattr(cfg, "bos_token_id", None)
  return dict(
      vocab_size=int(cfg.vocab_size), hidden_size=hidden,
      intermediate_size=int(cfg.intermediate_size), num_layers=num_layers, num_heads=heads,
      num_kv_heads=int(get(cfg, "num_key_value_heads", heads)),
      head_dim=int(get(cfg, "head_dim", hidden // heads)), rope_theta=theta,
      rope_scaling=scaling, rms_norm_eps=float(get(cfg, "rms_norm_eps", 1e-6)),
      tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), qkv_bias=qkv_bias,
      qk_norm=model_type == "qwen3", sliding_window=_sliding_window(cfg, model_type, num_layers),
      max_position_embeddings=int(get(cfg, "max_position_embeddings", 2048)),
      model_type=model_type, bos_token_id=None if bos is None else int(bos),
      eos_token_ids=hf_reader.token_ids(getattr(cfg, "eos_token_id", None)),
      num_mtp_layers=num_mtp)


# ----------------------------------------------------------------------------- tensors

def checkpoint_dtype(where: dict) -> str:
  """The checkpoint's dtype, taken from the embedding / LM head (float32 when neither is
  stored in bfloat16)."""
  for name in ("model.embed_tokens.weight", "lm_head.weight"):
    if name in where:
      return hf_reader.checkpoint_dtype(where[name].meta[name][0])
  return "float32"


def read_params(config, where: dict, folder, dtype: Optional[str] = None) -> tuple:
  """Hugging Face tensors -> (config with dtype, numpy params in llama.forward's layout, mtp
  dict or None). `where` maps each tensor name to the file that holds it: anything with `path`,
  `meta[name] = (dtype string, shape)` and `read(name) -> np.ndarray` (a safetensors file, a
  GGUF file's dequantised view). Every shape is checked before any data is read."""
  config = config.replace(dtype=dtype or checkpoint_dtype(where))
  shapes = hf_reader.param_shapes(init_params, config)

  plan, mtp_names, zero_only, unknown = [], [], [], []
  for name, f in where.items():
    if name.startswith("mtp."):
      mtp_names.append(name)
      continue
    if _IGNORED_RE.search(name):
      continue
    m = _LAYER_RE.match(name)
    if m:
      layer, suffix = int(m.group(1)), m.group(2)
      if config.num_layers <= layer < config.num_layers + config.num_mtp_layers:
        mtp_names.append(name)  # DeepSeek-V3 layout: MTP modules after the last layer
      elif suffix in _ZERO_ONLY:
        zero_only.append(name)
      elif suffix not in LAYER_NAMES or layer >= config.num_layers:
        unknown.append(name)
      elif LAYER_NAMES[suffix][0] not in shapes["layers"]:
        raise ValueError(f"{f.path}: tensor {name} is present but config.json does not enable "
                         f"it (model_type={config.model_type}, qkv_bias={config.qkv_bias}, "
                         f"qk_norm={config.qk_norm})")
      else:
        leaf, transpose = LAYER_NAMES[suffix]
        plan.append(Tensor(name, f, ("layers", leaf, layer), transpose))
    elif name in TOP_NAMES:
      leaf, transpose = TOP_NAMES[name]
      if name == "lm_head.weight" and config.tie_embeddings:
        if "model.embed_tokens.weight" in where:
          hf_reader.check_tied_head(where, "model.embed_tokens.weight", name)
          continue  # tied: the stored head is the embedding again
        leaf, transpose = "embed", False  # tied, stored only as lm_head (tinystories656K)
      plan.append(Tensor(name, f, (leaf,), transpose))
    else:
      unknown.append(name)
  hf_reader.check_shapes(plan, shapes)
  if unknown:
    raise ValueError(f"{folder}: {len(unknown)} tensor(s) this {config.model_type} config does "
                     f"not use (more layers than num_hidden_layers={config.num_layers}, or an "
                     f"unsupported architecture): {listing(sorted(unknown))}")
  _check_complete(config, shapes, plan, folder)
  for name in zero_only:
    if np.any(np.asarray(where[name].read(name), np.float32)):
      raise ValueError(f"{where[name].path}: tensor {name} is non-zero, but {config.model_type} "
                       f"models in spec_jax have no bias there")
  params = hf_reader.fill(shapes, plan, hf_reader.np_dtype(config.dtype))
  mtp = {name: where[name].read(name) for name in mtp_names} or None
  return config, params, mtp


def _check_complete(config, shapes, plan, folder) -> None:
  """ValueError naming the HF tensors the plan leaves unfilled."""
  filled = {t.path for t in plan}
  hf_name = {leaf: suffix for suffix, (leaf, _) in LAYER_NAMES.items()}
  top_name = {leaf: name for name, (leaf, _) in TOP_NAMES.items()}
  missing = []
  for leaf in shapes:
    if leaf == "layers":
      for sub in shapes["layers"]:
        missing += [f"model.layers.{i}.{hf_name[sub]}" for i in range(config.num_layers)
                    if ("layers", sub, i) not in filled]
    elif (leaf,) not in filled:
      missing.append(top_name[leaf])
  if missing:
    tied = " (tie_word_embeddings is false, so the LM head must be stored)" \
        if "lm_head.weight" in missing else ""
    raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensor(s){tied}: "
                     f"{listing(missing)}")
