"""GGUF files (llama.cpp's format): the model config from the metadata, the tensors dequantised
into the Hugging Face layout, the tokenizer and chat template from the metadata.

    model = sj.load("SmolLM2-135M-Instruct.Q4_1.gguf", dtype="bfloat16")

Read with ggml-org's own reader (the `gguf` package). What is supported:

  architectures   llama (also Mistral-style llama files), qwen2, qwen3
  tensor types    F32, F16, BF16, Q8_0, Q4_0, Q4_1 (dequantised to float32 exactly as ggml
                  does: Q8_0 d*q; Q4_0 d*(q-8); Q4_1 d*q+m, d and m float16 per 32 weights)

Anything else (another architecture, a K-quant, a `rope_freqs` table) is refused with a
ValueError naming what the file holds and what is supported.

llama.cpp's converter permutes the rows of a llama model's q and k projections so that RoPE
rotates interleaved pairs (its kernels' layout); they are permuted back into Hugging Face's
rotate-half layout exactly as transformers' GGUF loader does (`reverse_permute`). qwen2 / qwen3
files are written unpermuted.

The first load writes the dequantised model as a Hugging Face folder (float32 safetensors, the
tokenizer with its chat template) under $XDG_CACHE_HOME/spec_jax/gguf (~/.cache by default;
SPEC_JAX_GGUF_CACHE overrides, "off" disables): later loads of the same file (same path, size
and modification time) read that folder, which is much faster than dequantising and rebuilding
the tokenizer. `python -m spec_jax.tools.convert x.gguf out/` writes the same folder anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import types
from typing import Optional

import numpy as np

from spec_jax.models import hf
from spec_jax.models.gguf_reader import GGUFFile, GGUFFormatError
from spec_jax.models.hf_export import save_hf
from spec_jax.models.model import Model
from spec_jax.models.tokenizers import HFTokenizer

FORMAT_VERSION = 3          # bump when the cached folder's content would change
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
_PERMUTED_ARCHITECTURES = ("llama",)   # llama.cpp permutes q/k rows for these

# GGUF tensor name -> Hugging Face name (per-layer names carry the layer index).
_TOP = {"token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight",
          "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight",
          "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q.bias": "self_attn.q_proj.bias",
          "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.bias": "self_attn.v_proj.bias",
          "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight",
          "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def is_gguf(path) -> bool:
  """A file whose name ends in .gguf or whose first four bytes are the GGUF magic."""
  path = pathlib.Path(path)
  if not path.is_file():
    return False
  if path.suffix.lower() == ".gguf":
    return True
  try:
    with open(path, "rb") as f:
      return f.read(4) == b"GGUF"
  except OSError:
    return False


# ----------------------------------------------------------------------------- reading

def open_reader(path: pathlib.Path):
  """The file's metadata and tensor table (gguf_reader.GGUFFile); ValueError for a file that is
  not a readable GGUF (bad magic, truncated, corrupt)."""
  import importlib.util
  if importlib.util.find_spec("gguf") is None:   # a runtime dependency: guards broken installs
    raise ValueError(f"{path}: reading GGUF files needs the `gguf` package (pip install gguf)")
  try:
    return GGUFFile(path)
  except GGUFFormatError as e:
    raise ValueError(f"{path}: not a readable GGUF file: {e}") from e


def metadata(reader) -> dict:
  """Every metadata key -> its Python value (arrays of strings / numbers as lists; the
  tokenizer's token / merge arrays are left out, as their lengths)."""
  out = {}
  for name, field in reader.fields.items():
    if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores"):
      out[name] = field.count
      continue
    try:
      out[name] = field.contents()
    except Exception:  # noqa: BLE001 - a field the reader cannot decode is not ours to use
      out[name] = None
  return out


def _get(meta: dict, key: str, path, default=...):
  value = meta.get(key)
  if value is None:
    if default is ...:
      raise ValueError(f"{path}: GGUF metadata lacks {key!r}")
    return default
  if isinstance(value, list):
    raise ValueError(f"{path}: GGUF metadata {key!r} is a per-layer list {value[:4]}...; "
                     f"spec_jax supports one value for every layer")
  return value


def hf_config_dict(meta: dict, tensor_names, path) -> dict:
  """The Hugging Face config.json dict a GGUF file's metadata describes (llama, qwen2, qwen3)."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)} (convert other models to a Hugging "
                     f"Face folder with transformers first)")
  if "rope_freqs.weight" in tensor_names:
    raise ValueError(f"{path}: this file carries a rope_freqs table (llama3-style RoPE "
                     f"scaling stored per frequency), which spec_jax does not read from GGUF; "
                     f"load the model's Hugging Face folder instead")
  k = lambda name, default=...: _get(meta, f"{arch}.{name}", path, default)
  heads = int(k("attention.head_count"))
  hidden = int(k("embedding_length"))
  if heads < 1:
    raise ValueError(f"{path}: {arch}.attention.head_count is {heads}; it must be >= 1")
  if int(k("context_length", 2048)) < 1:
    raise ValueError(f"{path}: {arch}.context_length is {k('context_length')}; it must be >= 1")
  vocab = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens")
  if not vocab:
    raise ValueError(f"{path}: GGUF metadata gives no vocabulary size ({arch}.vocab_size or "
                     f"tokenizer.ggml.tokens)")
  theta = float(k("rope.freq_base", 10000.0))
  eps = float(k("attention.layer_norm_rms_epsilon"))
  for name, value in (("rope.freq_base", theta), ("attention.layer_norm_rms_epsilon", eps)):
    if not value > 0:
      raise ValueError(f"{path}: {arch}.{name} is {value}; it must be > 0")
  # llama.cpp's reading: the factor from rope.scaling.factor, else the older v2 key
  # rope.scale_linear (SuperHOT-style long-context fine-tunes); no type with a factor means linear.
  factor = k("rope.scaling.factor", None)
  factor = float(k("rope.scale_linear", 1.0) if factor is None else factor)
  scaling_type = k("rope.scaling.type", "linear" if factor != 1.0 else "none")
  rope_parameters = {"rope_type": "default", "rope_theta": theta}
  if scaling_type == "linear" and factor != 1.0:
    rope_parameters = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
  elif scaling_type not in ("none", "linear", None):
    raise ValueError(f"{path}: RoPE scaling {scaling_type!r} is not supported; supported: "
                     f"none, linear")
  eos = meta.get("tokenizer.ggml.eos_token_id")
  cfg = {
      "model_type": SUPPORTED_ARCHITECTURES[arch],
      "vocab_size": int(vocab),
      "hidden_size": hidden,
      "intermediate_size": int(k("feed_forward_length")),
      "num_hidden_layers": int(k("block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": int(k("attention.head_count_kv", heads)),
      "head_dim": int(k("attention.key_length", hidden // heads)),
      "hidden_act": "silu",
      "rms_norm_eps": eps,
      "rope_theta": theta,
      "rope_parameters": rope_parameters,
      "max_position_embeddings": int(k("context_length", 2048)),
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": None if eos is None else int(eos),
  }
  if cfg["model_type"] in ("qwen2", "qwen3"):
    cfg["use_sliding_window"] = False
  if cfg["model_type"] in ("llama", "qwen3"):
    cfg["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_names)
  return cfg


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation (its convert_hf_to_gguf `permute`): rows
  [head, pair, 2] -> [head, 2, pair], i.e. interleaved RoPE pairs back to rotate-half halves.
  weights [n_head * head_dim, ...]."""
  dim = weights.shape[0] // n_head // 2
  w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
  return w.swapaxes(2, 1).reshape(weights.shape)


class GGUFTensors:
  """A GGUF file's tensors under their Hugging Face names, dequantised to float32 on read (the
  `where` view `hf.assemble_params` reads: path, names, meta[name] = (dtype, shape), read)."""

  def __init__(self, path: pathlib.Path, reader, config: dict):
    self.path = path
    self._tensors = {}
    self._permute = {}
    self.meta = {}
    permuted = config["model_type"] in _PERMUTED_ARCHITECTURES
    unknown, bad_types = [], {}
    for t in reader.tensors:
      kind = t.tensor_type.name
      if kind not in SUPPORTED_TYPES:
        bad_types.setdefault(kind, t.name)
      name = _hf_name(t.name)
      if name is None:
        unknown.append(t.name)
        continue
      shape = tuple(int(s) for s in reversed([int(x) for x in t.shape]))
      self._tensors[name] = t
      self.meta[name] = (kind, shape)
      # llama.cpp's converter permutes q and k's rows, their biases too (LlamaModel.
      # modify_tensors: a llama file with attn_q.bias, e.g. a "llamafied" Qwen).
      if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        self._permute[name] = config["num_attention_heads"]
      elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        self._permute[name] = config["num_key_value_heads"]
    if bad_types:
      shown = ", ".join(f"{k} (e.g. {v})" for k, v in bad_types.items())
      raise ValueError(f"{path}: unsupported GGUF tensor type(s) {shown}; supported: "
                       f"{', '.join(SUPPORTED_TYPES)}")
    if unknown:
      shown = ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else "")
      raise ValueError(f"{path}: {len(unknown)} GGUF tensor(s) a {config['model_type']} model "
                       f"does not have: {shown}")
    self.names = list(self._tensors)

  def read(self, name: str) -> np.ndarray:
    import gguf
    t = self._tensors[name]
    try:
      value = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    except Exception as e:  # noqa: BLE001
      raise ValueError(f"{self.path}: could not dequantise tensor {t.name} "
                       f"({t.tensor_type.name}): {e}") from e
    value = np.asarray(value, np.float32).reshape(self.meta[name][1])
    if name in self._permute:
      value = reverse_permute(value, self._permute[name])
    return value


def _hf_name(gguf_name: str) -> Optional[str]:
  if gguf_name in _TOP:
    return _TOP[gguf_name]
  m = _BLOCK_RE.match(gguf_name)
  if m and m.group(2) in _LAYER:
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
  return None


def tokenizer_fields(reader) -> tuple:
  """(architecture, tokenizer_dict, tokenizer_config) of the file's tokenizer, the three things
  transformers' `get_gguf_tokenizer` returns, read with ggml-org's reader: transformers' own GGUF
  reader imports torch, which `pip install spec_jax` does not bring."""
  from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING
  fields = reader.fields

  def value(key):
    field = fields.get(key)
    return None if field is None else field.contents()

  architecture = value("general.architecture")
  grouped = {group: {name: value(f"tokenizer.{key}") for key, name in renames.items()
                     if f"tokenizer.{key}" in fields}
             for group, renames in GGUF_TOKENIZER_MAPPING.items()}
  tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
  if tokenizer.get("tokenizer_type") == "llama":     # as transformers: llama.cpp adds BOS there
    config.setdefault("add_bos_token", True)
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    token_id = value(f"tokenizer.ggml.{key}")
    config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
  return architecture, tokenizer, config


# llama.cpp's pre-tokenizer types that split off every numeral before GPT-2's regex
# (`llama-vocab.cpp`: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA share
# regex_exprs {"\\p{N}", GPT-2's}; the original tokenizer.json of SmolLM2 and StarCoder has
# Sequence[Digits(individual_digits), ByteLevel]). transformers' GGUF conversion (5.x) knows
# none of them and keeps GPT-2's regex alone, which splits whitespace before a numeral
# differently: "x =  5" became x | Ġ= | Ġ | Ġ | 5 instead of x | Ġ= | ĠĠ | 5, "\n\n1." Ċ | Ċ | 1 | .
# instead of ĊĊ | 1 | . (SmolLM2-135M scores its old split of "x =  5\ny =  7" 17 nats less
# likely: -42.6 against -25.5, transformers' torch model of the same file).
DIGIT_SPLIT_PRE_TOKENIZERS = ("starcoder", "refact", "command-r", "smollm", "codeshell",
                              "exaone", "minerva")


def _set_digit_split(backend, pre_type: Optional[str]) -> None:
  """For a DIGIT_SPLIT_PRE_TOKENIZERS file: numerals split off, then GPT-2's byte-level regex."""
  if pre_type not in DIGIT_SPLIT_PRE_TOKENIZERS:
    return
  from tokenizers import Regex, pre_tokenizers
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def read_tokenizer(path: pathlib.Path, eos_ids=(), reader=None):
  """The file's tokenizer (vocabulary, merges, special tokens, chat template) as an
  HFTokenizer, built by transformers' GGUF tokenizer conversion from the metadata
  (`tokenizer_fields`); no torch needed. With a transformers that lacks that module (before
  5.x), its `AutoTokenizer.from_pretrained(gguf_file=...)` (which needs torch)."""
  import transformers     # a runtime dependency; imported here, as the GGUF path is optional
  reader = reader or open_reader(path)
  try:
    try:
      from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
      tok = transformers.AutoTokenizer.from_pretrained(os.fspath(path.parent),
                                                       gguf_file=path.name)
    else:
      architecture, fields, config = tokenizer_fields(reader)
      backend, extra = convert_gguf_tokenizer(architecture, fields)
      tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    pre = reader.fields.get("tokenizer.ggml.pre")
    _set_digit_split(tok.backend_tokenizer, None if pre is None else pre.contents())
  except Exception as e:  # noqa: BLE001 - report any tokenizer problem at the boundary
    raise ValueError(f"{path}: transformers could not build the tokenizer from the GGUF "
                     f"metadata: {e}") from e
  return HFTokenizer(tok, eos_ids)


def read_gguf(path, dtype: Optional[str] = None, tokenizer: bool = True) -> tuple:
  """A GGUF file -> (ModelConfig, numpy params in the llama family's layout, tokenizer or None).
  dtype None keeps float32 (the dequantised values); "bfloat16" rounds them."""
  path = pathlib.Path(path)
  reader = open_reader(path)
  meta = metadata(reader)
  names = [t.name for t in reader.tensors]
  cfg = hf_config_dict(meta, names, path)
  config = hf.config_from_hf(types.SimpleNamespace(**cfg), source=str(path))
  where_file = GGUFTensors(path, reader, cfg)
  where = {name: where_file for name in where_file.names}
  config, params, _ = hf.assemble_params(config, where, path, dtype or "float32")
  tok = read_tokenizer(path, config.eos_token_ids, reader) if tokenizer and meta.get(
      "tokenizer.ggml.tokens") else None
  return config, params, tok


# ----------------------------------------------------------------------------- the cache

def cache_root() -> Optional[pathlib.Path]:
  """Where dequantised GGUF models are kept (None: caching is off)."""
  override = os.environ.get("SPEC_JAX_GGUF_CACHE")
  if override is not None:
    return None if override.strip().lower() in ("", "0", "off", "none") else \
        pathlib.Path(override).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "spec_jax" / "gguf"


def cache_key(path: pathlib.Path) -> str:
  """The file's identity: its resolved path, size and modification time (a rewritten file gets
  a new entry), and this module's FORMAT_VERSION."""
  st = path.stat()
  ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT_VERSION}"
  return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def cached_folder(path) -> Optional[pathlib.Path]:
  """The cache folder of a GGUF file (written or not), None when caching is off."""
  root = cache_root()
  return None if root is None else root / cache_key(pathlib.Path(path))


def prune_stale(path, keep) -> list:
  """Removes the cache folders that earlier versions of the GGUF file at `path` left beside
  `keep` (its current entry), and returns them. Each entry records the file it came from
  (gguf_source.json), and the key holds the file's size and modification time. A
  re-downloaded, rewritten or restored file therefore gets a new entry, and without pruning
  every version would keep its dequantised float32 copy (~540 MB for SmolLM2-135M). Folders
  without a record, or with another file's, are left alone."""
  keep = pathlib.Path(keep)
  source, prefix = str(pathlib.Path(path).resolve()), f"{pathlib.Path(path).stem}-"
  removed = []
  for other in keep.parent.iterdir():
    if other == keep or not other.name.startswith(prefix) or not other.is_dir():
      continue
    try:
      record = json.loads((other / "gguf_source.json").read_text())
    except (OSError, ValueError):
      continue
    if isinstance(record, dict) and record.get("file") == source:
      shutil.rmtree(other, ignore_errors=True)
      removed.append(other)
  return removed


def write_folder(path, out_dir, overwrite: bool = False) -> pathlib.Path:
  """Dequantises a GGUF file into a Hugging Face folder (float32 safetensors, config.json,
  generation_config.json, the tokenizer with its chat template) written atomically."""
  path = pathlib.Path(path)
  config, params, tok = read_gguf(path)
  model = Model(config=config, params=params, tokenizer=tok, source=str(path))
  out = save_hf(model, out_dir, overwrite=overwrite,
                metadata={"spec_jax_gguf_source": path.name})
  (out / "gguf_source.json").write_text(json.dumps(
      {"file": str(path.resolve()), "bytes": path.stat().st_size,
       "format_version": FORMAT_VERSION}, indent=1) + "\n")
  return out
