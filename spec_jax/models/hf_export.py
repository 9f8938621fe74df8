"""save_hf: a Model -> a Hugging Face folder that `sj.load` and transformers both read.

    save_hf(sj.load("../shared/models/stories260K"), "out/stories260K-hf")
    # out/stories260K-hf/config.json, model.safetensors, generation_config.json, tokenizer files

The inverse of `spec_jax.models.hf`'s loader: the same tensor names (its `_LAYER_NAMES` /
`_TOP_NAMES` table, read backwards), torch's [out, in] Linear layout, the model's dtype. Our q/k
weights are already in the rotate_half RoPE layout transformers uses (llama2.c checkpoints are
permuted into it when loaded), so no permutation is needed. A tied LM head is stored once, as
`model.embed_tokens.weight`.

Tokenizers: a Hugging Face tokenizer is saved with its own `save_pretrained`. A llama2.c
tokenizer is written twice: as `tok{V}.bin` in llama2.c's format (which `sj.load` prefers, so
the folder reloads with exactly the source's tokenizer), and as a `tokenizer.json` for
transformers: a byte-fallback BPE over the same pieces with merges ranked by the merged piece's
score (how sentencepiece's BPE and llama2.c's run.c merge), a "▁" dummy prefix and BOS added.

The folder is written next to its destination and renamed into place, so a reader never sees a
half-written model. An existing non-empty destination is refused unless `overwrite=True`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
from typing import Optional

import numpy as np

from spec_jax.models.config import ModelConfig
from spec_jax.models.hf import _LAYER_NAMES, _TOP_NAMES
from spec_jax.models.model import Model
from spec_jax.models.tokenizers import HFTokenizer, Llama2cTokenizer

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_SPACE = "\u2581"   # sentencepiece's "▁"


# ----------------------------------------------------------------------------- config

def _check_expressible(c: ModelConfig) -> None:
  """transformers' classes fix some flags per family; refuse what they cannot express."""
  if c.is_gemma:
    raise ValueError(f"save_hf writes llama-family folders; a {c.model_type} model is not "
                     "supported (allowed: llama, mistral, qwen2, qwen3)")
  if c.qk_norm != (c.model_type == "qwen3"):
    raise ValueError(f"save_hf: a {c.model_type} model with qk_norm={c.qk_norm} has no "
                     f"transformers class (q/k RMSNorm is exactly qwen3's); allowed: qk_norm "
                     f"only with model_type 'qwen3'")
  if c.model_type == "mistral" and c.qkv_bias:
    raise ValueError("save_hf: transformers' Mistral has no q/k/v biases; allowed: "
                     "qkv_bias=False for model_type 'mistral' (or use 'llama' / 'qwen2')")
  if c.num_mtp_layers:
    raise ValueError("save_hf: writing native MTP modules is not supported; the model has "
                     f"num_mtp_layers={c.num_mtp_layers} (allowed: 0)")


def hf_config(c: ModelConfig) -> dict:
  """ModelConfig -> the config.json dict of its transformers class (what `hf.config_from_hf`
  reads back into the same ModelConfig)."""
  _check_expressible(c)
  scaling = c.rope_scaling_dict
  eos = list(c.eos_token_ids)
  cfg = {
      "architectures": [_ARCHITECTURES[c.model_type]],
      "model_type": c.model_type,
      "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size,
      "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": c.max_position_embeddings,
      "rms_norm_eps": c.rms_norm_eps,
      # Both spellings: transformers >= 5 reads rope_parameters, older versions the other two.
      "rope_theta": c.rope_theta,
      "rope_scaling": scaling or None,
      "rope_parameters": {"rope_type": "default", **scaling, "rope_theta": c.rope_theta},
      "tie_word_embeddings": c.tie_embeddings,
      "bos_token_id": c.bos_token_id,
      "eos_token_id": eos[0] if len(eos) == 1 else eos,
      "torch_dtype": c.dtype,
      "dtype": c.dtype,
  }
  if c.model_type in ("llama", "qwen3"):
    cfg["attention_bias"] = c.qkv_bias
  if c.model_type == "llama":
    cfg["mlp_bias"] = False
  if c.model_type == "mistral":
    cfg["sliding_window"] = c.sliding_window
  if c.model_type in ("qwen2", "qwen3"):
    cfg["use_sliding_window"] = c.sliding_window is not None
    cfg["sliding_window"] = c.sliding_window
    cfg["max_window_layers"] = 0 if c.sliding_window is not None else c.num_layers
  return cfg


# ----------------------------------------------------------------------------- tensors

def hf_tensors(model: Model) -> dict:
  """{torch name: numpy array [out, in]} of every weight, the inverse of `hf.load_hf`."""
  c = model.config
  _check_expressible(c)
  params = model.params
  layers = params["layers"]
  stacked = not isinstance(layers, (list, tuple))
  leaf_names = layers.keys() if stacked else layers[0].keys()
  out = {}
  for name, (leaf, transpose) in _TOP_NAMES.items():
    if leaf == "lm_head" and c.tie_embeddings:
      continue
    value = np.asarray(params[leaf])
    out[name] = np.ascontiguousarray(value.T if transpose else value)
  dtype = np.asarray(params["embed"]).dtype
  by_leaf = {leaf: (suffix, transpose) for suffix, (leaf, transpose) in _LAYER_NAMES.items()}
  for i in range(c.num_layers):
    for leaf in leaf_names:
      suffix, transpose = by_leaf[leaf]
      value = np.asarray(layers[leaf][i] if stacked else layers[i][leaf])
      out[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(value.T if transpose else value)
    if c.qkv_bias and c.model_type in ("llama", "qwen3"):
      # attention_bias also gives transformers' o_proj a bias; ours is zero (hf.py's _ZERO_ONLY).
      out[f"model.layers.{i}.self_attn.o_proj.bias"] = np.zeros((c.hidden_size,), dtype)
    if c.model_type == "qwen2" and not c.qkv_bias:
      # Qwen2 always has q/k/v biases: zeros are the same function (it reloads with qkv_bias).
      for proj, width in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
        out[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = np.zeros((width * c.head_dim,),
                                                                       dtype)
  return out


# ----------------------------------------------------------------------------- tokenizers

def llama2c_tokenizer_json(tokenizer: Llama2cTokenizer) -> dict:
  """A transformers `tokenizer.json` for a llama2.c (sentencepiece BPE) vocabulary.

  Pieces keep their ids (" " spelled "▁", ids 0/1/2 named <unk>/<s>/</s>); merges are every
  split of a piece into two pieces, ranked by the merged piece's score (higher first), as
  run.c merges the highest-scoring adjacent pair."""
  pieces = tokenizer.pieces()
  names = ["<unk>", "<s>", "</s>"] + [p.replace(" ", _SPACE) for p in pieces[3:]]
  vocab = {}
  for i, name in enumerate(names):
    vocab.setdefault(name, i)
  scores = tokenizer.scores()
  merges = []
  for i, name in enumerate(names):
    if i < 3 or name.startswith("<0x") or len(name) < 2:
      continue
    for cut in range(1, len(name)):
      left, right = name[:cut], name[cut:]
      if left in vocab and right in vocab:
        merges.append((-scores[i], i, vocab[left], vocab[right], left, right))
  merges.sort()
  special = [{"id": i, "content": names[i], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i in range(3)]
  return {
      "version": "1.0",
      "truncation": None,
      "padding": None,
      "added_tokens": special,
      "normalizer": {"type": "Sequence", "normalizers": [
          {"type": "Prepend", "prepend": _SPACE},
          {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}]},
      "pre_tokenizer": None,
      "post_processor": {
          "type": "TemplateProcessing",
          "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}}],
          "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"Sequence": {"id": "B", "type_id": 1}}],
          "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
      "decoder": {"type": "Sequence", "decoders": [
          {"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
          {"type": "ByteFallback"},
          {"type": "Fuse"},
          {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
      "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                "continuing_subword_prefix": None, "end_of_word_suffix": None,
                "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                "vocab": vocab, "merges": [[m[4], m[5]] for m in merges]},
  }


def _write_tokenizer(tokenizer, folder: pathlib.Path) -> list:
  """Writes `tokenizer` into `folder`; returns the file names written."""
  if tokenizer is None:
    return []
  if isinstance(tokenizer, HFTokenizer):
    return [pathlib.Path(p).name for p in tokenizer.hf.save_pretrained(os.fspath(folder))]
  if isinstance(tokenizer, Llama2cTokenizer):
    bin_name = f"tok{tokenizer.vocab_size}.bin"
    tokenizer.save(folder / bin_name)
    (folder / "tokenizer.json").write_text(
        json.dumps(llama2c_tokenizer_json(tokenizer), ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}, indent=2))
    return [bin_name, "tokenizer.json", "tokenizer_config.json"]
  raise ValueError(f"save_hf: cannot write a tokenizer of type {type(tokenizer).__name__}; "
                   f"allowed: HFTokenizer, Llama2cTokenizer or None")


# ----------------------------------------------------------------------------- save

def save_hf(model: Model, out_dir, overwrite: bool = False,
            metadata: Optional[dict] = None) -> pathlib.Path:
  """Writes `model` as a Hugging Face folder (atomically) and returns its path.

  Args:
    model: a Model (params in transformer.py's canonical layout, float32 or bfloat16).
    out_dir: the folder to create.
    overwrite: replace an existing non-empty `out_dir` (else ValueError).
    metadata: optional str -> str entries for the safetensors header.

  Files: config.json, generation_config.json, model.safetensors, and the tokenizer's files.
  """
  from safetensors.numpy import save_file
  if model.mtp_params:
    raise ValueError("save_hf: writing native MTP modules is not supported (the model carries "
                     "mtp_params)")
  out_dir = pathlib.Path(os.fspath(out_dir)).expanduser().absolute()
  if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
    raise ValueError(f"save_hf: {out_dir} already exists and is not empty; pass overwrite=True "
                     f"(CLI: --overwrite) or choose a new folder")
  config = hf_config(model.config)
  tensors = hf_tensors(model)
  with atomic_folder(out_dir) as tmp:
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "_from_model_config": True}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tensors, os.fspath(tmp / "model.safetensors"),
              metadata={"format": "pt", **(metadata or {})})
    _write_tokenizer(model.tokenizer, tmp)
  return out_dir


@contextlib.contextmanager
def atomic_folder(out_dir: pathlib.Path):
  """Yields a fresh temporary folder beside out_dir; when the block ends without an error it
  replaces out_dir (a reader sees the old folder or the whole new one, never a half-written
  one); the temporary folder is removed either way."""
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
  if tmp.exists():
    shutil.rmtree(tmp)
  tmp.mkdir()
  try:
    yield tmp
    old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
    if out_dir.is_dir():
      os.replace(out_dir, old)     # a directory cannot be renamed over a non-empty one
    elif out_dir.exists():
      out_dir.unlink()
    os.replace(tmp, out_dir)
    if old.exists():
      shutil.rmtree(old)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
