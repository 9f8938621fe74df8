"""Hugging Face folders of any family: config.json -> ModelConfig, safetensors -> params.

    config, params, mtp = load_hf(folder)

config.json's model_type picks the family (spec_jax.models.families); the family turns the
transformers config into ModelConfig fields (`config_from_hf`) and the tensors into its layout
(`read_params`), reading the files through spec_jax.models.hf_reader. Every tensor is checked
against the config before any data is read.
"""

from __future__ import annotations

import pathlib
from typing import Optional

from spec_jax.models import hf_reader
from spec_jax.models.config import ModelConfig
from spec_jax.models.families import HF_MODEL_TYPES, SUPPORTED_MODEL_TYPES, family_for_hf


def _family(model_type, source: str):
  family = family_for_hf(model_type)
  if family is None:
    raise ValueError(f"{source}: unsupported model_type {model_type!r}; supported: "
                     f"{', '.join(SUPPORTED_MODEL_TYPES)} (in Hugging Face folders: "
                     f"{', '.join(HF_MODEL_TYPES)})")
  return family


def config_from_hf(cfg, dtype: str = "float32", source: str = "config.json",
                   **family_options) -> ModelConfig:
  """A transformers PretrainedConfig (or anything with its attributes) -> ModelConfig, by the
  family of its model_type (family_options: that family's config_from_hf keywords)."""
  family = _family(getattr(cfg, "model_type", None), source)
  return ModelConfig(**family.config_from_hf(cfg, source=source, **family_options), dtype=dtype)


def read_config(folder) -> ModelConfig:
  """The ModelConfig of a folder's config.json (plus generation_config.json's EOS ids);
  ValueError for an unreadable config or an unsupported model_type."""
  folder = pathlib.Path(folder)
  source = str(folder / "config.json")
  raw = hf_reader.read_json_config(folder)
  _family(raw.get("model_type"), source)
  config = config_from_hf(hf_reader.auto_config(folder), source=source)
  generation = hf_reader.generation_eos(folder)
  text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
  if generation and "eos_token_id" not in raw and "eos_token_id" not in text:
    # config.json names none: the EOS a transformers config class defaults to (LlamaConfig's
    # 2) is not this checkpoint's, and transformers' generate stops at generation_config's.
    return config.replace(eos_token_ids=tuple(generation))
  extra_eos = tuple(t for t in generation if t not in config.eos_token_ids)
  if extra_eos:
    config = config.replace(eos_token_ids=config.eos_token_ids + extra_eos)
  return config


def load_hf(folder, dtype: Optional[str] = None) -> tuple:
  """Reads a Hugging Face folder -> (ModelConfig, numpy params, mtp dict or None). dtype None
  keeps the checkpoint's."""
  folder = pathlib.Path(folder)
  config = read_config(folder)
  return assemble_params(config, hf_reader.open_tensors(folder), folder, dtype)


def assemble_params(config: ModelConfig, where: dict, folder, dtype: Optional[str]) -> tuple:
  """Tensors -> (config with dtype, numpy params, mtp dict or None) by config's family. `where`
  maps each tensor name to the file that holds it: anything with `path`, `meta[name] = (dtype
  string, shape)` and `read(name) -> np.ndarray` (a safetensors file, a GGUF file's view)."""
  return config.family.read_params(config, where, folder, dtype)
