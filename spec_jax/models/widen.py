"""widen: the same function in a wider, deeper, realistically shaped model.

    big = spec_jax.models.widen(sj.load("../shared/models/stories260K"), hidden_size=768,
                                intermediate_size=2048, num_layers=12)   # 78M params, same logits

The source's residual stream lives in the first D of the new D' dimensions and every added
dimension, head, MLP unit and layer contributes exactly zero, so the widened model computes the
source's logits (up to float rounding of longer sums) while its forward costs what a model of
the new shape costs. Why each piece is exact, for a llama-family source:

- Residual stream. The embedding is zero-padded [V, D] -> [V, D'], and every weight that writes
  the stream (wo, w_down) has zero columns past D, so x' = [x, 0] after every layer.
- RMSNorm. mean(x'^2) over D' is mean(x^2) * D/D'. With eps' = eps * D/D' the normaliser is
  sqrt(D/D') * sqrt(mean(x^2) + eps), so x' / rms' = [x / rms, 0] * sqrt(D'/D); norm weights
  scaled by sqrt(D/D') (zero past D) give back exactly the source's normed values.
- MLP. w_gate, w_up are zero-padded [D, F] -> [D', F'] and w_down [F, D] -> [F', D']: the
  extra units see zero pre-activations, silu(0) * 0 = 0, and their w_down rows are zero anyway.
- Heads. Source q head h goes to wide head (h // g) * g' + h % g (g, g' the GQA group sizes;
  g' >= g, g' == g by default) and kv head j to wide kv head j, so every source head still
  reads its own kv head. In a head, the rotate_half RoPE rotates dims (i, i + Dh/2) as pair i at
  frequency theta^(-2i/Dh); in a head of Dh' = r * Dh dims, pair i * r rotates at
  theta^(-2 i r / Dh') = the same frequency (RoPE scaling is a function of the frequency, so
  scaled RoPE maps the same way). So source dim i goes to i * r and dim Dh/2 + i to
  Dh'/2 + i * r; v and o use the same map. The other dims of a wide head are zero in q, k and v.
  q is scaled by sqrt(r): q'.k' / sqrt(Dh') = sqrt(r) q.k / sqrt(r Dh) = q.k / sqrt(Dh), the
  source's attention logits. Added heads have zero q, k, v and zero wo rows: they contribute
  nothing. q/k biases (qwen2) follow their weights.
- q/k RMSNorm (qwen3). The norm over a wide head sees Dh/Dh' of the mass, but every norm shares
  the one eps' = eps * D/D', so it is exact only when Dh'/Dh == D'/D; then the q norm keeps its
  weights (which also absorbs the sqrt(r) of q) and the k norm is scaled by 1/sqrt(r). Other
  shapes are refused.
- Layers. The extra layers come after the source's and are all zero: a zero attn_norm makes
  q = k = v = 0 and zero wo / w_down add nothing, so each is an identity block. Layer i < L's
  output is the source layer i's (EAGLE-3 / MTP features read the same layers).
- LM head. lm_head is zero-padded [D, V] -> [D', V]; a tied embedding stays tied.

Params are in the llama family's canonical layout (spec_jax.models.llama.forward) (stacked [L, ...], weights [in, out]). The
placement rules are data (`LAYER_AXES`, `TOP_AXES`): an axis is named by what it indexes
("res", "ffn", "q", "kv", "dh", "layer"; "res_blocks" for a concatenation of residual-width
blocks), and `place` puts every source coordinate at its wide index. Draft heads reuse them
(`spec_jax.drafters.widening`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.models import llama
from spec_jax.models.config import ModelConfig
from spec_jax.models.model import Model


class Rule(NamedTuple):
  """How one param leaf widens: `axes` names what each axis indexes (None: kept as is);
  `scale` names a factor of WidenPlan.scales (None: 1)."""
  axes: tuple
  scale: Optional[str] = None


NORM = Rule(("res",), "norm")
# One decoder layer (no [L] axis), llama.forward's names.
LAYER_AXES = {
    "attn_norm": NORM,
    "mlp_norm": NORM,
    "wq": Rule(("res", "q"), "q"),
    "wk": Rule(("res", "kv")),
    "wv": Rule(("res", "kv")),
    "wo": Rule(("q", "res")),
    "bq": Rule(("q",), "q"),
    "bk": Rule(("kv",)),
    "bv": Rule(("kv",)),
    "q_norm": Rule(("dh",), "q_norm"),
    "k_norm": Rule(("dh",), "k_norm"),
    "w_gate": Rule(("res", "ffn")),
    "w_up": Rule(("res", "ffn")),
    "w_down": Rule(("ffn", "res")),
}
TOP_AXES = {
    "embed": Rule((None, "res")),
    "final_norm": NORM,
    "lm_head": Rule(("res", None)),
}


class WidenPlan(NamedTuple):
  """Where every source coordinate goes: int arrays of wide indices, one per axis kind.

  res [D] (into D'), ffn [F] (into F'), q [Hq*Dh] (into Hq'*Dh'), kv [Hkv*Dh] (into Hkv'*Dh'),
  dh [Dh] (into Dh'), layer [L] (into L'); sizes: the wide length of each; scales: the factors
  named by Rule.scale.
  """
  src: ModelConfig
  new: ModelConfig
  index: dict
  sizes: dict
  scales: dict


def _at_least(name: str, new: int, old: int) -> None:
  if new < old:
    raise ValueError(f"widen: {name}={new} is smaller than the source's {old}; allowed: >= {old} "
                     f"(widening never drops a dimension, head or layer)")


def widened_config(src: ModelConfig, hidden_size: int, intermediate_size: int, num_layers: int,
                   head_dim: int = 64, num_heads: Optional[int] = None,
                   num_kv_heads: Optional[int] = None) -> ModelConfig:
  """The wide ModelConfig: new sizes, rms_norm_eps * D/D'. Checked by `plan`.

  num_heads defaults to hidden_size // head_dim; num_kv_heads to num_heads / the source's GQA
  group size (the group is kept)."""
  if src.family is not llama.FAMILY:
    raise ValueError(f"widen: {src.model_type} models are not supported (allowed: "
                     f"{', '.join(llama.FAMILY.model_types)})")
  for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                      ("num_layers", num_layers), ("head_dim", head_dim),
                      ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
    if value is not None and (isinstance(value, bool) or int(value) != value or value <= 0):
      raise ValueError(f"widen: {name} must be a positive integer, got {value!r}")
  _at_least("hidden_size", hidden_size, src.hidden_size)
  _at_least("intermediate_size", intermediate_size, src.intermediate_size)
  _at_least("num_layers", num_layers, src.num_layers)
  if num_heads is None:
    num_heads = int(hidden_size) // int(head_dim)
    if num_heads < src.num_heads:
      raise ValueError(f"widen: num_heads defaults to hidden_size // head_dim = {hidden_size} // "
                       f"{head_dim} = {num_heads}, fewer than the source's {src.num_heads} heads; "
                       f"allowed: a head_dim <= {int(hidden_size) // src.num_heads} (and a "
                       f"multiple of {src.head_dim}), or num_heads >= {src.num_heads}")
  _at_least("num_heads", num_heads, src.num_heads)
  group = src.num_heads // src.num_kv_heads
  if num_kv_heads is None:
    if num_heads % group:
      raise ValueError(f"widen: num_heads={num_heads} is not a multiple of the source's GQA group "
                       f"size {group} ({src.num_heads} q heads / {src.num_kv_heads} kv heads); "
                       f"pass num_heads as a multiple of {group}, or num_kv_heads explicitly")
    num_kv_heads = num_heads // group
  if num_heads % num_kv_heads:
    raise ValueError(f"widen: num_heads={num_heads} must be a multiple of "
                     f"num_kv_heads={num_kv_heads}")
  eps = src.rms_norm_eps * src.hidden_size / int(hidden_size)
  new = src.replace(hidden_size=int(hidden_size), intermediate_size=int(intermediate_size),
                    num_layers=int(num_layers), head_dim=int(head_dim), num_heads=int(num_heads),
                    num_kv_heads=int(num_kv_heads), rms_norm_eps=eps)
  plan(src, new)
  return new


def plan(src: ModelConfig, new: ModelConfig) -> WidenPlan:
  """Checks that `new` can hold `src` exactly and computes where each coordinate goes.

  Raises:
    ValueError: naming the first size that cannot hold the source and what is allowed.
  """
  d, f, l = src.hidden_size, src.intermediate_size, src.num_layers
  hq, hkv, dh = src.num_heads, src.num_kv_heads, src.head_dim
  d2, f2, l2 = new.hidden_size, new.intermediate_size, new.num_layers
  hq2, hkv2, dh2 = new.num_heads, new.num_kv_heads, new.head_dim
  for name, a, b in (("hidden_size", d, d2), ("intermediate_size", f, f2),
                     ("num_layers", l, l2), ("num_heads", hq, hq2),
                     ("num_kv_heads", hkv, hkv2)):
    _at_least(name, b, a)
  if dh2 % dh:
    raise ValueError(f"widen: head_dim={dh2} is not a multiple of the source's head_dim {dh}; "
                     f"allowed: {dh}, {2 * dh}, {3 * dh}, ... (RoPE pair i moves to pair "
                     f"i * head_dim / {dh}, which must be an integer)")
  group, group2 = hq // hkv, hq2 // hkv2
  if group2 < group:
    raise ValueError(f"widen: {hq2} q heads over {hkv2} kv heads is a GQA group of {group2}, "
                     f"smaller than the source's {group} ({hq} / {hkv}); allowed: groups >= "
                     f"{group}, e.g. num_kv_heads = num_heads / {group}")
  if new.vocab_size != src.vocab_size or new.tie_embeddings != src.tie_embeddings:
    raise ValueError("widen: the vocabulary and the embedding tying are kept; change only "
                     "hidden_size, intermediate_size, num_layers and the head shape")
  if (new.rope_theta, new.rope_scaling) != (src.rope_theta, src.rope_scaling):
    raise ValueError("widen: RoPE theta and scaling are kept (the pair map preserves frequencies)")
  if not math.isclose(new.rms_norm_eps, src.rms_norm_eps * d / d2, rel_tol=1e-9):
    raise ValueError(f"widen: rms_norm_eps={new.rms_norm_eps!r} is not the source's "
                     f"{src.rms_norm_eps!r} * {d} / {d2}; allowed: exactly that (widened_config "
                     f"sets it), so every RMSNorm over the wider residual stays the same")
  r = dh2 // dh
  if src.qk_norm and dh2 * d != dh * d2:
    raise ValueError(f"widen: q/k RMSNorm (qk_norm) over a head is exact only when head_dim "
                     f"grows by the same factor as hidden_size (all norms share one eps, scaled "
                     f"by D/D'); here head_dim {dh} -> {dh2} but hidden_size {d} -> {d2}; "
                     f"allowed: head_dim = {dh} * {d2} / {d} (a hidden_size that is a "
                     f"multiple of {d} and the matching head_dim)")
  half, half2 = dh // 2, dh2 // 2
  dim_map = np.concatenate([np.arange(half) * r, half2 + np.arange(half) * r])
  q_heads = (np.arange(hq) // group) * group2 + np.arange(hq) % group
  q_index = (q_heads[:, None] * dh2 + dim_map[None, :]).reshape(-1)
  kv_index = (np.arange(hkv)[:, None] * dh2 + dim_map[None, :]).reshape(-1)
  index = {"res": np.arange(d), "ffn": np.arange(f), "q": q_index, "kv": kv_index,
           "dh": dim_map, "layer": np.arange(l)}
  sizes = {"res": d2, "ffn": f2, "q": hq2 * dh2, "kv": hkv2 * dh2, "dh": dh2, "layer": l2}
  scales = {"norm": math.sqrt(d / d2),
            "q": 1.0 if src.qk_norm else math.sqrt(r),
            "q_norm": 1.0,
            "k_norm": 1.0 / math.sqrt(r)}
  return WidenPlan(src, new, index, sizes, scales)


def place(x, rule: Rule, p: WidenPlan) -> np.ndarray:
  """Source leaf -> wide float32 leaf: zeros, with x * scale at the wide indices of `rule`.

  "res_blocks" is an axis of n concatenated residual-width blocks ([n*D] -> [n*D'], block b's
  dim i at b*D' + i), e.g. EAGLE's fc input concat(embedding, feature)."""
  x = np.asarray(x, np.float32)
  if x.ndim != len(rule.axes):
    raise ValueError(f"widen: a leaf of shape {x.shape} does not match its rule {rule.axes}")
  index, shape = [], []
  for size, axis in zip(x.shape, rule.axes):
    if axis is None:
      idx, wide = np.arange(size), size
    elif axis == "res_blocks":
      d, d2 = len(p.index["res"]), p.sizes["res"]
      if size % d:
        raise ValueError(f"widen: axis of {size} is not a whole number of {d}-wide blocks")
      n = size // d
      idx = (np.arange(n)[:, None] * d2 + p.index["res"][None, :]).reshape(-1)
      wide = n * d2
    else:
      idx, wide = p.index[axis], p.sizes[axis]
      if len(idx) != size:
        raise ValueError(f"widen: axis {axis!r} of a leaf has {size} entries, the source config "
                         f"has {len(idx)}")
    index.append(idx)
    shape.append(wide)
  out = np.zeros(shape, np.float32)
  scale = 1.0 if rule.scale is None else p.scales[rule.scale]
  out[np.ix_(*index)] = x * np.float32(scale)
  return out


def widen_layer(layer: dict, p: WidenPlan, stacked: bool = False) -> dict:
  """One decoder layer's params ({name: leaf}, llama.forward's names) -> wide float32 numpy.

  stacked: the leaves carry a leading [L] axis, widened to [L'] with all-zero (identity) layers
  after the source's."""
  out = {}
  for name, leaf in layer.items():
    if name not in LAYER_AXES:
      raise ValueError(f"widen: no widening rule for layer param {name!r}; known: "
                       f"{', '.join(LAYER_AXES)}")
    rule = LAYER_AXES[name]
    if stacked:
      rule = Rule(("layer",) + rule.axes, rule.scale)
    out[name] = place(leaf, rule, p)
  return out


def widen_params(params, src: ModelConfig, new: ModelConfig) -> dict:
  """The target's params (stacked canonical layout) -> wide float32 numpy params of `new`."""
  p = plan(src, new)
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    layers = jax.tree.map(lambda *xs: np.stack(xs), *layers)
  out = {name: place(leaf, TOP_AXES[name], p) for name, leaf in params.items()
         if name != "layers"}
  out["layers"] = widen_layer(layers, p, stacked=True)
  return out


def widen(model: Model, hidden_size: int, intermediate_size: int, num_layers: int,
          head_dim: int = 64, num_heads: Optional[int] = None,
          num_kv_heads: Optional[int] = None) -> Model:
  """A function-preserving wider and deeper copy of `model` (see the module docstring).

  Args:
    model: a llama / mistral / qwen2 / qwen3 Model.
    hidden_size, intermediate_size, num_layers: the new D', F', L' (each >= the source's).
    head_dim: the new Dh', a multiple of the source's head_dim.
    num_heads: q heads (default hidden_size // head_dim), >= the source's.
    num_kv_heads: kv heads (default num_heads / the source's GQA group size), >= the source's,
      with num_heads / num_kv_heads >= the source's group size.

  Returns:
    Model with the wide config (rms_norm_eps scaled by D/D'), params in the source's dtype,
    the same tokenizer.

  Raises:
    ValueError: a shape that cannot hold the source exactly (the message says what is allowed),
      or a model carrying native MTP weights.
  """
  if model.mtp_params:
    raise ValueError("widen: this model carries native MTP weights, which widen does not "
                     "convert; widen its MTP head with spec_jax.drafters.widen_heads("
                     "sj.drafters.MTP.from_model(model), model, widened) instead")
  new = widened_config(model.config, hidden_size, intermediate_size, num_layers, head_dim,
                       num_heads, num_kv_heads)
  wide = widen_params(model.params, model.config, new)
  dtype = jnp.dtype(new.dtype)
  params = jax.tree.map(lambda x: jnp.asarray(x.astype(dtype)), wide)
  source = f"widen({model.source or 'model'})"
  return Model(config=new, params=params, tokenizer=model.tokenizer, mtp_params=None,
               source=source)
