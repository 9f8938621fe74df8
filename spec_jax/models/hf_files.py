"""Reading a Hugging Face folder's files: safetensors (single or sharded, bf16 included), the
generation config's EOS ids, dtypes. Shared by the llama-family loader (hf) and Gemma's
(gemma_hf), below both."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np


def token_ids(value) -> tuple:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)


def generation_eos(folder: pathlib.Path) -> tuple:
  path = folder / "generation_config.json"
  if not path.exists():
    return ()
  try:
    return token_ids(json.loads(path.read_text()).get("eos_token_id"))
  except (OSError, json.JSONDecodeError, TypeError, ValueError):
    return ()


class TensorFile:
  """One opened safetensors file: names, dtypes, shapes, and reads (bf16 included)."""

  def __init__(self, path: pathlib.Path):
    from safetensors import safe_open
    self.path = path
    try:
      self._handle = safe_open(os.fspath(path), framework="np")
      self.names = list(self._handle.keys())
      self.meta = {}
      for name in self.names:
        piece = self._handle.get_slice(name)
        self.meta[name] = (piece.get_dtype(), tuple(int(s) for s in piece.get_shape()))
    except Exception as e:  # noqa: BLE001 - SafetensorError is not importable everywhere
      raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e

  def read(self, name: str) -> np.ndarray:
    try:
      return self._handle.get_tensor(name)
    except Exception as e:  # noqa: BLE001
      if self.meta[name][0] == "BF16":
        return self._read_raw(name)
      raise ValueError(f"{self.path}: could not read tensor {name}: {e}") from e

  def _read_raw(self, name: str) -> np.ndarray:
    """bfloat16 without framework support: parse the header and view the bytes."""
    import ml_dtypes
    with open(self.path, "rb") as f:
      header_len = int(np.frombuffer(f.read(8), "<u8")[0])
      header = json.loads(f.read(header_len))
      start, end = header[name]["data_offsets"]
      f.seek(8 + header_len + start)
      data = f.read(end - start)
    return np.frombuffer(data, ml_dtypes.bfloat16).reshape(header[name]["shape"]).copy()


def tensor_files(folder: pathlib.Path) -> tuple:
  """(safetensors paths, weight_map or None) of a folder; the shard index is checked."""
  index = folder / "model.safetensors.index.json"
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index}: not a valid safetensors index (needs a 'weight_map'): {e}") from e
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
      raise ValueError(f"{index} lists shard(s) that are missing from {folder}: "
                       f"{', '.join(missing)}")
    return [folder / f for f in files], weight_map
  single = folder / "model.safetensors"
  if single.is_file():
    return [single], None
  others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
  hint = f" (found {', '.join(others)}: only safetensors weights are supported)" if others else ""
  raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}")


def np_dtype(dtype: str):
  import ml_dtypes
  return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)


def checkpoint_dtype(meta_dtype: str) -> str:
  return "bfloat16" if meta_dtype == "BF16" else "float32"
