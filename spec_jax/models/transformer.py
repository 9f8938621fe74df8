"""One decoder-only transformer for the llama / mistral / qwen2 / qwen3 families.

Params are a plain pytree; per-layer weights are stacked on a leading [L] axis:

  embed        [V, D]
  layers/
    attn_norm  [L, D]            mlp_norm [L, D]
    wq [L, D, Hq*Dh]   wk, wv [L, D, Hkv*Dh]   wo [L, Hq*Dh, D]
    bq [L, Hq*Dh]      bk, bv [L, Hkv*Dh]       (qkv_bias only)
    q_norm, k_norm [L, Dh]                      (qk_norm only)
    w_gate, w_up [L, D, F]   w_down [L, F, D]
  final_norm   [D]
  lm_head      [D, V]                           (absent when tie_embeddings)

q/k weights use the Hugging Face "rotate_half" RoPE layout; llama2.c checkpoints are permuted
into it when loaded (as the HF conversion script does), so one RoPE serves every family.

`forward` writes the T new tokens of every row at that row's offset of a fixed-capacity KV
cache (spec_jax.models.cache; in place: a scatter on the stacked cache, no copy) and attends
through `kernels_pallas.verify_attention`. It takes the canonical params above or the
execution layout of spec_jax.models.layout (fused, on CPU [out, in] and unstacked).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas
from kernels_pallas.layout import MAX_NEW_TOKENS
from kernels_pallas.reference import verify_attention_reference
from spec_jax.models import matmul
from spec_jax.models.cache import KVCache, default_head_major, write_rows as _write_rows
from spec_jax.models.config import ModelConfig
from spec_jax.models.layout import pick_weight




class ForwardOutput(NamedTuple):
  """logits [B,T,V] float32; hidden [B,T,D] (after the final norm, what the LM head reads);
  layer_hidden: tuple of [B,T,D], the residual stream after each requested layer;
  cache: the updated KVCache."""
  logits: jax.Array
  hidden: jax.Array
  layer_hidden: tuple
  cache: KVCache


# ----------------------------------------------------------------------------- building blocks

def rms_norm(x, weight, eps):
  """RMSNorm in float32, cast back to x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
  """Inverse frequencies [Dh/2] (numpy, static), with llama3 / linear scaling."""
  dh = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
  scaling = config.rope_scaling_dict
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind in (None, "default"):
    return inv_freq
  if kind == "linear":
    return inv_freq / float(scaling["factor"])
  if kind == "llama3":
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled)
  raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


def rope_tables(positions, inv_freq):
  """cos, sin float32 [B, T, 1, Dh] for the rotate_half layout, from positions int32 [B, T].

  Computed once per forward and shared by every layer (q and k of all layers rotate by the
  same angles)."""
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  cos = jnp.concatenate([cos, cos], -1)[:, :, None, :]
  sin = jnp.concatenate([sin, sin], -1)[:, :, None, :]
  return cos, sin


def apply_rope(x, positions, inv_freq=None, *, tables=None):
  """x [B,T,H,Dh], positions int32 [B,T] -> x rotated (HF rotate_half layout).

  tables: optional (cos, sin) from rope_tables (then positions/inv_freq are not used)."""
  cos, sin = rope_tables(positions, inv_freq) if tables is None else tables
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], -1)
  return (x32 * cos + rotated * sin).astype(x.dtype)




def _attention(config, q, k_layer, v_layer, kv_lengths, tree_mask, head_major: bool = False):
  """Verify attention of q [B,T,Hq,Dh] over one layer's cache, [B,S,Hkv,Dh] or (head_major)
  [B,Hkv,S,Dh]."""
  t = q.shape[1]
  s = k_layer.shape[2 if head_major else 1]
  window = config.sliding_window
  needs_window = window is not None and window < s
  wide_mask = tree_mask is not None and tree_mask.shape[-1] != t
  if needs_window or (t > 16 and tree_mask is None) or t > MAX_NEW_TOKENS or wide_mask:
    # Prefill and sliding-window attention take the jnp path; the kernel is for small T (draft
    # trees: up to its 32 new tokens) with a square tree mask.
    return verify_attention_reference(q, k_layer, v_layer, kv_lengths, tree_mask,
                                      sliding_window=window if needs_window else None,
                                      head_major=head_major)
  if head_major:
    if default_head_major(config):      # the jnp path: the layout it reads in place
      return verify_attention_reference(q, k_layer, v_layer, kv_lengths, tree_mask,
                                        head_major=True)
    # A kernel over a head-major cache (made by hand for another impl): its layout, by a copy.
    k_layer, v_layer = jnp.swapaxes(k_layer, 1, 2), jnp.swapaxes(v_layer, 1, 2)
  return kernels_pallas.verify_attention(q, k_layer, v_layer, kv_lengths, tree_mask,
                                         impl=config.attention_impl)


def _dense(x, w, transposed: bool = False):
  """x [..., in] times a weight stored [in, out] (transposed False) or [out, in] (True), in x's
  dtype, accumulated in float32 for bf16 (spec_jax.models.matmul); with transposed, w may be a
  tuple of row chunks [out_i, in] (see models.layout.fuse_layers' chunks)."""
  return matmul.dense(x, w, transposed)


def _rows(x) -> int:
  """The rows of a product over x [..., in] (B*T): what picks a weight's orientation."""
  return math.prod(x.shape[:-1])


def _project(lp, name: str, x):
  """x times projection `name` of layer params lp, in whichever orientation it is stored for
  this many rows (models.layout.pick_weight); None when lp has no such projection."""
  picked = pick_weight(lp, name, _rows(x))
  return None if picked is None else _dense(x, *picked)


def _qkv_projections(config: ModelConfig, lp, h):
  """q [B,T,Hq*Dh], k, v [B,T,Hkv*Dh] from the normed input, in either param layout."""
  nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  y = _project(lp, "wqkv", h)
  if y is not None:
    if config.qkv_bias:
      y = y + lp["bqkv"]
    return y[..., :nq], y[..., nq:nq + nkv], y[..., nq + nkv:]
  q, k, v = _dense(h, lp["wq"]), _dense(h, lp["wk"]), _dense(h, lp["wv"])
  if config.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  return q, k, v


def _mlp(lp, h):
  """SwiGLU: down(silu(gate h) * up h), in either param layout."""
  gu = _project(lp, "w_gu", h)
  if gu is not None:
    gate, up = jnp.split(gu, 2, axis=-1)
    inner = jax.nn.silu(gate) * up
  else:
    inner = jax.nn.silu(_dense(h, lp["w_gate"])) * _dense(h, lp["w_up"])
  return _project(lp, "w_down", inner)


def _out_projection(lp, attn):
  return _project(lp, "wo", attn)


def decoder_layer(config: ModelConfig, lp, x, positions, k_cache, v_cache, offsets, tree_mask,
                  inv_freq, layer: Optional[int] = None, rope: Optional[tuple] = None,
                  head_major: bool = False):
  """One pre-norm block. lp: this layer's params (no [L] axis), canonical or execution layout
  (see prepare_params).

  k_cache, v_cache: with `layer` given, the stacked [L,B,S,Hkv,Dh] caches (head_major:
  [L,B,Hkv,S,Dh]; see KVCache), of which slab `layer` is written and read; with layer None, one
  layer's [B,S,Hkv,Dh] (or [B,Hkv,S,Dh]) cache (drafter heads).
  rope: optional (cos, sin) tables from rope_tables(positions, inv_freq), shared by all layers.
  Returns (x, k_cache, v_cache)."""
  if layer is None:
    x, k_cache, v_cache = decoder_layer(config, lp, x, positions, k_cache[None], v_cache[None],
                                        offsets, tree_mask, inv_freq, layer=0, rope=rope,
                                        head_major=head_major)
    return x, k_cache[0], v_cache[0]
  b, t, _ = x.shape
  hq, hkv, dh = config.num_heads, config.num_kv_heads, config.head_dim
  if rope is None:
    rope = rope_tables(positions, inv_freq)
  h = rms_norm(x, lp["attn_norm"], config.rms_norm_eps)
  q, k, v = _qkv_projections(config, lp, h)
  q = q.reshape(b, t, hq, dh)
  k = k.reshape(b, t, hkv, dh)
  v = v.reshape(b, t, hkv, dh)
  if config.qk_norm:
    q = rms_norm(q, lp["q_norm"], config.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], config.rms_norm_eps)
  q = apply_rope(q, positions, tables=rope)
  k = apply_rope(k, positions, tables=rope)
  k_cache = _write_rows(k_cache, layer, k, offsets, head_major)
  v_cache = _write_rows(v_cache, layer, v, offsets, head_major)
  attn = _attention(config, q, k_cache[layer], v_cache[layer], offsets + t, tree_mask,
                    head_major)
  x = x + _out_projection(lp, attn.reshape(b, t, hq * dh))
  h = rms_norm(x, lp["mlp_norm"], config.rms_norm_eps)
  x = x + _mlp(lp, h)
  return x, k_cache, v_cache


def embed(params, tokens):
  return jnp.take(params["embed"], tokens, axis=0)


def lm_head(params, config: ModelConfig, hidden):
  """hidden [..., D] (after the final norm) -> float32 logits [..., V]."""
  if config.tie_embeddings:
    w, transposed = params["embed"], True                # [V, D]
  else:                                                  # [D, V], or [V, D] as lm_head_t
    w, transposed = pick_weight(params, "lm_head", _rows(hidden))
  return matmul.dense(hidden, w, transposed, out_dtype=jnp.float32)


def forward(params, config: ModelConfig, tokens, cache: KVCache, offsets, *,
            positions=None, tree_mask=None, return_layers: Sequence[int] = ()) -> ForwardOutput:
  """Runs T new tokens per row through the model, writing their KV at per-row offsets.

  Args:
    params: the model pytree (module docstring).
    config: ModelConfig (static).
    tokens: int32 [B, T]; entries must be valid ids (pad with any valid id).
    cache: KVCache (either layout) with capacity S >= offsets + T for every row.
    offsets: int32 [B], where row b's new tokens go: positions offsets[b] .. offsets[b]+T-1.
      Row b attends to cache entries < offsets[b] plus its new tokens (causally).
    positions: optional int32 [B, T] RoPE positions (defaults to offsets[:,None] + arange(T));
      tree drafts pass offset + depth here.
    tree_mask: optional bool [B, T, T] visibility among the new tokens (default causal), or
      [B, T, W] (W > T) over the last W cache entries ending with the new tokens (a draft tree
      growing in the cache; see kernels_pallas.reference).
    return_layers: indices of layers whose output residual stream to return (EAGLE-3 features).

  Returns:
    ForwardOutput(logits [B,T,V] f32, hidden [B,T,D], layer_hidden, cache).
  """
  b, t = tokens.shape
  offsets = offsets.astype(jnp.int32)
  if positions is None:
    positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  inv_freq = rope_inv_freq(config)
  rope = rope_tables(positions, inv_freq)
  dtype = jnp.dtype(config.dtype)
  x = embed(params, tokens).astype(dtype)
  k_all, v_all = cache.k, cache.v
  wanted = set(int(i) for i in return_layers)
  layer_hidden = {}
  # A static Python loop over layers: each layer scatters its new KV into the stacked buffer in
  # place (no scan carrying the whole cache as xs/ys, which would copy it every step).
  layers = params["layers"]
  for layer in range(config.num_layers):
    if isinstance(layers, (list, tuple)):   # unstacked (see unstack_layers)
      lp = layers[layer]
    else:
      lp = jax.tree.map(lambda w: w[layer], layers)
    x, k_all, v_all = decoder_layer(config, lp, x, positions, k_all, v_all, offsets, tree_mask,
                                    inv_freq, layer=layer, rope=rope, head_major=cache.head_major)
    if layer in wanted:
      layer_hidden[layer] = x
  hidden = rms_norm(x, params["final_norm"], config.rms_norm_eps)
  logits = lm_head(params, config, hidden)
  return ForwardOutput(logits, hidden, tuple(layer_hidden[i] for i in return_layers),
                       KVCache(k=k_all, v=v_all, head_major=cache.head_major))




# ----------------------------------------------------------------------------- init

def init_params(config: ModelConfig, key) -> dict:
  """Random weights (normal, std 0.02; norms at 1) in the layout of the module docstring."""
  d, f, v, l = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_layers
  hq, hkv, dh = config.num_heads, config.num_kv_heads, config.head_dim
  dtype = jnp.dtype(config.dtype)
  keys = iter(jax.random.split(key, 16))

  def normal(shape, std=0.02):
    return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  layers = {
      "attn_norm": jnp.ones((l, d), dtype),
      "mlp_norm": jnp.ones((l, d), dtype),
      "wq": normal((l, d, hq * dh)),
      "wk": normal((l, d, hkv * dh)),
      "wv": normal((l, d, hkv * dh)),
      "wo": normal((l, hq * dh, d)),
      "w_gate": normal((l, d, f)),
      "w_up": normal((l, d, f)),
      "w_down": normal((l, f, d)),
  }
  if config.qkv_bias:
    layers["bq"] = normal((l, hq * dh))
    layers["bk"] = normal((l, hkv * dh))
    layers["bv"] = normal((l, hkv * dh))
  if config.qk_norm:
    layers["q_norm"] = jnp.ones((l, dh), dtype)
    layers["k_norm"] = jnp.ones((l, dh), dtype)
  params = {"embed": normal((v, d)), "layers": layers, "final_norm": jnp.ones((d,), dtype)}
  if not config.tie_embeddings:
    params["lm_head"] = normal((d, v))
  return params


def expected_shapes(config: ModelConfig) -> dict:
  """The shape of every param leaf (same tree as init_params), for loaders to check against."""
  abstract = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
  return jax.tree.map(lambda s: tuple(s.shape), abstract)
