"""The static plan of a Gemma 3 / Gemma 4 stack: what each layer is, where its KV lives.

Everything here is a function of the (hashable) ModelConfig, computed once per config at trace
time:

  layer i: its attention type (sliding or full), KV shape (num_kv_heads, head_dim: Gemma 4's
    full layers may be wider and have fewer kv heads), MLP width (Gemma 4's double-wide MLP on
    KV-shared layers), whether it computes its own K/V or reads another layer's
    (num_kv_shared_layers: the last N layers attend to the cache of the last non-shared layer
    of their type, the "store" layer), and its slot in the KV cache.
  cache groups: one stacked buffer per attention type that has layers with their own K/V,
    [layers of that type, B, S, Hkv_type, Dh_type] (KVCache buffers, forward.init_cache):
    layers of different KV shapes never share a buffer, so nothing is padded to the widest one.
  RoPE per type: inverse frequencies for "default", "linear" (divided by factor) and
    "proportional" (Gemma 4's full layers: the first partial_rotary_factor * head_dim / 2
    frequencies with the exponent over the full head_dim, the rest 0, i.e. not rotated).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np

from spec_jax.models.family import check_layer_types

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
HIDDEN_ACTS = ("silu", "gelu_tanh")
# rope_scaling kinds of the Gemma forward (the llama family's: blocks.rope_inv_freq).
GEMMA_ROPE_TYPES = ("default", "linear", "proportional")
# ModelConfig fields only the Gemma forward reads, with the value that means "not used".
GEMMA_ONLY = {"hidden_act": "silu", "embed_scale": False, "norm_plus_one": False,
              "attention_scale": None, "final_logit_softcap": None, "layer_types": None,
              "rope_by_type": None, "kv_by_type": None, "v_norm": False, "k_eq_v": False,
              "layer_scalar": False, "num_kv_shared_layers": 0, "double_wide_mlp": False,
              "per_layer_input_size": 0, "per_layer_vocab_size": 0}


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """One layer. kv_layer: the layer whose K/V it attends to (itself unless kv_shared);
  cache_group / cache_slot: where kv_layer's entries live in the cache."""
  index: int
  layer_type: str
  num_kv_heads: int
  head_dim: int
  window: Optional[int]
  kv_shared: bool
  kv_layer: int
  cache_group: int
  cache_slot: int
  intermediate_size: int
  k_eq_v: bool


@dataclasses.dataclass(frozen=True)
class CacheGroup:
  """One stacked KV buffer: [num_layers, B, S, num_kv_heads, head_dim]."""
  layer_type: str
  num_layers: int
  num_kv_heads: int
  head_dim: int


@dataclasses.dataclass(frozen=True)
class GemmaLayout:
  layers: tuple
  groups: tuple

  def store_layer(self, layer_type: str) -> LayerPlan:
    """The last layer of this type with its own K/V (what KV-shared layers and the Gemma 4
    assistant attend to)."""
    own = [p for p in self.layers if p.layer_type == layer_type and not p.kv_shared]
    if not own:
      raise ValueError(f"this model has no {layer_type} layer with its own KV cache")
    return own[-1]


def _rope_items(rope) -> dict:
  return dict(rope or ())


def check_gemma_config(config) -> None:
  """Normalises the Gemma fields of a ModelConfig (lists -> tuples) and raises ValueError on
  anything the Gemma forward cannot run. Called by ModelConfig.__post_init__."""
  c = config
  types = check_layer_types(c, LAYER_TYPES)
  if SLIDING in types and (c.sliding_window is None or int(c.sliding_window) < 1):
    raise ValueError(f"sliding_attention layers need a positive sliding_window, got "
                     f"{c.sliding_window!r}")
  if c.hidden_act not in HIDDEN_ACTS:
    raise ValueError(f"unsupported hidden_act {c.hidden_act!r}; supported: {', '.join(HIDDEN_ACTS)}")

  rope = {}
  for entry in c.rope_by_type or ():
    kind, theta, scaling = entry
    items = dict(scaling) if scaling else {}
    rope_type = items.get("rope_type", "default")
    if rope_type not in GEMMA_ROPE_TYPES:
      raise ValueError(f"unsupported rope_type {rope_type!r} on {kind} layers; supported: "
                       f"{', '.join(GEMMA_ROPE_TYPES)}")
    if rope_type == "linear" and "factor" not in items:
      raise ValueError(f"linear rope scaling on {kind} layers needs 'factor'")
    rope[str(kind)] = (str(kind), float(theta),
                       tuple(sorted((str(k), v) for k, v in items.items())) or None)
  missing = sorted(set(types) - set(rope))
  if missing:
    raise ValueError(f"rope_by_type has no entry for layer type(s) {missing}")
  object.__setattr__(c, "rope_by_type", tuple(rope[t] for t in LAYER_TYPES if t in rope))

  kv = {}
  for kind, heads, dh in c.kv_by_type or ((t, c.num_kv_heads, c.head_dim) for t in LAYER_TYPES):
    heads, dh = int(heads), int(dh)
    if heads < 1 or dh < 1 or c.num_heads % heads:
      raise ValueError(f"{kind} layers: num_kv_heads {heads} must be >= 1 and divide "
                       f"num_heads {c.num_heads}; head_dim {dh} must be >= 1")
    if dh % 2:
      raise ValueError(f"{kind} layers: head_dim {dh} must be even (RoPE rotates pairs)")
    kv[str(kind)] = (str(kind), heads, dh)
  missing = sorted(set(types) - set(kv))
  if missing:
    raise ValueError(f"kv_by_type has no entry for layer type(s) {missing}")
  object.__setattr__(c, "kv_by_type", tuple(kv[t] for t in LAYER_TYPES if t in kv))

  n_shared = int(c.num_kv_shared_layers)
  if not 0 <= n_shared < c.num_layers:
    raise ValueError(f"num_kv_shared_layers must be in [0, num_layers={c.num_layers}), got "
                     f"{n_shared}")
  if n_shared and set(types[:c.num_layers - n_shared]) != set(types):
    raise ValueError("num_kv_shared_layers: every layer type of the KV-shared layers needs an "
                     "earlier layer of that type with its own KV cache")
  if c.per_layer_input_size < 0 or (c.per_layer_input_size and c.per_layer_vocab_size < 1):
    raise ValueError(f"per_layer_input_size ({c.per_layer_input_size}) must be >= 0, and "
                     f"per_layer_vocab_size ({c.per_layer_vocab_size}) >= 1 when it is set")
  layout(c)      # every static lookup works


@functools.lru_cache(maxsize=None)
def layout(config) -> GemmaLayout:
  """The per-layer plan of a (checked) Gemma config."""
  c = config
  kv = {t: (h, d) for t, h, d in c.kv_by_type}
  first_shared = c.num_layers - c.num_kv_shared_layers
  present = [t for t in (SLIDING, FULL) if t in c.layer_types[:first_shared]]
  group_of = {t: g for g, t in enumerate(present)}
  slots = {t: [i for i in range(first_shared) if c.layer_types[i] == t] for t in present}
  store = {t: slots[t][-1] for t in present}
  plans = []
  for i, t in enumerate(c.layer_types):
    shared = i >= first_shared
    source = store[t] if shared else i
    wide = 2 if (c.double_wide_mlp and shared) else 1
    plans.append(LayerPlan(
        index=i, layer_type=t, num_kv_heads=kv[t][0], head_dim=kv[t][1],
        window=int(c.sliding_window) if t == SLIDING else None, kv_shared=shared,
        kv_layer=source, cache_group=group_of[t], cache_slot=slots[t].index(source),
        intermediate_size=c.intermediate_size * wide, k_eq_v=bool(c.k_eq_v and t == FULL)))
  groups = tuple(CacheGroup(t, len(slots[t]), kv[t][0], kv[t][1]) for t in present)
  return GemmaLayout(layers=tuple(plans), groups=groups)


@functools.lru_cache(maxsize=None)
def rope_inv_freq(config, layer_type: str) -> np.ndarray:
  """float32 [head_dim / 2] inverse frequencies of this layer type (computed in float32, as
  transformers does: the angles match its tables bit for bit up to the pow rounding)."""
  entry = {t: (theta, dict(s or ())) for t, theta, s in config.rope_by_type}[layer_type]
  theta, scaling = entry
  dh = {t: d for t, _, d in config.kv_by_type}[layer_type]
  kind = scaling.get("rope_type", "default")
  factor = np.float32(scaling.get("factor", 1.0))
  base = np.float32(theta)
  if kind == "proportional":
    rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * dh // 2)
    exps = np.arange(0, 2 * rotated, 2).astype(np.float32) / np.float32(dh)
    inv = np.concatenate([np.float32(1.0) / (base ** exps),
                          np.zeros(dh // 2 - rotated, np.float32)])
  else:
    exps = np.arange(0, dh, 2).astype(np.float32) / np.float32(dh)
    inv = np.float32(1.0) / (base ** exps)
  if kind in ("linear", "proportional"):
    inv = inv / factor
  return inv.astype(np.float32)


def llama_view(config):
  """A llama-family ModelConfig with a Gemma config's sizes: the width, vocabulary and query
  heads, the first layer type's KV shape and RoPE theta (its linear scaling kept), no window.
  What draft heads whose own layer is llama-style (EAGLE, EAGLE-3, MTP: feature_head.
  head_layer_config) build on for a Gemma target."""
  first = config.layer_types[0]
  theta, scaling = {t: (th, dict(sc or ())) for t, th, sc in config.rope_by_type}[first]
  heads, dh = {t: (h, d) for t, h, d in config.kv_by_type}[first]
  rope_scaling = (tuple(sorted(scaling.items())) if scaling.get("rope_type") == "linear"
                  else None)
  return dataclasses.replace(config, model_type="llama", num_kv_heads=heads, head_dim=dh,
                    rope_theta=float(theta), rope_scaling=rope_scaling, sliding_window=None,
                    **GEMMA_ONLY)


def num_params(config) -> int:
  """Parameter count of a Gemma config (embedding counted once when tied)."""
  c = config
  d, v = c.hidden_size, c.vocab_size
  total = v * d * (1 if c.tie_embeddings else 2) + d
  for p in layout(c).layers:
    q = c.num_heads * p.head_dim
    kv = 0 if p.kv_shared else d * p.num_kv_heads * p.head_dim * (1 if p.k_eq_v else 2)
    # q_norm always; k_norm only on layers with their own K/V; Gemma 4's layer_scalar.
    total += (2 * d * q + kv + 3 * d * p.intermediate_size + 4 * d + p.head_dim
              + (0 if p.kv_shared else p.head_dim) + (1 if c.layer_scalar else 0))
    if c.per_layer_input_size:
      total += 2 * d * c.per_layer_input_size + d
  if c.per_layer_input_size:
    width = c.num_layers * c.per_layer_input_size
    total += c.per_layer_vocab_size * width + d * width + c.per_layer_input_size
  return total
