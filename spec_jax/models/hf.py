"""Hugging Face folders: config.json -> ModelConfig, safetensors -> the stacked param layout.

Supported families: llama, mistral, qwen2, qwen3 (see `spec_jax.models.config`). Weights come
from `model.safetensors` or from the shards listed in `model.safetensors.index.json`. Every
tensor is checked against `transformer.expected_shapes(config)` before any data is read.

Names (HF [out, in] Linear weights are transposed into our [in, out]):

  model.embed_tokens.weight                        embed [V, D]
  lm_head.weight                                   lm_head [D, V]  (or embed, when tied and the
                                                                    embedding is not stored)
  model.norm.weight                                final_norm
  model.layers.N.input_layernorm.weight            layers/attn_norm[N]
  model.layers.N.post_attention_layernorm.weight   layers/mlp_norm[N]
  model.layers.N.self_attn.{q,k,v,o}_proj.weight   layers/w{q,k,v,o}[N]
  model.layers.N.self_attn.{q,k,v}_proj.bias       layers/b{q,k,v}[N]   (qkv_bias)
  model.layers.N.self_attn.{q,k}_norm.weight       layers/{q,k}_norm[N] (qk_norm)
  model.layers.N.mlp.{gate,up,down}_proj.weight    layers/w_{gate,up,down}[N]
  mtp.*                                            collected raw into Model.mtp_params
  model.layers.{L+i}.* (i < num_mtp_layers)        DeepSeek-V3-layout MTP modules, likewise raw

num_mtp_layers comes from config `num_nextn_predict_layers` (DeepSeek-V3) or
`mtp_num_hidden_layers` (Qwen3-Next); `spec_jax.drafters.MTP.from_model` converts the raw tensors.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any, Optional

import numpy as np

from spec_jax.models import gemma_hf
from spec_jax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from spec_jax.models.hf_files import (TensorFile as _TensorFile, checkpoint_dtype as _checkpoint_dtype,
                                      generation_eos as _generation_eos, np_dtype as _np_dtype,
                                      tensor_files, token_ids as _token_ids)
from spec_jax.models.transformer import expected_shapes

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# HF per-layer suffix -> (our leaf name, transpose?)
_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
# Biases our layout has no slot for: accepted only when all zero (HF initialises them so).
_ZERO_ONLY = ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias",
              "mlp.down_proj.bias")
_TOP_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "lm_head.weight": ("lm_head", True),
    "model.norm.weight": ("final_norm", False),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


# ----------------------------------------------------------------------------- config

def _get(cfg, name, default=None):
  value = getattr(cfg, name, default)
  return default if value is None else value


def rope_from_hf(cfg) -> tuple:
  """(rope_theta, rope_scaling tuple or None) from a transformers config.

  transformers >= 5 keeps everything in `rope_parameters` (rope_theta, rope_type, factor, ...);
  older versions (and older config objects) use `rope_theta` and `rope_scaling`.
  """
  params = getattr(cfg, "rope_parameters", None)
  if isinstance(params, dict) and params:
    params = dict(params)
    theta = params.pop("rope_theta", None)
    if theta is None:
      theta = _get(cfg, "rope_theta", 10000.0)
    scaling = params
  else:
    theta = _get(cfg, "rope_theta", 10000.0)
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
  items = tuple(sorted((str(k), v) for k, v in scaling.items()
                       if v is not None and not isinstance(v, (dict, list))))
  return float(theta), items


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
    start = int(_get(cfg, "max_window_layers", 0))
    layer_types = ["full_attention" if i < start else "sliding_attention"
                   for i in range(num_layers)]
  kinds = set(layer_types)
  if kinds == {"full_attention"}:
    return None
  if kinds == {"sliding_attention"}:
    return int(window)
  raise ValueError(f"{model_type} config mixes sliding-window and full-attention layers "
                   f"({list(layer_types)}); spec_jax supports one window for every layer")


def config_from_hf(cfg, dtype: str = "float32", source: str = "config.json") -> ModelConfig:
  """A transformers PretrainedConfig (or anything with its attributes) -> ModelConfig.
  Gemma 3 / Gemma 4 configs go to spec_jax.models.gemma_hf.config_from_hf."""
  model_type = getattr(cfg, "model_type", None)
  if gemma_hf.is_gemma_type(model_type):
    return gemma_hf.config_from_hf(cfg, dtype=dtype, source=source)
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  act = _get(cfg, "hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{source}: unsupported hidden_act {act!r}; supported: silu")
  heads = int(cfg.num_attention_heads)
  hidden = int(cfg.hidden_size)
  num_layers = int(cfg.num_hidden_layers)
  theta, scaling = rope_from_hf(cfg)
  if model_type == "qwen2":
    qkv_bias = True
  else:
    qkv_bias = bool(getattr(cfg, "attention_bias", False))
  num_mtp = int(_get(cfg, "num_nextn_predict_layers", 0) or _get(cfg, "mtp_num_hidden_layers", 0))
  eos = _token_ids(getattr(cfg, "eos_token_id", None))
  bos = getattr(cfg, "bos_token_id", None)
  return ModelConfig(
      vocab_size=int(cfg.vocab_size),
      hidden_size=hidden,
      intermediate_size=int(cfg.intermediate_size),
      num_layers=num_layers,
      num_heads=heads,
      num_kv_heads=int(_get(cfg, "num_key_value_heads", heads)),
      head_dim=int(_get(cfg, "head_dim", hidden // heads)),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
      tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
      qkv_bias=qkv_bias,
      qk_norm=model_type == "qwen3",
      sliding_window=_sliding_window(cfg, model_type, num_layers),
      max_position_embeddings=int(_get(cfg, "max_position_embeddings", 2048)),
      model_type=model_type,
      bos_token_id=None if bos is None else int(bos),
      eos_token_ids=eos,
      dtype=dtype,
      num_mtp_layers=num_mtp,
  )


def read_config(folder: pathlib.Path):
  """config.json through transformers.AutoConfig (plus generation_config.json's EOS ids)."""
  import transformers  # heavy: imported only for Hugging Face folders
  path = folder / "config.json"
  try:
    raw = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not a readable JSON config: {e}") from e
  model_type = raw.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"{path}: unsupported model_type {model_type!r}; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)} (gemma3_text, gemma4_text, gemma3, "
                     "gemma4 in Hugging Face folders)")
  try:
    return transformers.AutoConfig.from_pretrained(os.fspath(folder))
  except Exception as e:  # noqa: BLE001 - surface any parse problem at the boundary
    raise ValueError(f"{path}: transformers could not read this config: {e}") from e


def load_hf(folder, dtype: Optional[str] = None) -> tuple:
  """Reads a Hugging Face folder -> (ModelConfig, numpy params, mtp dict or None).
  Gemma 3 / Gemma 4 folders are read by spec_jax.models.gemma_hf.load_gemma."""
  folder = pathlib.Path(folder)
  if gemma_hf.is_gemma_type(gemma_hf.folder_model_type(folder)):
    return gemma_hf.load_gemma(folder, dtype)
  hf_config = read_config(folder)
  config = config_from_hf(hf_config, source=str(folder / "config.json"))
  extra_eos = tuple(t for t in _generation_eos(folder) if t not in config.eos_token_ids)
  if extra_eos:
    config = config.replace(eos_token_ids=config.eos_token_ids + extra_eos)

  paths, weight_map = tensor_files(folder)
  files = {p.name: _TensorFile(p) for p in paths}
  where = {}  # tensor name -> _TensorFile
  for f in files.values():
    for name in f.names:
      where.setdefault(name, f)
  if weight_map is not None:
    for name, shard in weight_map.items():
      if name not in files[shard].meta:
        raise ValueError(f"{folder / 'model.safetensors.index.json'} maps {name} to {shard}, "
                         f"which does not contain it")

  if dtype is None:
    dtype = checkpoint_dtype_of(where)
  return assemble_params(config, where, folder, dtype)


def checkpoint_dtype_of(where: dict) -> str:
  """The checkpoint's dtype, taken from the embedding / LM head (float32 when neither is
  stored in bfloat16)."""
  for name in ("model.embed_tokens.weight", "lm_head.weight"):
    if name in where:
      return _checkpoint_dtype(where[name].meta[name][0])
  return "float32"


def assemble_params(config: ModelConfig, where: dict, folder, dtype: str) -> tuple:
  """Hugging Face tensors -> (config with dtype, numpy params in transformer.py's layout, mtp
  dict or None). `where` maps each tensor name to the file that holds it: anything with `path`,
  `meta[name] = (dtype string, shape)` and `read(name) -> np.ndarray` (a safetensors file, a
  GGUF file's dequantised view). Every shape is checked before any data is read."""
  config = config.replace(dtype=dtype)
  shapes = expected_shapes(config)
  np_dtype = _np_dtype(dtype)

  # Plan every copy (and check every shape) before reading any data.
  plan, mtp_names, zero_only, unknown = [], [], [], []
  for name, f in where.items():
    _, shape = f.meta[name]
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
        continue
      if suffix in _ZERO_ONLY:
        zero_only.append(name)
        continue
      if suffix not in _LAYER_NAMES or layer >= config.num_layers:
        unknown.append(name)
        continue
      leaf, transpose = _LAYER_NAMES[suffix]
      if leaf not in shapes["layers"]:
        raise ValueError(f"{f.path}: tensor {name} is present but config.json does not enable "
                         f"it (model_type={config.model_type}, qkv_bias={config.qkv_bias}, "
                         f"qk_norm={config.qk_norm})")
      want = shapes["layers"][leaf][1:]
      target = ("layers", leaf, layer)
    elif name in _TOP_NAMES:
      leaf, transpose = _TOP_NAMES[name]
      if name == "lm_head.weight" and config.tie_embeddings:
        if "model.embed_tokens.weight" in where:
          continue  # tied: the stored head is the embedding again
        leaf, transpose = "embed", False  # tied, stored only as lm_head (tinystories656K)
      want = shapes[leaf]
      target = (leaf,)
    else:
      unknown.append(name)
      continue
    hf_want = tuple(reversed(want)) if transpose else tuple(want)
    if tuple(shape) != hf_want:
      raise ValueError(f"{f.path}: tensor {name} has shape {tuple(shape)} but config.json "
                       f"implies {hf_want}")
    plan.append((name, f, target, transpose))
  if unknown:
    shown = ", ".join(sorted(unknown)[:8]) + (" ..." if len(unknown) > 8 else "")
    raise ValueError(f"{folder}: {len(unknown)} tensor(s) this {config.model_type} config does "
                     f"not use (more layers than num_hidden_layers={config.num_layers}, or an "
                     f"unsupported architecture): {shown}")

  # Every expected leaf must be filled.
  filled = {t for _, _, t, _ in plan}
  missing = []
  for leaf in shapes:
    if leaf == "layers":
      for sub in shapes["layers"]:
        hf_suffix = next(s for s, (n, _) in _LAYER_NAMES.items() if n == sub)
        missing += [f"model.layers.{i}.{hf_suffix}" for i in range(config.num_layers)
                    if ("layers", sub, i) not in filled]
    elif (leaf,) not in filled:
      missing.append("lm_head.weight" if leaf == "lm_head" else
                     "model.embed_tokens.weight" if leaf == "embed" else "model.norm.weight")
  if missing:
    tied = " (tie_word_embeddings is false, so the LM head must be stored)" \
        if "lm_head.weight" in missing else ""
    shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
    raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensor(s){tied}: {shown}")

  for name in zero_only:
    if np.any(np.asarray(where[name].read(name), np.float32)):
      raise ValueError(f"{where[name].path}: tensor {name} is non-zero, but {config.model_type} "
                       f"models in spec_jax have no bias there")

  params: dict[str, Any] = {"layers": {}}
  for leaf, shape in shapes.items():
    if leaf == "layers":
      for sub, sub_shape in shape.items():
        params["layers"][sub] = np.empty(sub_shape, np_dtype)
    else:
      params[leaf] = np.empty(shape, np_dtype)
  for name, f, target, transpose in plan:
    value = f.read(name)
    if transpose:
      value = value.T
    if target[0] == "layers":
      params["layers"][target[1]][target[2]] = value.astype(np_dtype, copy=False)
    else:
      params[target[0]][...] = value.astype(np_dtype, copy=False)

  mtp = {name: where[name].read(name) for name in mtp_names} or None
  return config, params, mtp
