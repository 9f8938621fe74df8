"""Public EAGLE-3 folders: load the heads people publish, export ours.

The format is what SpecForge and the EAGLE authors write and what vLLM
(`vllm/model_executor/models/llama_eagle3.py`) and SGLang
(`python/sglang/srt/models/llama_eagle3.py`) load:

  config.json   architectures ["LlamaForCausalLMEagle3"], llama fields (hidden_size,
                num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
                rms_norm_eps, rope_theta / rope_scaling, num_hidden_layers 1), vocab_size,
                draft_vocab_size, optionally target_hidden_size and
                eagle_config.eagle_aux_hidden_state_layer_ids
  model.safetensors (or pytorch_model.bin), torch names, Linear weights [out, in]:

    public name                                   ours (spec_jax.drafters.eagle.EAGLE3)
    fc.weight [D, 3 D_target]                     fc [3 D_target, D]
    midlayer.input_layernorm.weight [D]           embed_norm
    midlayer.hidden_norm.weight [D]               hidden_norm
    midlayer.self_attn.q_proj.weight [Hq Dh, 2D]  layer/wq [2D, Hq Dh]   (k_proj, v_proj: Hkv)
    midlayer.self_attn.o_proj.weight [D, Hq Dh]   layer/wo
    midlayer.post_attention_layernorm.weight      layer/mlp_norm
    midlayer.mlp.{gate,up,down}_proj.weight       layer/w_{gate,up,down}
    norm.weight [D]                               norm
    lm_head.weight [V_draft, D]                   lm_head [D, V_draft]
    d2t int [V_draft]                             draft_tokens = arange(V_draft) + d2t
    t2d bool [V]                                  (checked: True exactly at draft_tokens)
    embed_tokens.weight [V, D] (optional)         embed, only when it differs from the target's

  A "model." prefix (SGLang's module names) and vLLM's "layers.0." for "midlayer." are
  accepted; rotary inv_freq buffers are ignored; anything else is refused.

Captured target layers: the two engines spell explicit ids in two places, one apart.
  - vLLM (`get_eagle3_aux_layers_from_config`) reads a top-level
    `eagle_aux_hidden_state_layer_ids` as boundary ids: id k is the residual stream entering
    layer k (its capture loop appends before layer k runs), our output index k-1.
  - SGLang (`ModelRunner` reads `eagle_config["eagle_aux_hidden_state_layer_ids"]`;
    `set_eagle3_layers_to_capture` captures `[val + 1 for val in layer_ids]`, "for the ith
    layer, it takes the output of the (i-1)th layer") reads the nested ids as output indices.
Both present, they must name the same layers. Absent, the default is vLLM / SGLang's
(2, L//2, L-3) boundaries. `export` writes no ids when the head uses the default, and both
spellings otherwise, so each engine captures the layers the head was trained on.
"""

from __future__ import annotations

import os
import pathlib
import types
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.drafters.base import in_target_dtype
from spec_jax.drafters.eagle import (EAGLE3, check_draft_tokens, midlayer_params,
                                     public_default_layers)
from spec_jax.drafters.feature_head import head_layer_config
from spec_jax.models import hf_reader
from spec_jax.models.hf_export import layer_config_fields, write_folder
from spec_jax.models.llama.hf import rope_from_hf

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FORMATS = ("eagle3",)

# public suffix (after "midlayer.") -> (our layer leaf, transpose)
_MID = hf_reader.layer_names(rename={"input_layernorm.weight": "embed_norm"},
                             add={"hidden_norm.weight": ("hidden_norm", False)},
                             drop=("self_attn.q_norm.weight", "self_attn.k_norm.weight"))
_TOP_LEVEL_LEAVES = ("embed_norm", "hidden_norm")     # midlayer norms kept outside params/layer
_TOP = {"fc.weight": ("fc", True), "norm.weight": ("norm", False),
        "lm_head.weight": ("lm_head", True)}


# ----------------------------------------------------------------------------- config

def is_eagle3_folder(path) -> bool:
  """Whether `path` holds a config.json naming a public EAGLE-3 architecture."""
  return hf_reader.is_architecture(path, ARCHITECTURES)


def layer_ids(cfg: dict, where: str = "config.json") -> Optional[list]:
  """The captured layers as boundary ids (id k = the residual stream entering layer k), or None.

  A top-level `eagle_aux_hidden_state_layer_ids` is vLLM's (boundary ids, taken as they are);
  `eagle_config.eagle_aux_hidden_state_layer_ids` is SGLang's (output indices: SGLang adds 1).
  ValueError if both are present and name different layers, or an id is not an integer."""
  top = cfg.get("eagle_aux_hidden_state_layer_ids") or None
  eagle_cfg = cfg.get("eagle_config")
  nested = (eagle_cfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_cfg, dict)
            else None) or None
  if nested is not None:
    if (not isinstance(nested, (list, tuple))
        or any(isinstance(i, bool) or not isinstance(i, int) for i in nested)):
      raise ValueError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list "
                       f"of integers, got {nested!r}")
    from_nested = [i + 1 for i in nested]            # SGLang's val + 1
    if top is not None and list(top) != from_nested:
      raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(top)} (vLLM: the input "
                       f"of layer id) and eagle_config.eagle_aux_hidden_state_layer_ids "
                       f"{list(nested)} (SGLang: the output of layer id) name different layers; "
                       f"allowed: top-level ids = nested ids + 1")
    if top is None:
      return from_nested
  return list(top) if top is not None else None


def target_layers_from_ids(ids, num_layers: int, where: str) -> tuple:
  """Boundary ids (input of layer id; None = the public default) -> our output indices."""
  if ids is None:
    ids = sorted({2, num_layers // 2, num_layers - 3})
    if len(ids) != 3 or ids[0] < 1:
      raise ValueError(f"{where}: no eagle_aux_hidden_state_layer_ids, and the public default "
                       f"(2, L//2, L-3) is not three distinct layers for this {num_layers}-layer "
                       f"target (vLLM and SGLang capture each layer once); allowed: a target "
                       f"with >= 7 layers, or explicit ids in eagle_config")
  if len(ids) != 3 or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
    raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be three integers, got "
                     f"{ids!r}")
  if len(set(ids)) != 3:
    raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {ids} repeat a layer; vLLM and "
                     f"SGLang capture each layer once, so fc would see fewer than three")
  bad = [i for i in ids if not 1 <= i <= num_layers]
  if bad:
    raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {ids} name boundaries {bad} "
                     f"outside this {num_layers}-layer target; allowed: 1 <= id <= {num_layers} "
                     f"(id k = the residual stream entering layer k; {num_layers} = the last "
                     f"layer's output)")
  return tuple(i - 1 for i in sorted(ids))       # captured in layer order


def _num(cfg: dict, name: str, where: str, kind=int, default=None):
  """A positive number field of config.json (null or absent: `default`; no default: required);
  ValueError naming the file and the field otherwise (a null or a string made int() raise a
  TypeError, or a ValueError without the file)."""
  value = cfg.get(name)
  if value is None:
    if default is None:
      raise ValueError(f"{where}: config.json lacks {name!r}")
    return default
  integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
      kind is int and not integral):
    raise ValueError(f"{where}: {name}={value!r}; allowed: a positive "
                     f"{'integer' if kind is int else 'number'}")
  return kind(value)


def layer_config(cfg: dict, target_config, where: str):
  """The head's layer ModelConfig from a public config.json, checked against the target."""
  t = target_config
  d = _num(cfg, "hidden_size", where)
  dt = _num(cfg, "target_hidden_size", where, default=d)
  if dt != t.hidden_size:
    raise ValueError(f"{where}: target_hidden_size={dt} but the target's hidden size is "
                     f"{t.hidden_size}; allowed: the hidden size of the target the head was "
                     f"trained on")
  if d != t.hidden_size:
    raise ValueError(f"{where}: hidden_size={d} but the target's hidden size is {t.hidden_size}; "
                     f"spec_jax feeds the head the target's embedding, allowed: hidden_size == "
                     f"{t.hidden_size}")
  v = _num(cfg, "vocab_size", where)
  if v != t.vocab_size:
    raise ValueError(f"{where}: vocab_size={v} but the target's vocabulary has {t.vocab_size} "
                     f"tokens; allowed: vocab_size == {t.vocab_size}")
  if _num(cfg, "num_hidden_layers", where, default=1) != 1:
    raise ValueError(f"{where}: num_hidden_layers={cfg.get('num_hidden_layers')}; spec_jax runs "
                     f"one-layer EAGLE-3 heads (allowed: 1)")
  act = cfg.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{where}: hidden_act={act!r}; allowed: silu")
  for flag in ("attention_bias", "mlp_bias", "bias", "norm_before_residual", "norm_before_fc"):
    if cfg.get(flag):
      raise ValueError(f"{where}: {flag}=true is not supported; allowed: false or absent")
  eagle_cfg = cfg.get("eagle_config") or {}
  if isinstance(eagle_cfg, dict) and eagle_cfg.get("use_aux_hidden_state") is False:
    raise ValueError(f"{where}: eagle_config.use_aux_hidden_state=false (an EAGLE-1-style head "
                     f"without fc) is not supported; allowed: true or absent")
  heads = _num(cfg, "num_attention_heads", where)
  kv = _num(cfg, "num_key_value_heads", where, default=heads)
  head_dim = _num(cfg, "head_dim", where, default=d // heads)
  if heads % kv:
    raise ValueError(f"{where}: num_attention_heads={heads} is not a multiple of "
                     f"num_key_value_heads={kv}")
  theta, scaling = rope_from_hf(types.SimpleNamespace(**cfg))
  layer = head_layer_config(t, _num(cfg, "intermediate_size", where), heads, kv)
  return layer.replace(num_kv_heads=kv, head_dim=head_dim,
                       rms_norm_eps=_num(cfg, "rms_norm_eps", where, float, 1e-6),
                       rope_theta=theta,
                       rope_scaling=scaling)


# ----------------------------------------------------------------------------- tensors

def _canonical(name: str) -> Optional[str]:
  """A stored tensor name -> the public name of the table above (None: ignored)."""
  if hf_reader.IGNORED.search(name):
    return None
  if name.startswith("model."):
    name = name[len("model."):]
  if name.startswith("layers.0."):
    name = "midlayer." + name[len("layers.0."):]
  return name


def load_eagle3(path, target, greedy_drafts: bool = False):
  """A public EAGLE-3 folder -> an EAGLE3 drafter for `target` (a Model).

  Every shape is checked against config.json and the target before any weight is read; d2t must
  map into the target's vocabulary one-to-one, t2d (when present) must agree with it.

  Raises:
    ValueError: naming the field or tensor that does not fit (hidden size, vocabulary, d2t
      range, a missing or unknown tensor, a wrong shape, an unsupported config flag).
  """
  path = pathlib.Path(os.fspath(path)).expanduser().absolute()
  where_cfg = str(path / "config.json")
  cfg = hf_reader.read_json_config(path)
  if not set(cfg.get("architectures") or ()) & set(ARCHITECTURES):
    raise ValueError(f"{where_cfg}: architectures {cfg.get('architectures')!r}; an EAGLE-3 "
                     f"folder names one of {list(ARCHITECTURES)}")
  tc = target.config
  depth = _num(cfg, "num_target_layers", where_cfg, default=tc.num_layers)
  if depth != tc.num_layers:
    raise ValueError(f"{where_cfg}: num_target_layers={depth} but the target has "
                     f"{tc.num_layers} layers; the head reads the layers it was trained on")
  layer_cfg = layer_config(cfg, tc, where_cfg)
  layers = target_layers_from_ids(layer_ids(cfg, where_cfg), tc.num_layers, where_cfg)
  d, dt, v = layer_cfg.hidden_size, tc.hidden_size, tc.vocab_size
  vd = _num(cfg, "draft_vocab_size", where_cfg, default=v)
  if not 1 <= vd <= v:
    raise ValueError(f"{where_cfg}: draft_vocab_size={vd}; allowed: 1 <= draft_vocab_size <= "
                     f"vocab_size {v}")
  mid = jax.eval_shape(lambda k: midlayer_params(layer_cfg, k, k), jax.random.key(0))
  mid = {leaf: x.shape for leaf, x in mid.items()}
  mid.update(embed_norm=(d,), hidden_norm=(d,))
  shapes = {**hf_reader.hf_shapes(_TOP, {"fc": (3 * dt, d), "norm": (d,), "lm_head": (d, vd)}),
            **hf_reader.hf_shapes(_MID, mid, "midlayer.")}
  optional = {"embed_tokens.weight": (v, d), "d2t": (vd,), "t2d": (v,)}
  if vd < v:                       # a reduced draft vocabulary needs its map
    shapes["d2t"] = optional.pop("d2t")
  found = hf_reader.match_tensors(
      hf_reader.open_weights(path), shapes, optional, _canonical,
      "a one-layer LlamaForCausalLMEagle3", path,
      hints={"lm_head.weight": " (draft_vocab_size rows)", "d2t": " (draft_vocab_size rows)"})

  def read(public):
    name, fobj = found[public]
    return np.asarray(fobj.read(name))

  draft_tokens = None
  if "d2t" in found:
    d2t = read("d2t")
    if not np.issubdtype(d2t.dtype, np.integer):
      raise ValueError(f"{path}: d2t has dtype {d2t.dtype}; allowed: integer offsets "
                       f"(target id = draft id + d2t[draft id])")
    draft_tokens = check_draft_tokens(np.arange(vd) + d2t.astype(np.int64), v, what="d2t")
  if "t2d" in found:
    t2d = read("t2d").astype(bool)
    ids = np.arange(v) if draft_tokens is None else draft_tokens
    if int(t2d.sum()) != vd or not t2d[ids].all():
      raise ValueError(f"{path}: t2d disagrees with d2t: t2d marks {int(t2d.sum())} target ids, "
                       f"d2t maps {vd} draft ids; allowed: t2d True exactly at the d2t targets")

  def weight(public):
    x = read(public).astype(np.float32)
    return x.T if x.ndim == 2 and public not in ("embed_tokens.weight",) else x

  params = {"fc": weight("fc.weight"), "norm": weight("norm.weight"),
            "lm_head": weight("lm_head.weight"), "layer": {}}
  for suffix, (leaf, transpose) in _MID.items():
    x = read("midlayer." + suffix).astype(np.float32)
    x = x.T if transpose else x
    if leaf in _TOP_LEVEL_LEAVES:
      params[leaf] = x
    else:
      params["layer"][leaf] = x
  if "embed_tokens.weight" in found:
    own = read("embed_tokens.weight").astype(np.float32)
    theirs = np.asarray(jax.device_get(target.params["embed"]), np.float32)
    # A bf16 copy of the target's table passes (bf16 rounds by at most 2^-9 relative); a table
    # 0.5 % away was dropped at rtol 1e-2.
    if not np.allclose(own, theirs, rtol=2**-8, atol=1e-6):
      params["embed"] = own
  params = jax.tree.map(jnp.asarray, params)
  drafter = EAGLE3(params, tc, layer_cfg, layers, greedy_drafts, draft_tokens, source=str(path))
  # Weights in the target's dtype (bf16 beside a bf16 target: half the bytes a draft step
  # reads, the kernel in bf16), as trained heads load.
  return in_target_dtype(drafter, target)


# ----------------------------------------------------------------------------- export

def eagle3_config(drafter) -> dict:
  """The config.json of `drafter` (an EAGLE3) as a public LlamaForCausalLMEagle3."""
  c, t = drafter.layer_config, drafter.target_config
  layers = tuple(drafter.target_layers)
  if list(layers) != sorted(set(layers)):
    raise ValueError(f"export: target_layers {list(layers)} must be strictly increasing: vLLM "
                     f"and SGLang capture each layer once, in layer order")
  cfg = {
      "architectures": ["LlamaForCausalLMEagle3"],
      "model_type": "llama",
      **layer_config_fields(c, t),
      "target_hidden_size": t.hidden_size,
      "num_hidden_layers": 1,
      "draft_vocab_size": drafter.draft_vocab_size,
      "mlp_bias": False,
      "pretraining_tp": 1,
      # Not a public field (vLLM and SGLang ignore it): the target's depth, checked on load,
      # since the default captured layers (2, L//2, L-3) move with L and nothing public says L.
      "num_target_layers": t.num_layers,
  }
  if layers != public_default_layers(t.num_layers):
    # Both engines' spellings (module docstring): vLLM's boundary ids at the top level,
    # SGLang's output indices under eagle_config.
    cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in layers]
    cfg["eagle_config"] = {"use_aux_hidden_state": True,
                           "eagle_aux_hidden_state_layer_ids": list(layers)}
  return cfg


def eagle3_tensors(drafter) -> dict:
  """{public name: numpy array} of `drafter` (torch's [out, in] Linear layout, float32)."""
  p = jax.device_get(drafter.params)
  t = drafter.target_config

  def out_in(x):
    return np.ascontiguousarray(np.asarray(x, np.float32).T)

  out = {"fc.weight": out_in(p["fc"]), "norm.weight": np.asarray(p["norm"], np.float32),
         "lm_head.weight": out_in(p["lm_head"])}
  for suffix, (leaf, transpose) in _MID.items():
    x = p[leaf] if leaf in _TOP_LEVEL_LEAVES else p["layer"][leaf]
    out["midlayer." + suffix] = out_in(x) if transpose else np.asarray(x, np.float32)
  ids = np.arange(t.vocab_size) if drafter.draft_tokens is None else drafter.draft_tokens
  out["d2t"] = (ids.astype(np.int64) - np.arange(len(ids), dtype=np.int64))
  t2d = np.zeros((t.vocab_size,), bool)
  t2d[ids] = True
  out["t2d"] = t2d
  if "embed" in p:
    out["embed_tokens.weight"] = np.asarray(p["embed"], np.float32)
  return out


def export(drafter, out_dir, format: str = "eagle3", overwrite: bool = False) -> pathlib.Path:
  """Writes `drafter` (EAGLE3 heads) as a public EAGLE-3 folder that vLLM and SGLang load.

  Args:
    drafter: an `EAGLE3` (e.g. `sj.drafters.load(out_dir, target)` after train.distill_heads).
    out_dir: the folder to create: config.json + model.safetensors, written next to it and
      renamed into place (a reader never sees a half-written folder).
    format: "eagle3" (the only one).
    overwrite: replace an existing non-empty `out_dir` (else ValueError).

  Returns the folder's path; `sj.drafters.load(out_dir, target)` reads it back.
  """
  if format not in FORMATS:
    raise ValueError(f"export: unknown format {format!r}; allowed: {', '.join(FORMATS)}")
  if getattr(drafter, "kind", None) != "eagle3":
    raise ValueError(f"export: format 'eagle3' writes EAGLE-3 heads; got a "
                     f"{type(drafter).__name__} (kind {getattr(drafter, 'kind', None)!r})")
  return write_folder(out_dir, eagle3_config(drafter), eagle3_tensors(drafter), overwrite)
