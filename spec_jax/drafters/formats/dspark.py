"""DeepSpec's published DSpark (and DeepSpec-DFlash) folders: load them, export ours.

The format is what deepseek-ai/DeepSpec's trainer writes (`deepspec/trainer/ckpt_manager.py`:
`save_pretrained` of `Qwen3DSparkModel`, `deepspec/modeling/dspark/qwen3/`; the released
`deepseek-ai/dspark_qwen3_*_block7` and `dflash_qwen3_*_block7` checkpoints):

  config.json   the TARGET's Qwen3 config copied (`build_draft_config`) with architectures
                ["Qwen3DSparkModel"], num_hidden_layers = the drafter's N, num_target_layers,
                block_size, layer_types (all full_attention), mask_token_id, target_layer_ids
                (layer-output ids; -1, the embedding output, is not supported here),
                num_anchors, markov_rank (0: none) and markov_head_type (vanilla | gated |
                rnn), enable_confidence_head and confidence_head_with_markov
  model.safetensors  torch names, Linear weights [out, in]:

    public name                                     ours (spec_jax.drafters.dspark.DSpark)
    the DFlash backbone's (formats/dflash.py)       fc, hidden_norm, norm, layers/...
    embed_tokens.weight, lm_head.weight [V, D]      (copies of the target's: checked, not kept)
    markov_head.markov_w1.weight [V, r]             markov/w1 [V, r]      (an Embedding)
    markov_head.markov_w2.weight [V, r]             markov/w2 [r, V]
    markov_head.gate_proj.weight [r, D + r]         markov/gate_h [D, r], gate_e [r, r] (gated;
                                                    the input [h, w1[x]] split by block)
    markov_head.gate_proj.bias [r]                  markov/gate_b
    markov_head.joint_proj.weight [3r, 2r + D]      markov/joint_s, joint_e [r, 3r], joint_h
                                                    [D, 3r] (rnn; input [s, w1[x], h])
    markov_head.joint_proj.bias [3r]                markov/joint_b
    confidence_head.proj.weight [1, D (+ r)]        confidence/w_h [D] (, w_e [r])
    confidence_head.proj.bias [1]                   confidence/b []
    mask_embedding [D] (spec_jax's learned mask, with mask_token_id null)   mask_embed

A DeepSpec block of b slots drafts b tokens (slot k predicts x_(p+k+1)); markov_rank 0 with no
confidence head is DeepSpec's own DFlash (`config/dflash/*.py`), loaded as a DSpark without
heads. Gemma 4 DeepSpec drafters (Gemma4DSparkModel) are not read here.
"""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters import dflash_layers
from spec_jax.drafters.dspark import MARKOV_HEADS, DSpark
from spec_jax.drafters.formats import dflash as dflash_format
from spec_jax.models import hf_reader
from spec_jax.models.hf_export import layer_config_fields, write_folder

ARCHITECTURES = ("Qwen3DSparkModel",)


def is_dspark_folder(path) -> bool:
  """Whether `path` holds a config.json naming DeepSpec's Qwen3 DSpark architecture."""
  return hf_reader.is_architecture(path, ARCHITECTURES)


def read_config(cfg: dict, target_config, where: str) -> dict:
  """DSpark's constructor arguments from a DeepSpec config.json, checked against the target
  (the backbone's by formats/dflash.read_config). ValueError naming the field that does not
  fit."""
  if not set(cfg.get("architectures") or ()) & set(ARCHITECTURES):
    raise ValueError(f"{where}: architectures {cfg.get('architectures')!r}; a DSpark folder "
                     f"names one of {list(ARCHITECTURES)}")
  ids = cfg.get("target_layer_ids")
  if ids is None:
    raise ValueError(f"{where}: config.json lacks 'target_layer_ids' (DeepSpec writes them)")
  if isinstance(ids, list) and -1 in ids:
    raise ValueError(f"{where}: target_layer_ids {ids} include -1 (the embedding output), "
                     f"which spec_jax's targets do not return; allowed: 0 <= id < "
                     f"{target_config.num_layers}")
  backbone = dict(cfg, architectures=list(dflash_format.ARCHITECTURES),
                  dflash_config={"mask_token_id": cfg.get("mask_token_id"),
                                 "target_layer_ids": ids})
  args = dflash_format.read_config(backbone, target_config, where)
  rank = cfg.get("markov_rank", 0)
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
    raise ValueError(f"{where}: markov_rank={rank!r}; allowed: an integer >= 0")
  head = cfg.get("markov_head_type", "vanilla") if rank else "vanilla"
  if head not in MARKOV_HEADS:
    raise ValueError(f"{where}: markov_head_type={head!r}; allowed: {', '.join(MARKOV_HEADS)}")
  conf = bool(cfg.get("enable_confidence_head", False))
  with_markov = bool(cfg.get("confidence_head_with_markov", False)) if conf else False
  if with_markov and not rank:
    raise ValueError(f"{where}: confidence_head_with_markov=true with markov_rank=0; allowed: "
                     f"a Markov head (markov_rank > 0) or confidence_head_with_markov false")
  return dict(args, markov_rank=rank, markov_head=head, confidence_head=conf,
              confidence_with_markov=with_markov)


# public name -> (our leaf under markov, transpose); a concatenated-input Linear's [out, in]
# weight transposes to [in, out] and splits into our per-block leaves (_BLOCKS).
_MARKOV = {"markov_head.markov_w1.weight": ("w1", False),
           "markov_head.markov_w2.weight": ("w2", True),
           "markov_head.gate_proj.weight": ("gate_w", True),
           "markov_head.gate_proj.bias": ("gate_b", False),
           "markov_head.joint_proj.weight": ("joint_w", True),
           "markov_head.joint_proj.bias": ("joint_b", False)}
_BLOCKS = {"gate_w": ("gate_h", "gate_e"), "joint_w": ("joint_s", "joint_e", "joint_h")}


def _block_sizes(leaf: str, d: int, r: int) -> tuple:
  return {"gate_w": (d, r), "joint_w": (r, r, d)}[leaf]


def _head_shapes(args: dict, d: int, v: int) -> dict:
  """{public name: HF shape} of the heads `args` describe."""
  r, out = args["markov_rank"], {}
  if r:
    leaves = {"w1": (v, r), "w2": (r, v)}
    if args["markov_head"] == "gated":
      leaves.update(gate_w=(d + r, r), gate_b=(r,))
    elif args["markov_head"] == "rnn":
      leaves.update(joint_w=(2 * r + d, 3 * r), joint_b=(3 * r,))
    out.update(hf_reader.hf_shapes(_MARKOV, leaves))
  if args["confidence_head"]:
    n_in = d + (r if args["confidence_with_markov"] else 0)
    out.update({"confidence_head.proj.weight": (1, n_in), "confidence_head.proj.bias": (1,)})
  return out


def _canonical(name: str):
  if hf_reader.IGNORED.search(name):
    return None
  return name[len("model."):] if name.startswith("model.") else name


def load_dspark(path, target, greedy_drafts: bool = False, dtype=None):
  """A DeepSpec Qwen3DSparkModel folder -> a DSpark drafter for `target` (a Model).

  dtype: the weights' dtype (None: the target's); matmuls accumulate in float32, activations
  and the context cache are float32. Raises ValueError naming the field or tensor that does not
  fit (the backbone's checks of formats/dflash.py, a Markov head type or rank the tensors do
  not match, an embedding or LM head copy that is not the target's)."""
  path = pathlib.Path(os.fspath(path)).expanduser().absolute()
  cfg = hf_reader.read_json_config(path)
  args = read_config(cfg, target.config, str(path / "config.json"))
  d, v = args["layer_config"].hidden_size, target.config.vocab_size
  params, mask_id, read = dflash_format.read_backbone(
      path, target, args, "Qwen3DSparkModel", extra=_head_shapes(args, d, v),
      canonical=_canonical)
  if args["markov_rank"]:
    params["markov"] = {}
    r = args["markov_rank"]
    for public, (leaf, transpose) in _MARKOV.items():
      if public in _head_shapes(args, d, v):
        x = read(public)
        x = np.ascontiguousarray(x.T) if transpose else x
        if leaf in _BLOCKS:
          cuts = np.cumsum(_block_sizes(leaf, d, r))[:-1]
          params["markov"].update(zip(_BLOCKS[leaf], np.split(x, cuts, axis=0)))
        else:
          params["markov"][leaf] = x
  if args["confidence_head"]:
    w = read("confidence_head.proj.weight")[0]
    params["confidence"] = {"w_h": w[:d], "b": read("confidence_head.proj.bias").reshape(())}
    if args["confidence_with_markov"]:
      params["confidence"]["w_e"] = w[d:]
  dtype = jnp.dtype(dtype or target.config.dtype)
  params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
  return DSpark(params, target.config, args["layer_config"], args["target_layers"],
                args["block_size"], args["layer_types"], args["sliding_window"], mask_id,
                greedy_drafts, markov_rank=args["markov_rank"], markov_head=args["markov_head"],
                confidence_head=args["confidence_head"],
                confidence_with_markov=args["confidence_with_markov"],
                trained_num_draft=args["block_size"], source=str(path))


# ----------------------------------------------------------------------------- export

def dspark_config(drafter) -> dict:
  """The config.json of `drafter` (a DSpark) as DeepSpec's Qwen3DSparkModel."""
  c, t = drafter.layer_config, drafter.target_config
  cfg = {
      "architectures": list(ARCHITECTURES), "model_type": "qwen3",
      **layer_config_fields(c, t),
      "num_target_layers": t.num_layers, "block_size": drafter.block_size,
      "layer_types": list(drafter.layer_types), "mask_token_id": drafter.mask_token_id,
      "target_layer_ids": list(drafter.target_layers),
      "enable_confidence_head": drafter.confidence_head,
      "markov_rank": drafter.markov_rank, "attention_dropout": 0.0,
      # A training setting Qwen3DSparkModel requires in its config (DeepSpec's default).
      "num_anchors": 512,
  }
  if drafter.sliding_window is not None and dflash_layers.SLIDING in drafter.layer_types:
    cfg.update(sliding_window=drafter.sliding_window, use_sliding_window=True)
  if drafter.markov_rank:
    cfg["markov_head_type"] = drafter.markov_head
  if drafter.confidence_head:
    cfg["confidence_head_with_markov"] = drafter.confidence_with_markov
  return cfg


def dspark_tensors(drafter, target) -> dict:
  """{public name: float32 numpy} of `drafter` (torch's [out, in] Linear layout), with the
  target's embedding and LM head copied in as DeepSpec's folders carry them."""
  out = dflash_format.dflash_tensors(drafter)
  p = jax.device_get(drafter.params)
  arr = lambda x, tr: np.ascontiguousarray(np.asarray(x, np.float32).T if tr else
                                           np.asarray(x, np.float32))
  m = dict(p.get("markov", {}))
  for leaf, blocks in _BLOCKS.items():
    if blocks[0] in m:
      m[leaf] = np.concatenate([np.asarray(m[b], np.float32) for b in blocks], axis=0)
  for public, (leaf, transpose) in _MARKOV.items():
    if leaf in m:
      out[public] = arr(m[leaf], transpose)
  if "confidence" in p:
    c = p["confidence"]
    w = [c["w_h"]] + ([c["w_e"]] if "w_e" in c else [])
    out["confidence_head.proj.weight"] = np.concatenate([arr(x, False) for x in w])[None]
    out["confidence_head.proj.bias"] = arr(c["b"], False).reshape(1)
  tp = jax.device_get(target.params)
  out["embed_tokens.weight"] = arr(tp["embed"], False)
  out["lm_head.weight"] = arr(tp["embed"] if target.config.tie_embeddings else tp["lm_head"],
                              not target.config.tie_embeddings)
  return out


def export(drafter, out_dir, target, overwrite: bool = False) -> pathlib.Path:
  """Writes `drafter` (a DSpark) as a DeepSpec Qwen3DSparkModel folder (config.json +
  model.safetensors, atomically); `sj.drafters.load(out_dir, target)` reads it back."""
  if getattr(drafter, "kind", None) != "dspark":
    raise ValueError(f"export: format 'dspark' writes DSpark drafters; got a "
                     f"{type(drafter).__name__} (kind {getattr(drafter, 'kind', None)!r})")
  if drafter.readout != "next":
    raise ValueError(f"export: DeepSpec's format reads every block slot (readout 'next'); this "
                     f"drafter's readout is {drafter.readout!r} (spec_jax's own: save it with "
                     f"train.distill_heads' heads folder instead)")
  return write_folder(out_dir, dspark_config(drafter), dspark_tensors(drafter, target),
                      overwrite)
