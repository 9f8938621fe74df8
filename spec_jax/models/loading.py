"""sj.load: one entry point for Hugging Face folders, GGUF files and llama2.c `.bin` checkpoints.

    model = sj.load("../shared/models/stories260K")        # llama2.c folder (.bin + tok*.bin)
    model = sj.load("../shared/models/tinystories656K")    # HF folder (config.json + safetensors)
    model = sj.load("path/to/model.bin", dtype="bfloat16")
    model = sj.load("../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")

A GGUF file (spec_jax.models.gguf_file) is dequantised once into a cached Hugging Face folder,
which later loads read; a folder holding exactly one .gguf file (and no config.json) loads it.

A Hugging Face folder's tokenizer is a llama2.c `tok*.bin` in it when there is one (what
`spec_jax.models.hf_export.save_hf` writes for llama2.c models), else its transformers tokenizer.
"""

from __future__ import annotations

import os
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models import gguf_file, hf, llama2c
from spec_jax.models.model import Model
from spec_jax.models.tokenizers import HFTokenizer, Llama2cTokenizer, find_llama2c_tokenizer

DTYPES = ("float32", "bfloat16")


def _llama2c_weights(folder: pathlib.Path) -> list:
  return sorted(p for p in folder.glob("*.bin") if p.is_file() and not p.name.startswith("tok"))


def _hf_folder_tokenizer(folder: pathlib.Path, config):
  """A llama2.c tokenizer beside the safetensors with the model's vocabulary size (save_hf
  writes one for llama2.c models; a tokenizer.json next to it is only transformers' rendering
  of it), else the folder's transformers tokenizer (or None)."""
  tok_path = find_llama2c_tokenizer(folder, config.vocab_size)
  if tok_path is not None:
    try:
      tokenizer = Llama2cTokenizer.from_file(tok_path)
    except ValueError:
      tokenizer = None    # a tok*.bin that is not a llama2.c tokenizer: not ours to read
    if tokenizer is not None and tokenizer.vocab_size == config.vocab_size:
      return tokenizer
  return HFTokenizer.from_folder(folder, eos_ids=config.eos_token_ids)


def _to_device(params, dtype: str):
  target = jnp.dtype(dtype)
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(target, copy=False)), params)


def _load_hf_folder(folder: pathlib.Path, dtype, source: str) -> Model:
  config, params, mtp = hf.load_hf(folder, dtype)
  tokenizer = _hf_folder_tokenizer(folder, config)
  return Model(config=config, params=_to_device(params, config.dtype), tokenizer=tokenizer,
               mtp_params=mtp, source=source)


def _load_gguf(path: pathlib.Path, dtype) -> Model:
  """A GGUF file through its cached Hugging Face folder (written on the first load), or read
  directly when caching is off."""
  folder = gguf_file.cached_folder(path)
  if folder is None:
    config, params, tokenizer = gguf_file.read_gguf(path, dtype)
    return Model(config=config, params=_to_device(params, config.dtype), tokenizer=tokenizer,
                 source=str(path))
  if not (folder / "model.safetensors").is_file():
    gguf_file.write_folder(path, folder, overwrite=True)
    gguf_file.prune_stale(path, folder)          # the entries of the file's earlier versions
  return _load_hf_folder(folder, dtype, source=str(path))


def load(path, dtype: Optional[str] = None) -> Model:
  """Loads a checkpoint into a Model(config, params, tokenizer, mtp_params, source).

  Args:
    path: a Hugging Face folder (config.json + model.safetensors or a sharded index), a GGUF
      file (or a folder holding exactly one), a llama2.c folder (exactly one model `.bin`
      beside its `tok*.bin`), or a llama2.c `.bin`.
    dtype: None keeps the checkpoint's dtype; "float32" or "bfloat16" converts the params and
      sets config.dtype.

  Raises:
    ValueError: a missing path, an unrecognised layout, an unsupported architecture, or a
      corrupt, truncated or inconsistent checkpoint (the message names the file).
  """
  if dtype is not None:
    dtype = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dtype not in DTYPES:
      raise ValueError(f"dtype must be None or one of {DTYPES}, got {dtype!r}")
  path = pathlib.Path(os.fspath(path)).expanduser()
  if not path.exists():
    raise ValueError(f"no such file or directory: {path}")

  if path.is_dir() and (path / "config.json").is_file():
    return _load_hf_folder(path, dtype, source=str(path))
  if path.is_dir():
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
      path = ggufs[0]
    elif len(ggufs) > 1:
      raise ValueError(f"{path}: holds {len(ggufs)} .gguf files "
                       f"({', '.join(p.name for p in ggufs)}); pass the one to load")
  if gguf_file.is_gguf(path):
    return _load_gguf(path, dtype)

  if path.is_dir():
    weights = _llama2c_weights(path)
    if len(weights) != 1:
      found = ", ".join(p.name for p in weights) or "none"
      raise ValueError(f"{path}: expected a Hugging Face folder (config.json + safetensors), a "
                       f"GGUF file, or a llama2.c folder with exactly one model .bin (besides tok*.bin); "
                       f"found model .bin files: {found}")
    bin_path = weights[0]
  elif path.suffix == ".bin":
    bin_path = path
  else:
    raise ValueError(f"{path}: expected a Hugging Face folder (with config.json), a .gguf "
                     f"file, a llama2.c folder, or a llama2.c .bin file")

  config, params = llama2c.read_llama2c(bin_path)
  if dtype is not None:
    config = config.replace(dtype=dtype)
  tok_path = find_llama2c_tokenizer(bin_path.parent, config.vocab_size)
  tokenizer = Llama2cTokenizer.from_file(tok_path) if tok_path is not None else None
  if tokenizer is not None and tokenizer.vocab_size != config.vocab_size:
    raise ValueError(f"{tok_path}: tokenizer has {tokenizer.vocab_size} pieces but {bin_path} "
                     f"has vocab_size {config.vocab_size}")
  return Model(config=config, params=_to_device(params, config.dtype), tokenizer=tokenizer,
               mtp_params=None, source=str(path))
