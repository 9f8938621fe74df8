"""Published DFlash folders: load the block drafters people publish, export ours.

The format is z-lab's `DFlashDraftModel` (z-lab/dflash `dflash/model.py`, trained by SpecForge),
the folder vLLM (`method: "dflash"`), SGLang (`DFLASH`) and tpu-inference load:

  config.json   architectures ["DFlashDraftModel"], model_type "qwen3", block_size,
                dflash_config {mask_token_id, target_layer_ids}, num_target_layers,
                num_hidden_layers N, layer_types, sliding_window, and the Qwen3 sizes
                (hidden_size = the target's, num_attention_heads, num_key_value_heads,
                head_dim, intermediate_size, rms_norm_eps, rope_theta / rope_scaling or
                rope_parameters, vocab_size)
  model.safetensors (or pytorch_model.bin), torch names, Linear weights [out, in]; no
  embedding and no LM head (the target's are used):

    public name                                         ours (spec_jax.drafters.dflash.DFlash)
    fc.weight [D, n D_target]                           fc [n D_target, D]
    hidden_norm.weight [D]                              hidden_norm
    norm.weight [D]                                     norm
    layers.i.input_layernorm.weight [D]                 layers/attn_norm[i]
    layers.i.self_attn.q_proj.weight [Hq Dh, D]         layers/wq[i] [D, Hq Dh]  (k, v: Hkv)
    layers.i.self_attn.o_proj.weight [D, Hq Dh]         layers/wo[i]
    layers.i.self_attn.{q,k}_norm.weight [Dh]           layers/{q,k}_norm[i]
    layers.i.post_attention_layernorm.weight [D]        layers/mlp_norm[i]
    layers.i.mlp.{gate,up,down}_proj.weight             layers/w_{gate,up,down}[i]
    mask_embedding [D] (spec_jax's, see below)          mask_embed

  A "model." prefix is accepted, rotary inv_freq buffers are ignored; an embed_tokens or
  lm_head copy must equal the target's; anything else is refused.

target_layer_ids are layer-output indices (`hidden_states[id + 1]` of transformers, the
output of decoder layer id), our `target_layers` as they are; absent, z-lab's default
(`dflash_shapes.default_target_layers`). The mask slots embed `mask_token_id` with the target's
embedding. A target without a spare id (stories260K) uses a learned mask embedding instead:
ours, stored as the tensor `mask_embedding` with `mask_token_id: null` (vLLM reads a separate
mask embedding only from a `mask_embedding.pt` beside a real mask_token_id; such a file is read
here too and replaces the embedding of mask_token_id).
"""

from __future__ import annotations

import os
import pathlib
import types
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters import dflash_layers, dflash_shapes
from spec_jax.drafters.dflash import DFlash
from spec_jax.models import hf_reader
from spec_jax.models.hf_export import layer_config_fields, write_folder
from spec_jax.models.llama.hf import rope_from_hf

ARCHITECTURES = ("DFlashDraftModel",)
# public suffix (after "layers.i.") -> (our layer leaf, transpose)
_LAYER = hf_reader.layer_names()
_TOP = {"fc.weight": ("fc", True), "hidden_norm.weight": ("hidden_norm", False),
        "norm.weight": ("norm", False), "mask_embedding": ("mask_embed", False)}
_TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")


def is_dflash_folder(path) -> bool:
  """Whether `path` holds a config.json naming the published DFlash architecture."""
  return hf_reader.is_architecture(path, ARCHITECTURES)


# ----------------------------------------------------------------------------- config

def _int(cfg: dict, name: str, where: str, minimum: int = 1, default=None) -> int:
  value = cfg.get(name, default)
  if value is None:
    raise ValueError(f"{where}: config.json lacks {name!r}")
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{where}: {name}={value!r}; allowed: an integer >= {minimum}")
  return value


def read_config(cfg: dict, target_config, where: str) -> dict:
  """The DFlash constructor arguments from a published config.json, checked against the target.

  Raises ValueError naming the field that does not fit."""
  t = target_config
  if not set(cfg.get("architectures") or ()) & set(ARCHITECTURES):
    raise ValueError(f"{where}: architectures {cfg.get('architectures')!r}; a DFlash folder "
                     f"names one of {list(ARCHITECTURES)}")
  dcfg = cfg.get("dflash_config") or {}
  if not isinstance(dcfg, dict):
    raise ValueError(f"{where}: dflash_config must be a JSON object, got {dcfg!r}")
  block = cfg.get("block_size", dcfg.get("block_size"))
  block = _int({"block_size": block}, "block_size", where, minimum=2)
  d = _int(cfg, "hidden_size", where)
  for name in ("hidden_size", "target_hidden_size"):
    if cfg.get(name) is not None and cfg[name] != t.hidden_size:
      raise ValueError(f"{where}: {name}={cfg[name]} but the target's hidden size is "
                       f"{t.hidden_size}; a DFlash drafter reads the target's embedding and LM "
                       f"head, allowed: {name} == {t.hidden_size}")
  if cfg.get("vocab_size") is not None and cfg["vocab_size"] != t.vocab_size:
    raise ValueError(f"{where}: vocab_size={cfg['vocab_size']} but the target's vocabulary has "
                     f"{t.vocab_size} tokens; allowed: vocab_size == {t.vocab_size}")
  if cfg.get("draft_vocab_size") not in (None, t.vocab_size):
    raise ValueError(f"{where}: draft_vocab_size={cfg['draft_vocab_size']}: a reduced draft "
                     f"vocabulary is not supported for DFlash; allowed: absent or {t.vocab_size}")
  n_target = cfg.get("num_target_layers", dcfg.get("num_target_layers"))
  if n_target is not None and n_target != t.num_layers:
    raise ValueError(f"{where}: num_target_layers={n_target} but the target has "
                     f"{t.num_layers} layers; allowed: the layer count of the target the drafter "
                     f"was trained on")
  n = _int(cfg, "num_hidden_layers", where)
  ids = dcfg.get("target_layer_ids")
  if ids is None:
    ids = list(dflash_shapes.default_target_layers(t.num_layers, n))
  if (not isinstance(ids, list) or not ids or
      any(isinstance(i, bool) or not isinstance(i, int) for i in ids)):
    raise ValueError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of "
                     f"integers, got {ids!r}")
  bad = [i for i in ids if not 0 <= i < t.num_layers]
  if bad:
    raise ValueError(f"{where}: dflash_config.target_layer_ids {ids} name layers {bad} outside "
                     f"this {t.num_layers}-layer target; allowed: 0 <= id < {t.num_layers} (id = "
                     f"the output of decoder layer id, hidden_states[id + 1])")
  mask = dcfg.get("mask_token_id")
  if mask is not None and (isinstance(mask, bool) or not isinstance(mask, int) or
                           not 0 <= mask < t.vocab_size):
    raise ValueError(f"{where}: dflash_config.mask_token_id={mask!r} outside the target's "
                     f"vocabulary [0, {t.vocab_size}); allowed: a reserved id of the target's "
                     f"vocabulary (or null with a mask_embedding tensor)")
  types_ = cfg.get("layer_types") or [dflash_layers.FULL] * n
  if not isinstance(types_, list) or len(types_) != n:
    raise ValueError(f"{where}: layer_types must list one entry per layer "
                     f"(num_hidden_layers={n}), got {types_!r}")
  unknown = sorted(set(types_) - set(dflash_layers.LAYER_TYPES))
  if unknown:
    raise ValueError(f"{where}: layer_types {unknown}; allowed: {', '.join(dflash_layers.LAYER_TYPES)}")
  window = cfg.get("sliding_window") if dflash_layers.SLIDING in types_ else None
  if dflash_layers.SLIDING in types_ and (isinstance(window, bool) or not isinstance(window, int) or
                                   window < 1):
    raise ValueError(f"{where}: sliding_window={window!r} with sliding_attention layers; "
                     f"allowed: an integer >= 1")
  if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
    raise ValueError(f"{where}: hidden_act={cfg.get('hidden_act')!r}; allowed: silu")
  for flag in ("attention_bias", "mlp_bias"):
    if cfg.get(flag):
      raise ValueError(f"{where}: {flag}=true is not supported; allowed: false or absent")
  if dcfg.get("causal") is not None or dcfg.get("use_swa"):
    raise ValueError(f"{where}: dflash_config.causal / use_swa are not supported; allowed: "
                     f"per-layer layer_types (full: bidirectional, sliding: causal)")
  heads = _int(cfg, "num_attention_heads", where)
  kv = _int(cfg, "num_key_value_heads", where, default=heads)
  if heads % kv:
    raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of "
                     f"num_key_value_heads={kv}")
  head_dim = _int(cfg, "head_dim", where, default=d // heads)
  theta, scaling = rope_from_hf(types.SimpleNamespace(**cfg))
  layer = dflash_shapes.layer_config(t, n, _int(cfg, "intermediate_size", where), heads, kv, head_dim,
                              float(cfg.get("rms_norm_eps", 1e-6)), theta,
                              None if scaling is None else list(scaling))
  return {"layer_config": layer, "target_layers": tuple(ids), "block_size": block,
          "layer_types": tuple(types_), "sliding_window": window, "mask_token_id": mask}


# ----------------------------------------------------------------------------- load

def _canonical(name: str) -> Optional[str]:
  if hf_reader.IGNORED.search(name):
    return None
  return name[len("model."):] if name.startswith("model.") else name


def load_dflash(path, target, greedy_drafts: bool = False, dtype=None):
  """A published DFlash folder -> a DFlash drafter for `target` (a Model).

  dtype: the weights' dtype ("float32" / "bfloat16"; None: the target's). Matmuls accumulate
  in float32 either way; activations and the context cache are float32. Every shape is checked
  against config.json and the target before a weight is read.

  Raises:
    ValueError: naming the field or tensor that does not fit (a layer id >= the target's
      layers, a wrong width, a missing or unknown tensor, a mask id outside the vocabulary).
  """
  path = pathlib.Path(os.fspath(path)).expanduser().absolute()
  cfg = hf_reader.read_json_config(path)
  args = read_config(cfg, target.config, str(path / "config.json"))
  params, mask_id, _ = read_backbone(path, target, args, "DFlashDraftModel")
  dtype = jnp.dtype(dtype or target.config.dtype)
  params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
  return DFlash(params, target.config, args["layer_config"], args["target_layers"],
                args["block_size"], args["layer_types"], args["sliding_window"], mask_id,
                greedy_drafts, trained_num_draft=args["block_size"] - 1, source=str(path))


def read_backbone(path: pathlib.Path, target, args: dict, architecture: str,
                  extra: Optional[dict] = None, canonical=None):
  """The DFlash backbone's tensors of a folder (DFlashDraftModel, or a format built on it such
  as DeepSpec's Qwen3DSparkModel), every shape checked before a weight is read.

  args: `read_config`'s. extra: {public name: HF shape} of further tensors the format has
  (read by the returned `read`; DSpark's heads); canonical: stored name -> public name.
  Returns (params: numpy leaves in DFlash's layout, the mask id (None when a learned
  mask_embedding replaces it), read(public name) -> float32 numpy)."""
  where = str(path / "config.json")
  lc, n = args["layer_config"], args["layer_config"].num_layers
  d, dt, v = lc.hidden_size, target.config.hidden_size, target.config.vocab_size
  layer = jax.eval_shape(lambda k: dflash_shapes.init_layers(lc, k, 0.02), jax.random.key(0))
  layer = {leaf: x.shape[1:] for leaf, x in layer.items()}          # one of the N layers
  shapes = hf_reader.hf_shapes(_TOP, {"fc": (len(args["target_layers"]) * dt, d),
                                      "hidden_norm": (d,), "norm": (d,)})
  for i in range(n):
    shapes.update(hf_reader.hf_shapes(_LAYER, layer, f"layers.{i}."))
  shapes.update(extra or {})
  optional = {"mask_embedding": (d,), "embed_tokens.weight": (v, dt), "lm_head.weight": (v, dt)}
  found = hf_reader.match_tensors(hf_reader.open_weights(path), shapes, optional,
                                  canonical or _canonical, f"a {n}-layer {architecture}", path)

  def read(public):
    name, fobj = found[public]
    return np.asarray(fobj.read(name), np.float32)

  for public in _TARGET_COPIES:
    if public in found:
      mine = np.asarray(jax.device_get(target.params["embed"]), np.float32)
      if public == "lm_head.weight":
        tp = target.params
        mine = np.asarray(jax.device_get(tp["embed"] if target.config.tie_embeddings
                                         else tp["lm_head"].T), np.float32)
      if not np.allclose(read(public), mine, rtol=1e-2, atol=1e-6):
        raise ValueError(f"{path}: {public} differs from the target's; a {architecture} drafter "
                         f"uses the target's embedding and LM head (allowed: absent, or a copy "
                         f"of them)")
  mask_id, mask_embed = args["mask_token_id"], None
  if "mask_embedding" in found:
    mask_embed = read("mask_embedding")
  elif (path / "mask_embedding.pt").is_file() and mask_id is not None:
    mask_embed = _read_mask_embedding_pt(path / "mask_embedding.pt", d)
  if mask_embed is not None:
    mask_id = None                        # the learned embedding replaces the id's
  elif mask_id is None:
    raise ValueError(f"{where}: mask_token_id is null and there is no mask_embedding tensor; "
                     f"allowed: a reserved id of the target's vocabulary, or a learned "
                     f"mask_embedding")

  def weight(public, transpose):
    x = read(public)
    return np.ascontiguousarray(x.T) if transpose else x

  params = {"layers": {}}
  for public, (leaf, transpose) in _TOP.items():
    if public in found:
      params[leaf] = weight(public, transpose)
  for suffix, (leaf, transpose) in _LAYER.items():
    params["layers"][leaf] = np.stack([weight(f"layers.{i}.{suffix}", transpose)
                                       for i in range(n)])
  if mask_embed is not None:
    params["mask_embed"] = mask_embed
  return params, mask_id, read


def _read_mask_embedding_pt(path: pathlib.Path, d: int) -> np.ndarray:
  """vLLM's override file: a [D] (or [1, D]) tensor saved with torch.save."""
  import torch
  try:
    x = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
  except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
    raise ValueError(f"{path}: not a readable torch tensor: {e}") from e
  x = np.asarray(x.float().numpy(), np.float32).reshape(-1)
  if x.shape != (d,):
    raise ValueError(f"{path}: mask embedding of {x.size} values; allowed: hidden_size {d}")
  return x


# ----------------------------------------------------------------------------- export

def dflash_config(drafter) -> dict:
  """The config.json of `drafter` (a DFlash) as a published DFlashDraftModel."""
  c, t = drafter.layer_config, drafter.target_config
  sliding = drafter.sliding_window is not None and "sliding_attention" in drafter.layer_types
  return {
      "architectures": ["DFlashDraftModel"],
      "model_type": "qwen3",
      **layer_config_fields(c, t),
      "block_size": drafter.block_size,
      "dflash_config": {"mask_token_id": drafter.mask_token_id,
                        "target_layer_ids": list(drafter.target_layers)},
      "num_target_layers": t.num_layers,
      "layer_types": list(drafter.layer_types),
      "sliding_window": drafter.sliding_window if sliding else None,
      "use_sliding_window": bool(sliding),
      "attention_dropout": 0.0,
  }


def dflash_tensors(drafter) -> dict:
  """{public name: float32 numpy array} of `drafter` (torch's [out, in] Linear layout)."""
  p = jax.device_get(drafter.params)

  def arr(x, transpose):
    x = np.asarray(x, np.float32)
    return np.ascontiguousarray(x.T if transpose else x)

  out = {public: arr(p[leaf], transpose) for public, (leaf, transpose) in _TOP.items()
         if leaf in p}
  for suffix, (leaf, transpose) in _LAYER.items():
    for i in range(drafter.layer_config.num_layers):
      out[f"layers.{i}.{suffix}"] = arr(p["layers"][leaf][i], transpose)
  return out


def export(drafter, out_dir, overwrite: bool = False) -> pathlib.Path:
  """Writes `drafter` (a DFlash) as a published DFlash folder (config.json + model.safetensors),
  atomically; `sj.drafters.load(out_dir, target)` reads it back."""
  if getattr(drafter, "kind", None) != "dflash":
    raise ValueError(f"export: format 'dflash' writes DFlash drafters; got a "
                     f"{type(drafter).__name__} (kind {getattr(drafter, 'kind', None)!r})")
  return write_folder(out_dir, dflash_config(drafter), dflash_tensors(drafter), overwrite)
