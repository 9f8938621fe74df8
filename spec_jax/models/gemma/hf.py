"""The Gemma family's Hugging Face reading: config.json fields and tensors -> forward.py's layout.

Read: config.json of model_type gemma3_text / gemma4_text (CausalLM checkpoints) or gemma3 /
gemma4 (the multimodal ConditionalGeneration checkpoints the hub ships: the text config is used,
the vision and audio towers are skipped). Tensor names, below `model.` (CausalLM),
`model.language_model.` or `language_model.model.` (ConditionalGeneration, new and legacy);
HF [out, in] Linear weights are transposed into our [in, out]:

  embed_tokens.weight                          embed           norm.weight   final_norm
  layers.N.input_layernorm / post_attention_layernorm / pre_feedforward_layernorm /
    post_feedforward_layernorm .weight         attn_norm / post_attn_norm / mlp_norm / post_mlp_norm
  layers.N.self_attn.{q,k,v,o}_proj.weight     wq, wk, wv, wo  self_attn.{q,k}_norm.weight  q/k_norm
  layers.N.mlp.{gate,up,down}_proj.weight      w_gate, w_up, w_down
  layers.N.per_layer_input_gate / per_layer_projection .weight    ple_gate, ple_proj
  layers.N.post_per_layer_input_norm.weight    ple_norm        layers.N.layer_scalar  layer_scalar
  embed_tokens_per_layer.weight                embed_per_layer
  per_layer_model_projection.weight            per_layer_proj  per_layer_projection_norm.weight
  lm_head.weight (or language_model.lm_head.weight)   lm_head, unless tied

KV-shared layers' k/v projections and norms (some hub checkpoints store them; transformers
ignores them too) are skipped. Unsupported variants raise ValueError before any weight is read:
the MoE block (`enable_moe_block`, Gemma 4 26B-A4B), bidirectional attention, attention biases,
an unknown layer type or RoPE type.
"""

from __future__ import annotations

import re
from typing import Optional

from spec_jax.models import hf_reader
from spec_jax.models.gemma.forward import init_params
from spec_jax.models.gemma.plan import LAYER_TYPES, layout
from spec_jax.models.hf_reader import Tensor, get, listing

HF_MODEL_TYPES = {"gemma3": "gemma3", "gemma3_text": "gemma3", "gemma4": "gemma4",
                  "gemma4_text": "gemma4"}
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
_SKIPPED_TOWERS = re.compile(r"^(model\.)?(vision_tower|audio_tower|embed_vision|embed_audio|"
                             r"multi_modal_projector)\.")
LAYER_NAMES = hf_reader.layer_names(
    rename={"post_attention_layernorm.weight": "post_attn_norm"},
    add={"pre_feedforward_layernorm.weight": ("mlp_norm", False),        # the sandwich norms
         "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
         "per_layer_input_gate.weight": ("ple_gate", True), "layer_scalar": ("layer_scalar", False),
         "per_layer_projection.weight": ("ple_proj", True),                # per-layer embeddings
         "post_per_layer_input_norm.weight": ("ple_norm", False)})
_KV_ONLY = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight",
            "self_attn.v_norm.weight")
_TOP_NAMES = {"embed_tokens.weight": ("embed", False), "norm.weight": ("final_norm", False),
              # per-layer embeddings (PLE)
              "embed_tokens_per_layer.weight": ("embed_per_layer", False),
              "per_layer_model_projection.weight": ("per_layer_proj", True),
              "per_layer_projection_norm.weight": ("per_layer_proj_norm", False)}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")


def text_config(cfg):
  """The text decoder's config of a Gemma config object (itself for *_text configs)."""
  if getattr(cfg, "model_type", None) in ("gemma3", "gemma4"):
    return cfg.get_text_config()
  return cfg


def _kv_by_type(t, family: str, source: str) -> tuple:
  """((layer_type, num_kv_heads, head_dim), ...) from the per-layer overrides (Gemma 4)."""
  if family == "gemma3":
    return tuple((kind, int(t.num_key_value_heads), int(t.head_dim))
                 for kind in sorted(set(t.layer_types)))
  shapes = {}
  for i, kind in enumerate(t.layer_types):
    lc = t.per_layer_config[i]
    shape = (int(get(lc, "num_key_value_heads", t.num_attention_heads)),
             int(get(lc, "head_dim", t.hidden_size // t.num_attention_heads)))
    if shapes.setdefault(kind, shape) != shape:
      raise ValueError(f"{source}: {kind} layers differ in KV shape ({shapes[kind]} vs {shape} "
                       f"at layer {i}); spec_jax supports one (num_kv_heads, head_dim) per "
                       "layer type")
  return tuple((kind, h, d) for kind, (h, d) in sorted(shapes.items()))


def _rope_by_type(t, source: str) -> tuple:
  params = getattr(t, "rope_parameters", None) or {}
  out = []
  for kind in sorted(set(t.layer_types)):
    p = dict(params.get(kind) or {})
    if "rope_theta" not in p:
      raise ValueError(f"{source}: rope_parameters has no rope_theta for {kind} layers")
    theta = p.pop("rope_theta")
    out.append((kind, float(theta), hf_reader.rope_items(p)))
  return tuple(out)


def config_fields(cfg, source: str = "config.json",
                  tie_embeddings: Optional[bool] = None) -> dict:
  """A transformers Gemma 3 / Gemma 4 config (text or multimodal) -> ModelConfig fields.
  ValueError (one line) for what spec_jax does not run."""
  top = cfg
  t = text_config(cfg)
  family = HF_MODEL_TYPES.get(getattr(t, "model_type", None))
  if family is None:
    raise ValueError(f"{source}: not a Gemma 3 / Gemma 4 config (model_type "
                     f"{getattr(cfg, 'model_type', None)!r})")
  if getattr(t, "enable_moe_block", False):
    raise ValueError(f"{source}: enable_moe_block is true (the Gemma 4 MoE models, e.g. "
                     "26B-A4B): spec_jax supports the dense and E2B/E4B Gemma 4 models only")
  # Gemma 4: None, "vision" (31B, 26B-A4B: only image-token blocks attend both ways; text
  # stays causal, transformers' is_causal = value != "all") or "all"; Gemma 3: a bool.
  if getattr(t, "use_bidirectional_attention", None) not in (None, False, "vision"):
    raise ValueError(f"{source}: use_bidirectional_attention="
                     f"{t.use_bidirectional_attention!r}: spec_jax decodes causal models only "
                     f"(allowed: null or \"vision\", which leaves text causal)")
  if getattr(t, "attention_bias", False):
    raise ValueError(f"{source}: attention_bias is true; Gemma models in spec_jax have no "
                     "attention biases")
  act = get(t, "hidden_activation", get(t, "hidden_act", "gelu_pytorch_tanh"))
  if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
    raise ValueError(f"{source}: unsupported hidden_activation {act!r}; supported: "
                     "gelu_pytorch_tanh")
  layer_types = tuple(str(x) for x in t.layer_types)
  unknown = sorted(set(layer_types) - set(LAYER_TYPES))
  if unknown:
    raise ValueError(f"{source}: unsupported layer type(s) {unknown}; supported: "
                     f"{', '.join(LAYER_TYPES)}")
  kv = _kv_by_type(t, family, source)
  first = dict((k, (h, d)) for k, h, d in kv)[layer_types[0]]
  gemma4 = family == "gemma4"
  if tie_embeddings is None:
    tie_embeddings = bool(get(top, "tie_word_embeddings", get(t, "tie_word_embeddings", True)))
  bos = getattr(t, "bos_token_id", None)
  return dict(
      vocab_size=int(t.vocab_size), hidden_size=int(t.hidden_size),
      intermediate_size=int(t.intermediate_size), num_layers=int(t.num_hidden_layers),
      num_heads=int(t.num_attention_heads), num_kv_heads=first[0], head_dim=first[1],
      rms_norm_eps=float(get(t, "rms_norm_eps", 1e-6)), tie_embeddings=tie_embeddings,
      sliding_window=int(t.sliding_window) if "sliding_attention" in layer_types else None,
      max_position_embeddings=int(get(t, "max_position_embeddings", 8192)), model_type=family,
      bos_token_id=None if bos is None else int(bos),
      eos_token_ids=hf_reader.token_ids(getattr(t, "eos_token_id", None)),
      hidden_act="gelu_tanh", embed_scale=True, norm_plus_one=not gemma4,
      attention_scale=1.0 if gemma4 else float(get(t, "query_pre_attn_scalar", 256)) ** -0.5,
      final_logit_softcap=_softcap(top, t),
      layer_types=layer_types, rope_by_type=_rope_by_type(t, source), kv_by_type=kv,
      v_norm=gemma4, k_eq_v=bool(gemma4 and getattr(t, "attention_k_eq_v", False)),
      layer_scalar=gemma4, num_kv_shared_layers=int(get(t, "num_kv_shared_layers", 0)),
      double_wide_mlp=bool(gemma4 and getattr(t, "use_double_wide_mlp", False)),
      per_layer_input_size=int(get(t, "hidden_size_per_layer_input", 0)) if gemma4 else 0,
      per_layer_vocab_size=(int(get(t, "vocab_size_per_layer_input", 0)) if gemma4 and
                            get(t, "hidden_size_per_layer_input", 0) else 0))


def _softcap(top, t) -> Optional[float]:
  """The final logit soft-cap. transformers' Gemma3ForConditionalGeneration (model_type
  "gemma3") never applies its text config's final_logit_softcapping (the released Gemma 3
  configs set none), so neither do we for those checkpoints; every other class does."""
  cap = getattr(t, "final_logit_softcapping", None)
  if cap is None or getattr(top, "model_type", None) == "gemma3":
    return None
  return float(cap)


def _prefix(names) -> str:
  for p in _PREFIXES:
    if p + "embed_tokens.weight" in names:
      return p
  raise ValueError("no Gemma text embedding found (looked for "
                   + ", ".join(p + "embed_tokens.weight" for p in _PREFIXES) + ")")


def read_params(config, where: dict, folder, dtype: Optional[str] = None) -> tuple:
  """Gemma tensors (`where`: {name: file}, hf_reader.open_tensors) -> (config with dtype, numpy
  params in forward.py's layout, None). Every shape is checked before any data is read."""
  prefix = _prefix(where)
  embed = prefix + "embed_tokens.weight"
  config = config.replace(dtype=dtype or hf_reader.checkpoint_dtype(where[embed].meta[embed][0]))
  shapes = hf_reader.param_shapes(init_params, config)
  plans = layout(config).layers

  plan, unknown = [], []
  for name, f in where.items():
    if _SKIPPED_TOWERS.match(name) or name.endswith("rotary_emb.inv_freq"):
      continue
    if name in _HEADS:
      if not config.tie_embeddings:
        plan.append(Tensor(name, f, ("lm_head",), True))
      else:
        hf_reader.check_tied_head(where, embed, name)
      continue
    rel = name[len(prefix):] if name.startswith(prefix) else None
    m = _LAYER_RE.match(rel or "")
    if m:
      i, suffix = int(m.group(1)), m.group(2)
      if i < config.num_layers and plans[i].kv_shared and suffix in _KV_ONLY:
        continue
      if i >= config.num_layers or suffix not in LAYER_NAMES or \
          LAYER_NAMES[suffix][0] not in shapes["layers"][i]:
        unknown.append(name)
        continue
      leaf, transpose = LAYER_NAMES[suffix]
      plan.append(Tensor(name, f, ("layers", i, leaf), transpose))
    elif rel in _TOP_NAMES and _TOP_NAMES[rel][0] in shapes:
      leaf, transpose = _TOP_NAMES[rel]
      plan.append(Tensor(name, f, (leaf,), transpose))
    else:
      unknown.append(name)
  if unknown:
    raise ValueError(f"{folder}: {len(unknown)} tensor(s) this {config.model_type} config does "
                     f"not use: {listing(sorted(unknown))}")
  hf_reader.check_shapes(plan, shapes)
  filled = {t.path for t in plan}
  needed = [("layers", i, leaf) for i, lp in enumerate(shapes["layers"]) for leaf in lp]
  needed += [(leaf,) for leaf in shapes if leaf != "layers"]
  missing = ["/".join(map(str, t)) for t in needed if t not in filled]
  if missing:
    raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensor(s) (spec_jax names): "
                     f"{listing(missing)}")
  return config, hf_reader.fill(shapes, plan, hf_reader.np_dtype(config.dtype)), None
