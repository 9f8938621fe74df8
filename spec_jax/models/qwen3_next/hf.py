"""The hybrid family's Hugging Face reading: config.json and tensors -> forward.py's layout.

config.json model_type: qwen3_next (Qwen3NextForCausalLM), qwen3_5_text (Qwen3_5ForCausalLM),
qwen3_5 (Qwen3_5ForConditionalGeneration: its text_config; the vision tower is skipped).
Tensors below `model.` or `model.language_model.`; HF [out, in] weights transposed:

  embed_tokens.weight  embed       norm.weight  final_norm       lm_head.weight  lm_head
  layers.N.input_layernorm / post_attention_layernorm .weight      attn_norm / mlp_norm
  layers.N.linear_attn.
    in_proj_qkvz [Hk (2 Dk + 2 r Dv), D] (Qwen3-Next: grouped per key head: q, k, r v heads,
      r z heads) and in_proj_ba [Hk 2 r, D] (per key head: r b, r a), or Qwen3.5's split
      in_proj_qkv / in_proj_z / in_proj_b / in_proj_a        -> w_qkv, w_z, w_b, w_a
    conv1d.weight [C, 1, W] conv_w   dt_bias, A_log   norm.weight gnorm   out_proj w_out
  layers.N.self_attn.{q,k,v,o}_proj.weight, {q,k}_norm.weight     wq, wk, wv, wo, q/k_norm
  layers.N.mlp.{gate,up,down}_proj.weight                         w_gate, w_up, w_down
  layers.N.mlp.gate.weight router; mlp.experts.E.{gate,up,down}_proj.weight (or fused
    mlp.experts.gate_up_proj [E, 2 Fe, D] / down_proj [E, D, Fe]) experts_*;
    mlp.shared_expert.{gate,up,down}_proj.weight shared_*; mlp.shared_expert_gate.weight
  mtp.* (or model.mtp.*, language_model.mtp.*, model.language_model.mtp.*)  collected raw as
    mtp.* (the native MTP head, spec_jax.drafters.hybrid_mtp)
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from spec_jax.models import hf_reader
from spec_jax.models.hf_reader import get, listing
from spec_jax.models.qwen3_next import plan as hplan
from spec_jax.models.qwen3_next.forward import init_params

HF_MODEL_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5_text",
                  "qwen3_5": "qwen3_5_text"}
_PREFIXES = ("model.language_model.", "model.")
_SKIPPED = re.compile(r"^(model\.)?(visual|vision_tower)\.")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_PLAIN = {"input_layernorm.weight": ("attn_norm", False),
          "post_attention_layernorm.weight": ("mlp_norm", False),
          "linear_attn.in_proj_qkv.weight": ("w_qkv", True),
          "linear_attn.in_proj_z.weight": ("w_z", True),
          "linear_attn.in_proj_b.weight": ("w_b", True),
          "linear_attn.in_proj_a.weight": ("w_a", True),
          "linear_attn.dt_bias": ("dt_bias", False), "linear_attn.A_log": ("A_log", False),
          "linear_attn.norm.weight": ("gnorm", False),
          "linear_attn.out_proj.weight": ("w_out", True),
          "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
          "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
          "self_attn.q_norm.weight": ("q_norm", False),
          "self_attn.k_norm.weight": ("k_norm", False),
          "mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True),
          "mlp.down_proj.weight": ("w_down", True), "mlp.gate.weight": ("router", True),
          "mlp.shared_expert.gate_proj.weight": ("shared_gate", True),
          "mlp.shared_expert.up_proj.weight": ("shared_up", True),
          "mlp.shared_expert.down_proj.weight": ("shared_down", True),
          "mlp.shared_expert_gate.weight": ("shared_expert_gate", True)}
_MTP_RE = re.compile(r"^(model\.)?(language_model\.)?mtp\.")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def text_config(cfg):
  return cfg.get_text_config() if getattr(cfg, "model_type", None) == "qwen3_5" else cfg


def config_fields(cfg, source: str = "config.json") -> dict:
  """A transformers Qwen3NextConfig / Qwen3_5TextConfig / Qwen3_5Config -> ModelConfig fields;
  ValueError naming the field for what spec_jax does not run."""
  t = text_config(cfg)
  model_type = HF_MODEL_TYPES.get(getattr(t, "model_type", None))
  if model_type is None:
    raise ValueError(f"{source}: not a Qwen3-Next / Qwen3.5 config (model_type "
                     f"{getattr(cfg, 'model_type', None)!r})")
  act = get(t, "hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{source}: unsupported hidden_act {act!r}; supported: silu")
  if get(t, "attention_bias", False):
    raise ValueError(f"{source}: attention_bias is true; the hybrid family has no attention "
                     "biases")
  n = int(t.num_hidden_layers)
  types = get(t, "layer_types", None)
  if types is None or len(types) != n:
    raise ValueError(f"{source}: layer_types must list {n} layer types (num_hidden_layers), "
                     f"got {types!r}")
  rope = dict(get(t, "rope_parameters", None) or {})
  theta = float(rope.pop("rope_theta", get(t, "rope_theta", 10000.0)))
  partial = float(rope.pop("partial_rotary_factor", get(t, "partial_rotary_factor", 1.0)))
  kind = rope.pop("rope_type", "default")
  if kind != "default":
    raise ValueError(f"{source}: rope_parameters.rope_type {kind!r} is not supported; "
                     "supported: default")
  heads = int(t.num_attention_heads)
  hidden = int(t.hidden_size)
  bos = getattr(t, "bos_token_id", None)
  num_mtp = int(get(t, "mtp_num_hidden_layers", 0) or 0)
  next_moe = model_type == "qwen3_next"
  tie = bool(get(cfg, "tie_word_embeddings", get(t, "tie_word_embeddings", False)))
  return dict(
      vocab_size=int(t.vocab_size), hidden_size=hidden,
      intermediate_size=int(t.intermediate_size), num_layers=n, num_heads=heads,
      num_kv_heads=int(get(t, "num_key_value_heads", heads)),
      head_dim=int(get(t, "head_dim", None) or hidden // heads), rope_theta=theta,
      rms_norm_eps=float(get(t, "rms_norm_eps", 1e-6)), tie_embeddings=tie,
      max_position_embeddings=int(get(t, "max_position_embeddings", 32768)),
      model_type=model_type, bos_token_id=None if bos is None else int(bos),
      eos_token_ids=hf_reader.token_ids(getattr(t, "eos_token_id", None)),
      num_mtp_layers=num_mtp, layer_types=tuple(str(x) for x in types),
      partial_rotary_factor=partial,
      linear_num_key_heads=int(t.linear_num_key_heads),
      linear_num_value_heads=int(t.linear_num_value_heads),
      linear_key_head_dim=int(t.linear_key_head_dim),
      linear_value_head_dim=int(t.linear_value_head_dim),
      linear_conv_kernel_dim=int(t.linear_conv_kernel_dim),
      num_experts=int(get(t, "num_experts", 0) or 0) if next_moe else 0,
      num_experts_per_tok=int(get(t, "num_experts_per_tok", 0) or 0) if next_moe else 0,
      moe_intermediate_size=int(get(t, "moe_intermediate_size", 0) or 0) if next_moe else 0,
      shared_expert_intermediate_size=(int(get(t, "shared_expert_intermediate_size", 0) or 0)
                                       if next_moe else 0),
      norm_topk_prob=bool(get(t, "norm_topk_prob", True)),
      decoder_sparse_step=int(get(t, "decoder_sparse_step", 1) or 1),
      mlp_only_layers=tuple(int(i) for i in (get(t, "mlp_only_layers", None) or ())))


def _prefix(names) -> str:
  for p in _PREFIXES:
    if p + "embed_tokens.weight" in names:
      return p
  raise ValueError("no text embedding found (looked for "
                   + ", ".join(p + "embed_tokens.weight" for p in _PREFIXES) + ")")


def _grouped_qkvz(config, qkvz, ba):
  """Qwen3-Next's grouped in_proj_qkvz [Hk (2Dk + 2 r Dv), D] and in_proj_ba [Hk 2r, D] ->
  (w_qkv [D, 2 Hk Dk + Hv Dv], w_z [D, Hv Dv], w_b, w_a [D, Hv]) in Qwen3.5's flat order
  (fix_query_key_value_ordering)."""
  c = config
  hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
  r = c.linear_num_value_heads // hk
  d = qkvz.shape[1]
  g = qkvz.reshape(hk, 2 * dk + 2 * r * dv, d)
  q, k = g[:, :dk], g[:, dk:2 * dk]
  v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
  flat = lambda x: x.reshape(-1, d)
  w_qkv = np.concatenate([flat(q), flat(k), flat(v)], axis=0)
  gba = ba.reshape(hk, 2 * r, d)
  return w_qkv.T, flat(z).T, flat(gba[:, :r]).T, flat(gba[:, r:]).T


def read_params(config, where: dict, folder, dtype: Optional[str] = None) -> tuple:
  """Tensors (`where`: {name: file}) -> (config with dtype, numpy params in forward.py's
  layout, {mtp.* name: array} or None). Every stored shape, unknown and missing tensor is
  checked (from the files' headers) before any data is read."""
  prefix = _prefix(where)
  embed = prefix + "embed_tokens.weight"
  config = config.replace(dtype=dtype or hf_reader.checkpoint_dtype(where[embed].meta[embed][0]))
  shapes = hf_reader.param_shapes(init_params, config)
  np_dtype = hf_reader.np_dtype(config.dtype)
  c = config
  s = hplan.linear_sizes(c) if hplan.LINEAR in c.layer_types else None
  mtp, unknown, expect, grouped, experts = {}, [], {}, {}, {}
  plain = []                     # (name, node: None or layer index, leaf, transpose)

  def want(node, leaf):
    return tuple(shapes["layers"][node][leaf] if isinstance(node, int) else shapes[leaf])

  for name in where:
    m = _MTP_RE.match(name)
    if m:                            # kept raw under "mtp." (converted layouts prefix it)
      mtp["mtp." + name[m.end():]] = (where[name], name)
      continue
    if _SKIPPED.match(name) or hf_reader.IGNORED.search(name):
      continue
    rel = name[len(prefix):] if name.startswith(prefix) else None
    top = {"embed_tokens.weight": ("embed", False), "norm.weight": ("final_norm", False)}
    if name == "lm_head.weight":
      if not c.tie_embeddings:
        plain.append((name, None, "lm_head", True))
      else:
        hf_reader.check_tied_head(where, prefix + "embed_tokens.weight", name)
      continue
    if rel in top:
      plain.append((name, None) + top[rel])
      continue
    m = _LAYER_RE.match(rel or "")
    if not m or int(m.group(1)) >= c.num_layers:
      unknown.append(name)
      continue
    i, suffix = int(m.group(1)), m.group(2)
    leaves = shapes["layers"][i]
    if suffix in ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight") and \
        "w_qkv" in leaves:
      qkvz = suffix.startswith("linear_attn.in_proj_qkvz")
      grouped.setdefault(i, {})["qkvz" if qkvz else "ba"] = name
      expect[name] = ((s["conv_dim"] + s["value_dim"]) if qkvz else 2 * c.linear_num_value_heads,
                      c.hidden_size)
    elif suffix == "linear_attn.conv1d.weight" and "conv_w" in leaves:
      plain.append((name, i, "conv_w", False))
      conv, w = leaves["conv_w"]
      expect[name] = (conv, 1, w)
    elif _EXPERT_RE.match(suffix) and "router" in leaves:
      e, which = _EXPERT_RE.match(suffix).groups()
      experts.setdefault(i, {})[(int(e), which)] = name
      fe = c.moe_intermediate_size
      expect[name] = (c.hidden_size, fe) if which == "down" else (fe, c.hidden_size)
    elif suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj") and "router" in leaves:
      experts.setdefault(i, {})[suffix] = name
      e, fe, d = c.num_experts, c.moe_intermediate_size, c.hidden_size
      expect[name] = (e, 2 * fe, d) if suffix.endswith("gate_up_proj") else (e, d, fe)
    elif suffix in _PLAIN and _PLAIN[suffix][0] in leaves:
      plain.append((name, i) + _PLAIN[suffix])
    else:
      unknown.append(name)
  if unknown:
    raise ValueError(f"{folder}: {len(unknown)} tensor(s) this {c.model_type} config does "
                     f"not use: {listing(sorted(unknown))}")
  for name, node, leaf, transpose in plain:
    if name not in expect:
      shape = want(node, leaf)
      expect[name] = tuple(reversed(shape)) if transpose else shape
  for name, shape in expect.items():
    got = tuple(where[name].meta[name][1])
    if got != tuple(shape):
      raise ValueError(f"{where[name].path}: tensor {name} has shape {got} but config.json "
                       f"implies {tuple(shape)}")
  filled = {(node, leaf) for _, node, leaf, _ in plain}
  for i, names in grouped.items():
    if set(names) != {"qkvz", "ba"}:
      raise ValueError(f"{folder}: layer {i} needs both linear_attn.in_proj_qkvz and "
                       "linear_attn.in_proj_ba")
    filled |= {(i, leaf) for leaf in ("w_qkv", "w_z", "w_b", "w_a")}
  for i, names in experts.items():
    fused = "mlp.experts.gate_up_proj" in names
    for which, leaf in (("gate", "experts_gate"), ("up", "experts_up"), ("down", "experts_down")):
      stored = (["mlp.experts.down_proj" if which == "down" else "mlp.experts.gate_up_proj"]
                if fused else [(j, which) for j in range(c.num_experts)])
      if all(k in names for k in stored):
        filled.add((i, leaf))
  missing = [f"layers/{i}/{leaf}" for i, lp in enumerate(shapes["layers"]) for leaf in lp
             if (i, leaf) not in filled]
  missing += [leaf for leaf in shapes if leaf != "layers" and (None, leaf) not in filled]
  if missing:
    raise ValueError(f"{folder}: checkpoint lacks {len(missing)} tensor(s) (spec_jax names): "
                     f"{listing(missing)}")

  # Every shape checked: read.
  read = lambda name: np.asarray(where[name].read(name), np.float32)
  layers = [dict() for _ in range(c.num_layers)]
  params = {"layers": layers}

  def put(node, leaf, value):
    (layers[node] if isinstance(node, int) else params)[leaf] = value.astype(np_dtype)

  for name, node, leaf, transpose in plain:
    value = read(name)
    value = value.reshape(value.shape[0], -1) if leaf == "conv_w" else value
    put(node, leaf, value.T if transpose else value)
  for i, names in grouped.items():
    parts = _grouped_qkvz(c, read(names["qkvz"]), read(names["ba"]))
    for leaf, value in zip(("w_qkv", "w_z", "w_b", "w_a"), parts):
      put(i, leaf, value)
  for i, names in experts.items():
    if "mlp.experts.gate_up_proj" in names:
      gu = read(names["mlp.experts.gate_up_proj"])                     # [E, 2F, D]
      f = gu.shape[1] // 2
      put(i, "experts_gate", np.swapaxes(gu[:, :f], 1, 2))
      put(i, "experts_up", np.swapaxes(gu[:, f:], 1, 2))
      put(i, "experts_down", np.swapaxes(read(names["mlp.experts.down_proj"]), 1, 2))
      continue
    for which, leaf in (("gate", "experts_gate"), ("up", "experts_up"), ("down", "experts_down")):
      put(i, leaf, np.stack([read(names[(j, which)]).T for j in range(c.num_experts)]))
  raw_mtp = {name: f.read(stored) for name, (f, stored) in mtp.items()} or None
  return config, params, raw_mtp


def read_layer(config, tensors: dict, source: str) -> dict:
  """One layer's tensors {suffix after "layers.N.": array} -> its params, layer 0 of `config`
  (a one-layer config: what the native MTP module's decoder layer is). ValueError for an
  unknown, missing or misshapen tensor."""
  want = hf_reader.param_shapes(init_params, config)["layers"][0]
  out, experts = {}, {}
  for suffix, value in tensors.items():
    value = np.asarray(value, np.float32)
    m = _EXPERT_RE.match(suffix)
    if m:
      experts[(int(m.group(1)), m.group(2))] = value
    elif suffix == "mlp.experts.gate_up_proj":
      f = value.shape[1] // 2
      out["experts_gate"] = np.swapaxes(value[:, :f], 1, 2)
      out["experts_up"] = np.swapaxes(value[:, f:], 1, 2)
    elif suffix == "mlp.experts.down_proj":
      out["experts_down"] = np.swapaxes(value, 1, 2)
    elif suffix in _PLAIN and _PLAIN[suffix][0] in want:
      leaf, transpose = _PLAIN[suffix]
      out[leaf] = value.T if transpose else value
    else:
      raise ValueError(f"{source}: tensor {suffix} is not part of this layer")
  for which, leaf in (("gate", "experts_gate"), ("up", "experts_up"), ("down", "experts_down")):
    if (0, which) in experts:
      got = [experts.get((j, which)) for j in range(config.num_experts)]
      if any(g is None for g in got):
        raise ValueError(f"{source}: lacks some mlp.experts.N.{which}_proj.weight (num_experts "
                         f"{config.num_experts})")
      out[leaf] = np.stack([g.T for g in got])
  missing = sorted(set(want) - set(out))
  if missing:
    raise ValueError(f"{source}: lacks {len(missing)} tensor(s) (spec_jax names): "
                     f"{listing(missing)}")
  for leaf, value in out.items():
    if tuple(value.shape) != tuple(want[leaf]):
      raise ValueError(f"{source}: {leaf} has shape {tuple(value.shape)}; the config implies "
                       f"{tuple(want[leaf])}")
  return out
