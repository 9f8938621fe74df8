"""The llama family's forward (llama / mistral / qwen2 / qwen3): params, layers, cache.

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
cache (spec_jax.models.cache.KVCache with one stacked buffer [L, B, S, Hkv, Dh]; in place: a
scatter on the stacked cache, no copy) and attends through `kernels_pallas.verify_attention`.
It takes the canonical params above or the execution layout of spec_jax.models.llama.layout
(fused, on CPU [out, in] and unstacked).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from spec_jax.models.blocks import (AttentionSpec, ForwardOutput, apply_rope, attention, embed,
                                    lm_head, out_projection, qkv_projections, residual_boundary,
                                    rms_norm, rope_inv_freq, rope_tables, select_rows, swiglu_mlp,
                                    windowed_tree_mask)
from spec_jax.models.cache import KVCache, write_rows
from spec_jax.models.matmul import activation_dtype


def decoder_layer(config, lp, x, positions, k_cache, v_cache, offsets, tree_mask,
                  inv_freq, layer: Optional[int] = None, rope: Optional[tuple] = None,
                  head_major: bool = False, attention_spec=None):
  """One pre-norm block. lp: this layer's params (no [L] axis), canonical or execution layout
  (see prepare_params).

  k_cache, v_cache: with `layer` given, the stacked [L,B,S,Hkv,Dh] caches (head_major:
  [L,B,Hkv,S,Dh]; see KVCache), of which slab `layer` is written and read; with layer None, one
  layer's [B,S,Hkv,Dh] (or [B,Hkv,S,Dh]) cache (drafter heads).
  rope: optional (cos, sin) tables from rope_tables(positions, inv_freq), shared by all layers.
  attention_spec: what the attention reads instead of config (an AttentionSpec without the
  window when tree_mask is windowed_tree_mask's full-width mask, which applies it).
  Returns (x, k_cache, v_cache)."""
  if layer is None:
    x, k_cache, v_cache = decoder_layer(config, lp, x, positions, k_cache[None], v_cache[None],
                                        offsets, tree_mask, inv_freq, layer=0, rope=rope,
                                        head_major=head_major, attention_spec=attention_spec)
    return x, k_cache[0], v_cache[0]
  b, t, _ = x.shape
  hq, hkv, dh = config.num_heads, config.num_kv_heads, config.head_dim
  if rope is None:
    rope = rope_tables(positions, inv_freq)
  h = rms_norm(x, lp["attn_norm"], config.rms_norm_eps)
  q, k, v = qkv_projections(config, lp, h)
  q = q.reshape(b, t, hq, dh)
  k = k.reshape(b, t, hkv, dh)
  v = v.reshape(b, t, hkv, dh)
  if config.qk_norm:
    q = rms_norm(q, lp["q_norm"], config.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], config.rms_norm_eps)
  q = apply_rope(q, positions, tables=rope)
  k = apply_rope(k, positions, tables=rope)
  k_cache = write_rows(k_cache, layer, k, offsets, head_major)
  v_cache = write_rows(v_cache, layer, v, offsets, head_major)
  attn = attention(config if attention_spec is None else attention_spec, q, k_cache, v_cache,
                   offsets + t, tree_mask, head_major, layer=layer)
  x = x + out_projection(lp, attn.reshape(b, t, hq * dh))
  h = rms_norm(x, lp["mlp_norm"], config.rms_norm_eps)
  x = x + swiglu_mlp(lp, h)
  return x, k_cache, v_cache


def forward(params, config, tokens, cache: KVCache, offsets, *,
            positions=None, tree_mask=None, return_layers: Sequence[int] = (),
            logits_index=None) -> ForwardOutput:
  """sj.forward for llama-family configs (spec_jax.models.transformer.forward: the arguments,
  shapes and ForwardOutput). params: the module docstring's layout, canonical or execution;
  cache: init_cache's KVCache [L, B, S, Hkv, Dh] (either layout), S >= offsets + T."""
  b, t = tokens.shape
  offsets = offsets.astype(jnp.int32)
  attention_spec = None
  if positions is None:
    positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  elif config.sliding_window is not None and config.sliding_window < cache.capacity:
    # Tree nodes sit at cache slots past their RoPE positions: the window is applied on
    # positions here (the attention's own window counts slots and would hide prefix keys a node
    # at depth d < its slot index must see), as the Gemma family does.
    tree_mask = windowed_tree_mask(offsets + t, t, cache.capacity, tree_mask, positions,
                                   config.sliding_window)
    attention_spec = AttentionSpec(config.attention_impl)
  inv_freq = rope_inv_freq(config)
  rope = rope_tables(positions, inv_freq)
  x = embed(params, tokens).astype(activation_dtype(config))
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
                                    inv_freq, layer=layer, rope=rope, head_major=cache.head_major,
                                    attention_spec=attention_spec)
    x = residual_boundary(x)
    if layer in wanted:
      layer_hidden[layer] = x
  hidden = rms_norm(x, params["final_norm"], config.rms_norm_eps)
  logits = lm_head(params, config, select_rows(hidden, logits_index))
  return ForwardOutput(logits, hidden, tuple(layer_hidden[i] for i in return_layers),
                       KVCache(k=k_all, v=v_all, head_major=cache.head_major))


def init_cache(config, batch: int, capacity: int, head_major=None) -> KVCache:
  """KVCache with one stacked buffer k, v [L, B, S, Hkv, Dh] (head_major: [L, B, Hkv, S, Dh])."""
  groups = [(config.num_layers, config.num_kv_heads, config.head_dim)]
  return KVCache.of_groups(config, batch, capacity, groups, head_major, stacked=True)


# ----------------------------------------------------------------------------- init

def init_params(config, key) -> dict:
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


def num_params(config) -> int:
  """Parameter count (the embedding counted once when tied)."""
  d, f, v, l = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_layers
  hq, hkv, dh = config.num_heads, config.num_kv_heads, config.head_dim
  per_layer = d * dh * (hq + 2 * hkv) + hq * dh * d + 3 * d * f + 2 * d
  if config.qkv_bias:
    per_layer += (hq + 2 * hkv) * dh
  if config.qk_norm:
    per_layer += 2 * dh
  return v * d * (1 if config.tie_embeddings else 2) + l * per_layer + d
