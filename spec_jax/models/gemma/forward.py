"""The Gemma family's forward (Gemma 3, Gemma 4 text decoders): params, layers, cache.

What the family record (spec_jax.models.gemma) points to: `forward`, `init_params`,
`init_cache` (a KVCache with one buffer per attention type, plan.py's cache groups).

Params (a list of per-layer dicts: layers differ in shape, see plan.py):

  embed [V, D]                                  final_norm [D]        lm_head [D, V] (untied)
  layers[i]/
    attn_norm, post_attn_norm, mlp_norm, post_mlp_norm [D]     (the four sandwich norms)
    wq [D, Hq*Dh_i]  q_norm [Dh_i]  wo [Hq*Dh_i, D]
    wk [D, Hkv_i*Dh_i]  k_norm [Dh_i]  wv [D, Hkv_i*Dh_i]      (layers with their own K/V;
                                                                no wv on k_eq_v layers)
    w_gate, w_up [D, F_i]  w_down [F_i, D]
    ple_gate [D, P]  ple_proj [P, D]  ple_norm [D]             (per-layer embeddings, P > 0)
    layer_scalar [1]                                           (Gemma 4)
  embed_per_layer [V_ple, L*P]  per_layer_proj [D, L*P]  per_layer_proj_norm [P]   (PLE)

Norm weights are stored as in the checkpoints (Gemma 3's x_hat * (1 + w) adds the 1 here).

One layer (x the residual stream, dtype = config.dtype; every dot accumulates in float32):

  h = norm(x);  q = rope(q_norm(h Wq)) * scale-correction
  k = rope(k_norm(h Wk)), v = v_norm(h Wv or h Wk)     -> cache (skipped on KV-shared layers)
  x = x + post_attn_norm(attention(q, cache of the layer's KV source) Wo)
  x = x + post_mlp_norm(down(gelu_tanh(gate h') * up h')),  h' = mlp_norm(x)
  x = x + ple_norm(ple_proj(gelu_tanh(x ple_gate) * ple_i))    (PLE)
  x = x * layer_scalar                                          (Gemma 4)

Attention goes through kernels_pallas.verify_attention (via blocks.attention, so the
Pallas kernels run where they apply): the Gemma scale (query_pre_attn_scalar ** -0.5, or 1.0)
is folded into q. Sliding layers see keys at positions > position - window; with explicit
positions (tree drafts, whose slots run ahead of their positions) the window is applied on
positions through a full-width tree mask, so trees stay exact past the window.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from spec_jax.models.blocks import (AttentionSpec, ForwardOutput, apply_rope, attention, lm_head,
                                    residual_boundary, rope_tables, select_rows,
                                    windowed_tree_mask)
from spec_jax.models.cache import KVCache, write_rows
from spec_jax.models.gemma import plan as gemma_plan
from spec_jax.models.gemma.plan import SLIDING
from spec_jax.models.matmul import activation_dtype


def dot(x, w):
  """x [..., in] @ w [in, out], accumulated in float32 (returns float32)."""
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


def norm(x, weight, eps: float, plus_one: bool = False):
  """RMSNorm in float32 -> float32: x_hat * w (Gemma 4), x_hat * (1 + w) (Gemma 3), or x_hat
  alone (weight None: Gemma 4's v-norm)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if weight is None:
    return x32
  w = weight.astype(jnp.float32)
  return x32 * (1.0 + w if plus_one else w)


def activation(config, x):
  """GELU (tanh approximation) or SiLU, computed in float32 and rounded once to x's dtype (what
  PyTorch's bf16 kernels do; a bf16 tanh polynomial would round at every step)."""
  x32 = x.astype(jnp.float32)
  y = jax.nn.gelu(x32, approximate=True) if config.hidden_act == "gelu_tanh" else jax.nn.silu(x32)
  return y.astype(x.dtype)


def embed_tokens(params, config, tokens):
  """The scaled input embedding [B, T, D] in config.dtype (sqrt(D) cast to the table's dtype
  first, as the checkpoints' ScaledWordEmbedding does)."""
  table = params["embed"]
  x = jnp.take(table, tokens, axis=0)
  if config.embed_scale:
    x = x * jnp.asarray(math.sqrt(config.hidden_size), jnp.float32).astype(table.dtype)
  return x.astype(jnp.dtype(activation_dtype(config)))


def per_layer_inputs(params, config, tokens, x):
  """PLE: (norm(x W_proj / sqrt(D)) + E_ple[tokens] * sqrt(P)) / sqrt(2) -> [B, T, L, P]."""
  b, t = tokens.shape
  size, dtype = config.per_layer_input_size, x.dtype
  table = params["embed_per_layer"]
  scale = jnp.asarray(math.sqrt(size), jnp.float32).astype(table.dtype)
  ids = jnp.take(table, tokens, axis=0, mode="clip") * scale
  ids = ids.astype(dtype).reshape(b, t, config.num_layers, size)
  proj = dot(x, params["per_layer_proj"]).astype(dtype) * (config.hidden_size ** -0.5)
  proj = proj.reshape(b, t, config.num_layers, size)
  proj = norm(proj, params["per_layer_proj_norm"], config.rms_norm_eps).astype(dtype)
  return ((proj + ids) * (2.0 ** -0.5)).astype(dtype)


def attend(config, plan, q, k_layer, v_layer, kv_lengths, tree_mask, head_major: bool,
           wide_mask=None, layer=None):
  """One layer's verify attention. q [B, T, Hq, Dh] already scaled for the reference's
  Dh ** -0.5; wide_mask: windowed_tree_mask for sliding layers with explicit positions.
  layer: k_layer, v_layer are a group's stacked buffers and this the slot read (in place)."""
  if wide_mask is not None:
    return attention(AttentionSpec(config.attention_impl), q, k_layer, v_layer, kv_lengths,
                     wide_mask, head_major, layer=layer)
  return attention(AttentionSpec(config.attention_impl, plan.window), q, k_layer, v_layer,
                   kv_lengths, tree_mask, head_major, layer=layer)


def q_scale(config, head_dim: int) -> float:
  """What q is multiplied by so that the reference's head_dim ** -0.5 gives the Gemma scale."""
  scale = config.attention_scale
  return 1.0 if scale is None else float(scale) * math.sqrt(head_dim)


def project_q(config, plan, lp, h, rope):
  """q [B, T, Hq, Dh] in h's dtype: q_norm, the scale correction, RoPE (all in float32)."""
  b, t, _ = h.shape
  q = dot(h, lp["wq"]).astype(h.dtype).reshape(b, t, config.num_heads, plan.head_dim)
  q = norm(q, lp["q_norm"], config.rms_norm_eps, config.norm_plus_one)
  c = q_scale(config, plan.head_dim)
  if c != 1.0:
    q = q * c
  return apply_rope(q, None, tables=rope).astype(h.dtype)


def project_kv(config, plan, lp, h, rope):
  """k, v [B, T, Hkv, Dh] in h's dtype (k_eq_v: V is k_proj's output, before k_norm)."""
  b, t, _ = h.shape
  shape = (b, t, plan.num_kv_heads, plan.head_dim)
  k_raw = dot(h, lp["wk"]).astype(h.dtype).reshape(shape)
  v = k_raw if plan.k_eq_v else dot(h, lp["wv"]).astype(h.dtype).reshape(shape)
  k = norm(k_raw, lp["k_norm"], config.rms_norm_eps, config.norm_plus_one)
  k = apply_rope(k, None, tables=rope).astype(h.dtype)
  if config.v_norm:
    v = norm(v, None, config.rms_norm_eps).astype(h.dtype)
  return k, v


def mlp(config, lp, h):
  gate = dot(h, lp["w_gate"]).astype(h.dtype)
  up = dot(h, lp["w_up"]).astype(h.dtype)
  return dot(activation(config, gate) * up, lp["w_down"]).astype(h.dtype)


def decoder_layer(config, plan, lp, x, rope, k_bufs, v_bufs, offsets, tree_mask, head_major,
                  ple_input=None, wide_mask=None):
  """One Gemma block (module docstring). k_bufs, v_bufs: the cache's per-group tuples; this
  layer writes its slot (unless KV-shared) and reads its KV source's. Returns (x, k_bufs,
  v_bufs)."""
  eps, plus_one, dtype = config.rms_norm_eps, config.norm_plus_one, x.dtype
  b, t, _ = x.shape
  g, slot = plan.cache_group, plan.cache_slot
  h = norm(x, lp["attn_norm"], eps, plus_one).astype(dtype)
  q = project_q(config, plan, lp, h, rope)
  if not plan.kv_shared:
    k, v = project_kv(config, plan, lp, h, rope)
    k_bufs = k_bufs[:g] + (write_rows(k_bufs[g], slot, k, offsets, head_major),) + k_bufs[g + 1:]
    v_bufs = v_bufs[:g] + (write_rows(v_bufs[g], slot, v, offsets, head_major),) + v_bufs[g + 1:]
  attn = attend(config, plan, q, k_bufs[g], v_bufs[g], offsets + t, tree_mask, head_major,
                wide_mask, layer=slot)
  o = dot(attn.reshape(b, t, config.num_heads * plan.head_dim), lp["wo"]).astype(dtype)
  x = x + norm(o, lp["post_attn_norm"], eps, plus_one).astype(dtype)
  h = norm(x, lp["mlp_norm"], eps, plus_one).astype(dtype)
  x = x + norm(mlp(config, lp, h), lp["post_mlp_norm"], eps, plus_one).astype(dtype)
  if ple_input is not None:
    gate = activation(config, dot(x, lp["ple_gate"]).astype(dtype)) * ple_input
    y = dot(gate, lp["ple_proj"]).astype(dtype)
    x = x + norm(y, lp["ple_norm"], eps).astype(dtype)
  if config.layer_scalar:
    x = x * lp["layer_scalar"].astype(dtype)
  return x, k_bufs, v_bufs


def rope_by_type(config, positions) -> dict:
  """{layer_type: (cos, sin)} tables [B, T, 1, Dh_type], shared by the layers of a type."""
  return {t: rope_tables(positions, gemma_plan.rope_inv_freq(config, t))
          for t in sorted(set(config.layer_types))}


def forward(params, config, tokens, cache: KVCache, offsets, *, positions=None,
            tree_mask=None, return_layers=(), logits_index=None):
  """sj.forward for Gemma configs (same arguments, same ForwardOutput; cache from init_cache).
  logits [B, T, V] float32 (soft-capped when the config says so); hidden [B, T, D] after the
  final norm; logits_index int32 [B]: logits [B, 1, V] of that token only."""
  if not (isinstance(cache, KVCache) and isinstance(cache.k, tuple)):
    raise ValueError(f"a {config.model_type} forward needs the Gemma KV cache "
                     f"(sj.KVCache.zeros(config, B, S)), got {type(cache).__name__}")
  b, t = tokens.shape
  offsets = offsets.astype(jnp.int32)
  explicit_positions = positions is not None
  if positions is None:
    positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  rope = rope_by_type(config, positions)
  x = embed_tokens(params, config, tokens)
  ple = per_layer_inputs(params, config, tokens, x) if config.per_layer_input_size else None
  plans = gemma_plan.layout(config).layers
  wide = None
  if explicit_positions and SLIDING in config.layer_types:
    s = cache.capacity
    if config.sliding_window < s:
      wide = windowed_tree_mask(offsets + t, t, s, tree_mask, positions, config.sliding_window)
  k_bufs, v_bufs = tuple(cache.k), tuple(cache.v)
  wanted = set(int(i) for i in return_layers)
  layer_hidden = {}
  for plan in plans:
    lp = params["layers"][plan.index]
    x, k_bufs, v_bufs = decoder_layer(
        config, plan, lp, x, rope[plan.layer_type], k_bufs, v_bufs, offsets, tree_mask,
        cache.head_major, None if ple is None else ple[:, :, plan.index],
        wide if plan.layer_type == SLIDING else None)
    x = residual_boundary(x)
    if plan.index in wanted:
      layer_hidden[plan.index] = x
  hidden = norm(x, params["final_norm"], config.rms_norm_eps, config.norm_plus_one)
  hidden = hidden.astype(x.dtype)
  logits = lm_head(params, config, select_rows(hidden, logits_index))
  return ForwardOutput(logits, hidden, tuple(layer_hidden[i] for i in return_layers),
                       KVCache(k=k_bufs, v=v_bufs, head_major=cache.head_major))


def init_cache(config, batch: int, capacity: int, head_major=None) -> KVCache:
  """KVCache whose k, v are tuples over plan.layout(config).groups of [L_g, B, S, Hkv_g, Dh_g]
  buffers (head_major: [L_g, B, Hkv_g, S, Dh_g]): layers of different KV shapes apart, the
  KV-shared layers without buffers of their own."""
  groups = [(g.num_layers, g.num_kv_heads, g.head_dim) for g in gemma_plan.layout(config).groups]
  return KVCache.of_groups(config, batch, capacity, groups, head_major)


# ----------------------------------------------------------------------------- init

def init_params(config, key) -> dict:
  """Random weights (normal, std 0.02; norms at their identity: 0 for Gemma 3's 1 + w, else 1)
  in the module docstring's layout."""
  c = config
  d, dtype = c.hidden_size, jnp.dtype(c.dtype)
  keys = iter(jax.random.split(key, 8 + 16 * c.num_layers))
  unit = jnp.zeros if c.norm_plus_one else jnp.ones

  def normal(shape, std=0.02):
    return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  layers = []
  for p in gemma_plan.layout(c).layers:
    q_width = c.num_heads * p.head_dim
    lp = {"attn_norm": unit((d,), dtype), "post_attn_norm": unit((d,), dtype),
          "mlp_norm": unit((d,), dtype), "post_mlp_norm": unit((d,), dtype),
          "wq": normal((d, q_width)), "q_norm": unit((p.head_dim,), dtype),
          "wo": normal((q_width, d)), "w_gate": normal((d, p.intermediate_size)),
          "w_up": normal((d, p.intermediate_size)), "w_down": normal((p.intermediate_size, d))}
    if not p.kv_shared:
      lp["wk"] = normal((d, p.num_kv_heads * p.head_dim))
      lp["k_norm"] = unit((p.head_dim,), dtype)
      if not p.k_eq_v:
        lp["wv"] = normal((d, p.num_kv_heads * p.head_dim))
    if c.per_layer_input_size:
      lp["ple_gate"] = normal((d, c.per_layer_input_size))
      lp["ple_proj"] = normal((c.per_layer_input_size, d))
      lp["ple_norm"] = jnp.ones((d,), dtype)
    if c.layer_scalar:
      lp["layer_scalar"] = jnp.ones((1,), dtype)
    layers.append(lp)
  params = {"embed": normal((c.vocab_size, d)), "layers": layers,
            "final_norm": unit((d,), dtype)}
  if not c.tie_embeddings:
    params["lm_head"] = normal((d, c.vocab_size))
  if c.per_layer_input_size:
    width = c.num_layers * c.per_layer_input_size
    params["embed_per_layer"] = normal((c.per_layer_vocab_size, width))
    params["per_layer_proj"] = normal((d, width))
    params["per_layer_proj_norm"] = jnp.ones((c.per_layer_input_size,), dtype)
  return params
