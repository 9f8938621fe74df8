"""The one Hugging Face reader every family (and every drafter format) reads folders with.

A folder is config.json (+ generation_config.json) and safetensors weights, single
(`model.safetensors`) or sharded (`model.safetensors.index.json` + shards). This module reads
them and knows nothing of any architecture:

  read_json_config(folder)     config.json as a dict (ValueError when unreadable)
  is_architecture(folder, ..)  whether config.json names one of some architectures
  auto_config(folder)          config.json through transformers.AutoConfig
  open_tensors(folder)         {tensor name: TensorFile} over every safetensors file
  open_weights(folder)         the same over safetensors or a pytorch_model.bin (TorchFile)
  match_tensors(...)           stored names -> the names a format expects, every shape, unknown
                               and missing tensor checked before any data is read
  layer_names(...)             the per-layer name map {HF suffix: (our leaf, transpose)},
                               built from the standard decoder layer (DECODER_LAYER)
  hf_shapes(names, shapes)     what a folder stores for our leaves' shapes, by that map
  Tensor, check_shapes, fill   plan a copy of every tensor into a params tree, check every
                               shape before any data is read, then read
  rope_items, get, token_ids, generation_eos, np_dtype, checkpoint_dtype, listing

HF Linear weights are [out, in]; ours are [in, out]: an entry's `transpose` says so.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

# The per-layer tensors of a transformers decoder layer (llama / mistral / qwen / gemma all
# spell these the same): HF suffix after "layers.N." -> (our leaf, transpose [out,in] -> [in,out]).
DECODER_LAYER = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


# Buffers some checkpoints carry that no reader uses (rotary tables are recomputed).
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def layer_names(rename: Optional[dict] = None, add: Optional[dict] = None,
                drop=()) -> dict:
  """A per-layer name map: DECODER_LAYER with some suffixes' leaves renamed ({suffix: leaf}),
  some entries added ({suffix: (leaf, transpose)}) and some suffixes dropped."""
  out = {s: ((rename or {}).get(s, leaf), t) for s, (leaf, t) in DECODER_LAYER.items()
         if s not in drop}
  out.update(add or {})
  return out


def hf_shapes(names: dict, leaf_shapes: dict, prefix: str = "") -> dict:
  """{prefix + HF name: HF shape} of the `names` map's ({HF name: (our leaf, transpose)})
  entries whose leaf `leaf_shapes` ({our leaf: shape}) has: what a folder must store for
  them (a transposed leaf [in, out] is stored [out, in])."""
  return {prefix + name: tuple(reversed(leaf_shapes[leaf])) if transpose
          else tuple(leaf_shapes[leaf])
          for name, (leaf, transpose) in names.items() if leaf in leaf_shapes}


# ----------------------------------------------------------------------------- config

def get(cfg, name: str, default=None):
  """cfg.name, or default when absent or None (transformers configs carry many Nones)."""
  value = getattr(cfg, name, default)
  return default if value is None else value


def token_ids(value) -> tuple:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)


def rope_items(params: dict):
  """A RoPE parameter dict -> sorted (key, value) items of its scalars (hashable), or None."""
  items = tuple(sorted((str(k), v) for k, v in params.items()
                       if v is not None and not isinstance(v, (dict, list))))
  return items or None


def read_json_config(folder) -> dict:
  """config.json of `folder` as a dict; ValueError when missing, unreadable or not an object."""
  path = pathlib.Path(folder) / "config.json"
  try:
    raw = json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not a readable JSON config: {e}") from e
  if not isinstance(raw, dict):
    raise ValueError(f"{path}: a config is a JSON object")
  return raw


def is_architecture(folder, architectures) -> bool:
  """Whether `folder`'s config.json (a readable JSON object) lists one of `architectures`."""
  try:
    cfg = json.loads((pathlib.Path(folder) / "config.json").read_text())
  except (OSError, json.JSONDecodeError):
    return False
  return isinstance(cfg, dict) and bool(set(cfg.get("architectures") or ()) & set(architectures))


def auto_config(folder):
  """config.json through transformers.AutoConfig (ValueError when it cannot parse it)."""
  import transformers  # heavy: imported only for Hugging Face folders
  try:
    return transformers.AutoConfig.from_pretrained(os.fspath(folder))
  except Exception as e:  # noqa: BLE001 - surface any parse problem at the boundary
    raise ValueError(f"{pathlib.Path(folder) / 'config.json'}: transformers could not read "
                     f"this config: {e}") from e


def generation_eos(folder: pathlib.Path) -> tuple:
  """generation_config.json's eos_token_id(s), () when absent or unreadable."""
  path = pathlib.Path(folder) / "generation_config.json"
  if not path.exists():
    return ()
  try:
    return token_ids(json.loads(path.read_text()).get("eos_token_id"))
  except (OSError, json.JSONDecodeError, TypeError, ValueError, AttributeError):
    return ()


# ----------------------------------------------------------------------------- tensors

class TensorFile:
  """One opened safetensors file: names, meta[name] = (dtype string, shape), and reads (bf16
  included). The interface every `where` map's values have (a GGUF file's view too)."""

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
  folder = pathlib.Path(folder)
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


def open_tensors(folder) -> dict:
  """{tensor name: TensorFile} over a folder's safetensors (single or sharded; a name the
  shard index maps to a file that lacks it is a ValueError)."""
  folder = pathlib.Path(folder)
  paths, weight_map = tensor_files(folder)
  files = {p.name: TensorFile(p) for p in paths}
  where = {}
  for f in files.values():
    for name in f.names:
      where.setdefault(name, f)
  for name, shard in (weight_map or {}).items():
    if name not in files[shard].meta:
      raise ValueError(f"{folder / 'model.safetensors.index.json'} maps {name} to {shard}, "
                       f"which does not contain it")
  return where


class TorchFile:
  """pytorch_model.bin through torch.load(weights_only=True), with TensorFile's interface
  (names, meta[name] = (dtype string, shape), read(name) -> numpy; bf16 read as float32)."""

  def __init__(self, path: pathlib.Path):
    import torch  # only for the .bin checkpoints that need it
    try:
      state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
      raise ValueError(f"{path}: not a readable PyTorch state dict: {e}") from e
    if not isinstance(state, dict):
      raise ValueError(f"{path}: expected a state dict of tensors, got {type(state).__name__}")
    self.path = path
    self._tensors = state
    self.names = list(state)
    self.meta = {n: (str(x.dtype), tuple(int(s) for s in x.shape)) for n, x in state.items()}

  def read(self, name: str) -> np.ndarray:
    import torch
    x = self._tensors[name]
    if x.dtype == torch.bfloat16:
      x = x.float()
    return x.numpy()


def open_weights(folder) -> dict:
  """{tensor name: file} over a folder's safetensors (single or sharded, `open_tensors`) or,
  without them, its pytorch_model.bin (TorchFile); ValueError when it has neither."""
  folder = pathlib.Path(folder)
  if (folder / "model.safetensors").is_file() or \
      (folder / "model.safetensors.index.json").is_file():
    return open_tensors(folder)
  if (folder / "pytorch_model.bin").is_file():
    f = TorchFile(folder / "pytorch_model.bin")
    return {name: f for name in f.names}
  raise ValueError(f"{folder}: no model.safetensors, model.safetensors.index.json or "
                   f"pytorch_model.bin beside config.json")


def match_tensors(stored: dict, shapes: dict, optional: dict, canonical: Callable,
                  model: str, folder, hints: Optional[dict] = None) -> dict:
  """Which stored tensor is which expected one, every shape checked before data is read.

  Args:
    stored: {stored name: file} (open_weights).
    shapes: {public name: HF shape} the format needs; optional: the same for tensors it may
      have.
    canonical: stored name -> public name, or None for a tensor to ignore.
    model: what the folder holds, for messages ("a 2-layer DFlashDraftModel").
    folder: for messages. hints: {public name: text} appended to a shape error.
  Returns:
    {public name: (stored name, file)}.
  Raises:
    ValueError: a tensor of another shape, tensors `model` does not have, or a missing one.
  """
  found, unknown = {}, []
  for name, fobj in stored.items():
    public = canonical(name)
    if public is None:
      continue
    want = shapes.get(public, optional.get(public))
    if want is None:
      unknown.append(name)
      continue
    got = tuple(fobj.meta[name][1])
    if got != tuple(want):
      hint = (hints or {}).get(public, "")
      raise ValueError(f"{fobj.path}: tensor {name} has shape {got}; config.json and the target "
                       f"imply {tuple(want)}{hint}")
    if public in found:
      raise ValueError(f"{folder}: tensors {found[public][0]} and {name} are both {public}; "
                       f"keep one (which would be read was undefined)")
    found[public] = (name, fobj)
  if unknown:
    raise ValueError(f"{folder}: {len(unknown)} tensor(s) that {model} does not have: "
                     f"{', '.join(sorted(unknown)[:8])}")
  missing = [n for n in shapes if n not in found]
  if missing:
    raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensor(s): "
                     f"{', '.join(missing[:8])}")
  return found


def check_tied_head(where: dict, embed: str, head: str) -> None:
  """A config that ties the LM head to the embedding while the checkpoint stores both: they
  must be equal, since the loaders read the embedding for both. transformers unties a head
  stored with other values ("we will NOT tie them"), so a different head gave other logits
  there and no error here. ValueError naming both tensors."""
  if head not in where or embed not in where:
    return
  same = np.array_equal(where[embed].read(embed), where[head].read(head))
  if not same:
    raise ValueError(f"{where[head].path}: config.json ties the LM head to the embedding "
                     f"(tie_word_embeddings), but the stored {head} differs from {embed}; set "
                     f"tie_word_embeddings to false to use the stored head")


def np_dtype(dtype: str):
  import ml_dtypes
  return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)


def checkpoint_dtype(meta_dtype: str) -> str:
  """Our dtype name for a stored tensor's dtype string (bf16 stays bf16, all else float32)."""
  return "bfloat16" if meta_dtype == "BF16" else "float32"


def listing(names, most: int = 8) -> str:
  """The first `most` names, comma-separated, with " ..." when there are more."""
  names = list(names)
  return ", ".join(names[:most]) + (" ..." if len(names) > most else "")


# ----------------------------------------------------------------------------- plan and read

class Tensor(NamedTuple):
  """One planned copy: stored tensor `name` of `file` into our params at `path` (keys and list
  indices down the shapes tree; indices past a leaf pick a slice of a stacked [L, ...] leaf),
  transposed when `transpose`."""
  name: str
  file: Any
  path: tuple
  transpose: bool


def leaf_shape(shapes, path: tuple) -> tuple:
  """The shape `path` names in a shapes tree (dicts / lists of shape tuples)."""
  node = shapes
  for i, part in enumerate(path):
    if isinstance(node, tuple):                # a stacked leaf: the rest index its rows
      return tuple(node[len(path) - i:])
    node = node[part]
  return tuple(node)


def check_shapes(plan, shapes, source: str = "config.json") -> None:
  """ValueError naming the first planned tensor whose stored shape is not what `shapes` (and
  the transpose) implies; run before any data is read."""
  for t in plan:
    want = leaf_shape(shapes, t.path)
    hf_want = tuple(reversed(want)) if t.transpose else want
    got = tuple(t.file.meta[t.name][1])
    if got != hf_want:
      raise ValueError(f"{t.file.path}: tensor {t.name} has shape {got} but {source} implies "
                       f"{hf_want}")


def fill(shapes, plan, dtype) -> Any:
  """Reads every planned tensor into a fresh params tree of `shapes` (numpy, `dtype`)."""
  is_shape = lambda x: isinstance(x, tuple) and all(isinstance(s, int) for s in x)

  def empty(node):
    if is_shape(node):
      return np.empty(node, dtype)
    if isinstance(node, dict):
      return {k: empty(v) for k, v in node.items()}
    return [empty(v) for v in node]

  params = empty(shapes)
  for t in plan:
    value = t.file.read(t.name)
    value = (value.T if t.transpose else value).astype(dtype, copy=False)
    node, i = params, 0
    while not isinstance(node, np.ndarray):
      node, i = node[t.path[i]], i + 1
    node[tuple(t.path[i:])] = value
  return params


def param_shapes(init_params, config) -> Any:
  """The shape of every leaf of init_params(config, key) (the same tree), without computing it:
  what a reader checks stored tensors against."""
  import jax
  abstract = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
  return jax.tree.map(lambda s: tuple(s.shape), abstract)
