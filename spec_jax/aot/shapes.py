"""Abstract targets and drafters for ahead-of-time compiles: configs in, ShapeDtypeStructs out.

No weight is read or made: a target comes from a Hugging Face config.json (a file, or a folder
holding one), its params are `jax.eval_shape` of spec_jax's own initialiser in the chosen
dtype, and a drafter is the library's own drafter class built around abstract params of the
shape its loader would produce (so the compiled program is the one a loaded drafter runs).

Drafter specs (the --drafter of python -m spec_jax.aot):
  none                    plain decoding
  draft:CONFIG            a separate draft model (a config.json of the same vocabulary)
  eagle3:CONFIG           a public EAGLE-3 head (LlamaForCausalLMEagle3 config.json)
  eagle3                  an EAGLE-3 head of the target's own shape (32000-token draft vocab)
  dflash:CONFIG           a published DFlash drafter (DFlashDraftModel config.json)
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np

from spec_jax.models.config import ModelConfig
from spec_jax.models.model import Model
from spec_jax.models.transformer import init_params
from spec_jax.models.hf import config_from_hf
from spec_jax.drafters.draft_model import DraftModel
from spec_jax.drafters.eagle import EAGLE3
from spec_jax.drafters.formats import eagle3 as fmt
from spec_jax.drafters.dflash import DFlash
from spec_jax.drafters.formats.dflash import read_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "aot"


def resolve(path: str) -> pathlib.Path:
  """A config path: a file, a folder with config.json, or a name under configs/aot/."""
  p = pathlib.Path(os.fspath(path)).expanduser()
  if p.is_dir():
    p = p / "config.json"
  if not p.exists() and (CONFIGS / f"{path}.json").exists():
    p = CONFIGS / f"{path}.json"
  if not p.is_file():
    known = sorted(x.stem for x in CONFIGS.glob("*.json"))
    raise ValueError(f"{path}: not a config.json, a folder holding one, or one of {known}")
  return p


def read_json(path: str) -> dict:
  p = resolve(path)
  try:
    return json.loads(p.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{p}: not valid JSON: {e}") from e


def target_config(path: str, dtype: str = "bfloat16") -> ModelConfig:
  """The ModelConfig of a Hugging Face config.json (llama / mistral / qwen2 / qwen3 / gemma)."""
  import transformers
  raw = dict(read_json(path))
  model_type = raw.pop("model_type", None)
  raw.pop("architectures", None)
  try:
    cfg = transformers.AutoConfig.for_model(model_type, **raw)
  except Exception as e:  # noqa: BLE001 - any parse problem is the user's config
    raise ValueError(f"{path}: transformers cannot read this config ({e})") from e
  return config_from_hf(cfg, dtype=dtype, source=str(resolve(path)))


def abstract_params(config: ModelConfig):
  """ShapeDtypeStructs of config's canonical params (config.dtype)."""
  return jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))


def abstract_model(config: ModelConfig) -> Model:
  return Model(config=config, params=abstract_params(config))


def _abstract_drafter(make, target: Model):
  """Runs make(Model with traced params) -> drafter under eval_shape; returns the drafter
  with ShapeDtypeStruct params in the target's dtype (what the loaders give: drafters.base's
  in_target_dtype, load_dflash's default dtype)."""
  built = []

  def params_of(tp):
    d = make(Model(config=target.config, params=tp))
    built.append(d)
    return d.params

  abstract = jax.eval_shape(params_of, target.params)
  drafter = built[0].with_params(abstract)
  dtype = target.config.dtype
  if dtype != "float32":
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype)
        if np.issubdtype(x.dtype, np.floating) else x, abstract)
    drafter = drafter.with_params(abstract)
  return drafter


def drafter_from_spec(spec: str, target: Model):
  """A drafter with abstract params for target (module docstring), or None for "none"."""
  kind, _, arg = (spec or "none").partition(":")
  tc = target.config
  if kind == "none":
    return None
  if kind == "draft":
    dcfg = target_config(arg, dtype=tc.dtype)
    if dcfg.vocab_size != tc.vocab_size:
      raise ValueError(f"draft:{arg}: vocabulary {dcfg.vocab_size} != the target's "
                       f"{tc.vocab_size}")
    return DraftModel(abstract_model(dcfg))
  if kind == "eagle3":
    if not arg:
      vd = min(32000, tc.vocab_size)
      return _abstract_drafter(lambda t: EAGLE3.init(t, draft_tokens=np.arange(vd)), target)
    cfg = read_json(arg)
    layer = fmt.layer_config(cfg, tc, str(resolve(arg)))
    layers = fmt.target_layers_from_ids(fmt.layer_ids(cfg, arg), tc.num_layers, arg)
    vd = int(cfg.get("draft_vocab_size") or tc.vocab_size)
    ids = None if vd == tc.vocab_size else np.arange(vd)
    return _abstract_drafter(lambda t: EAGLE3.init(
        t, intermediate_size=layer.intermediate_size, num_heads=layer.num_heads,
        num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, target_layers=layers,
        draft_tokens=ids, rms_norm_eps=layer.rms_norm_eps, rope_theta=layer.rope_theta,
        rope_scaling=layer.rope_scaling), target)
  if kind == "dflash":
    if not arg:
      raise ValueError("dflash needs a config: --drafter dflash:CONFIG")
    a = read_config(read_json(arg), tc, str(resolve(arg)))
    lc = a["layer_config"]
    return _abstract_drafter(lambda t: DFlash.init(
        t, block_size=a["block_size"], num_layers=lc.num_layers,
        target_layers=a["target_layers"], intermediate_size=lc.intermediate_size,
        num_heads=lc.num_heads, num_kv_heads=lc.num_kv_heads, head_dim=lc.head_dim,
        layer_types=a["layer_types"], sliding_window=a["sliding_window"],
        mask_token_id=a["mask_token_id"], rms_norm_eps=lc.rms_norm_eps,
        rope_theta=lc.rope_theta, rope_scaling=lc.rope_scaling), target)
  raise ValueError(f"unknown drafter spec {spec!r}; allowed: none, draft:CONFIG, eagle3, "
                   f"eagle3:CONFIG, dflash:CONFIG")
