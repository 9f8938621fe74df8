"""save_hf: a Model -> a Hugging Face folder that `sj.load` and transformers both read.

    save_hf(sj.load("../shared/models/stories260K"), "out/stories260K-hf")
    # out/stories260K-hf/config.json, model.safetensors, generation_config.json, tokenizer files

The inverse of the loader, for the families whose record has `hf_export` (the llama family:
spec_jax.models.llama.export writes config.json and the tensors under their HF names); others
are refused with a ValueError naming the model types that can be written.

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

from spec_jax.models.families import FAMILIES
from spec_jax.models.model import Model
from spec_jax.models.tokenizers import HFTokenizer, Llama2cTokenizer

_SPACE = "\u2581"   # sentencepiece's "▁"


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
    model: a Model (params in its family's canonical layout, float32 or bfloat16).
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
  config, tensors = hf_config_and_tensors(model)
  with atomic_folder(out_dir) as tmp:
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "_from_model_config": True}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tensors, os.fspath(tmp / "model.safetensors"),
              metadata={"format": "pt", **(metadata or {})})
    _write_tokenizer(model.tokenizer, tmp)
  return out_dir


def hf_config_and_tensors(model: Model) -> tuple:
  """(config.json dict, {HF tensor name: numpy array}) of `model`, by its family's hf_export;
  ValueError for a family that has none."""
  family = model.config.family
  if family.hf_export is None:
    allowed = [t for f in FAMILIES.values() if f.hf_export is not None for t in f.model_types]
    raise ValueError(f"save_hf writes {' / '.join(f.name for f in FAMILIES.values() if f.hf_export)}"
                     f"-family folders; a {model.config.model_type} model is not supported "
                     f"(allowed: {', '.join(allowed)})")
  return family.hf_export(model.config, model.params)


# config.json name -> ModelConfig field, of a drafter's layers (layer_config_fields).
_LAYER_FIELDS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                 "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                 "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                 "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta"}
# ... and of its target's.
_TARGET_FIELDS = {"max_position_embeddings": "max_position_embeddings",
                  "vocab_size": "vocab_size", "bos_token_id": "bos_token_id"}


def layer_config_fields(layer_config, target_config) -> dict:
  """The config.json fields a published drafter folder shares with a llama-style decoder:
  its layers' sizes, activation, eps and RoPE (layer_config), the target's vocabulary,
  positions and special tokens; float32 weights, no biases, no tied embeddings."""
  eos = list(target_config.eos_token_ids)
  return {**{k: getattr(layer_config, f) for k, f in _LAYER_FIELDS.items()},
          **{k: getattr(target_config, f) for k, f in _TARGET_FIELDS.items()},
          "hidden_act": "silu", "rope_scaling": layer_config.rope_scaling_dict or None,
          "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
          "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32"}


def write_folder(out_dir, config: dict, tensors: dict, overwrite: bool = False,
                 who: str = "export") -> pathlib.Path:
  """Writes config.json and model.safetensors ({name: numpy array}, torch metadata) into a new
  folder `out_dir`, atomically (atomic_folder). An existing non-empty out_dir is a ValueError
  (naming `who`) unless overwrite. Returns the folder's absolute path."""
  from safetensors.numpy import save_file
  out_dir = pathlib.Path(os.fspath(out_dir)).expanduser().absolute()
  if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
    raise ValueError(f"{who}: {out_dir} already exists and is not empty; pass overwrite=True "
                     f"or choose a new folder")
  with atomic_folder(out_dir) as tmp:
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, os.fspath(tmp / "model.safetensors"), metadata={"format": "pt"})
  return out_dir


@contextlib.contextmanager
def atomic_folder(out_dir: pathlib.Path):
  """Yields a fresh temporary folder beside out_dir; when the block ends without an error it
  replaces out_dir (a reader sees the old folder or the whole new one, never a half-written
  one); the temporary folder is removed either way. A symlink to a folder is followed: the
  folder it names is replaced, and the link keeps naming it (rmtree refuses a link)."""
  if out_dir.is_symlink() and out_dir.resolve().is_dir():
    out_dir = out_dir.resolve()
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
