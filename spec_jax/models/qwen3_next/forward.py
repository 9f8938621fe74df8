"""The hybrid family's forward (Qwen3-Next, Qwen3.5 text): params, layers, forward.

Params (a list of per-layer dicts: the two kinds differ; norms zero-centred, x_hat * (1 + w),
except the gated norm's plain w):

  embed [V, D]     final_norm [D]     lm_head [D, V] (untied)
  layers[i]/ attn_norm, mlp_norm [D]
    linear_attention (Gated DeltaNet, C = 2 Hk Dk + Hv Dv conv channels):
      w_qkv [D, C] (q | k | v, the conv's channel order)   w_z [D, Hv Dv]   w_b, w_a [D, Hv]
      conv_w [C, W]   dt_bias, A_log [Hv]   gnorm [Dv]   w_out [Hv Dv, D]
    full_attention (gated): wq [D, Hq 2 Dh] (per head: Dh query dims then Dh gate dims, the
      checkpoint's q_proj), wk, wv [D, Hkv Dh], wo [Hq Dh, D], q_norm, k_norm [Dh]
    MLP, dense: w_gate, w_up [D, F], w_down [F, D]
    MLP, sparse (Qwen3-Next MoE): router [D, E], experts_gate, experts_up [E, D, Fe],
      experts_down [E, Fe, D], shared_gate, shared_up [D, Fs], shared_down [Fs, D],
      shared_expert_gate [D, 1]

One layer: x += mixer(norm(x)); x += mlp(norm(x)), with
  Gated DeltaNet (Qwen3NextGatedDeltaNet.forward): qkv = conv(h W_qkv) (causal, SiLU), beta =
    sigmoid(h W_b), g = -exp(A_log) softplus(h W_a + dt_bias), o = delta rule (deltanet.py),
    out = (gated_rms_norm(o, h W_z)) W_out
  gated attention (Qwen3NextAttention.forward): q, gate = split(h Wq per head); q, k
    q/k-normed, partial RoPE on the first rotary_dim dims; out = (attn(q, k, v) *
    sigmoid(gate)) Wo
  MoE (Qwen3NextSparseMoeBlock): softmax router, top-k (renormalised when norm_topk_prob),
    every expert computed densely and weighted (zero weight off the top-k), plus the shared
    expert times sigmoid(h w_shared_gate)

Prefill vs verify: a forward with logits_index (the chunked prefill) runs the chunked delta
rule and absorbs only the first logits_index[b] + 1 tokens of row b into the recurrent state
and conv window (-1: none; the rest are the right padding); a forward over T <= VERIFY_SLOTS
tokens without it (a verify or a decode step) runs the recurrent form and records the state
and conv inputs after every position (cache.HybridCache.*_steps) for commit_cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax.models.blocks import (AttentionSpec, ForwardOutput, attention, lm_head,
                                    residual_boundary, rope_tables, select_rows)
from spec_jax.models.cache import KVCache, write_rows
from spec_jax.models.matmul import activation_dtype
from spec_jax.models.qwen3_next import deltanet
from spec_jax.models.qwen3_next import plan as hplan
from spec_jax.models.qwen3_next.cache import VERIFY_SLOTS, HybridCache
from spec_jax.models.qwen3_next.plan import LINEAR


def dot(x, w):
  """x [..., in] @ w [in, out], accumulated in float32 (returns float32)."""
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


def norm(x, weight, eps: float):
  """Zero-centred RMSNorm (Qwen3NextRMSNorm): x_hat * (1 + w) in float32, cast to x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def partial_rope(x, cos, sin):
  """x [B, T, H, Dh] with its first r dims rotated (rotate_half layout over r, cos/sin
  [B, T, 1, r]); the rest pass (apply_rotary_pos_emb with a partial rotary_dim)."""
  r = cos.shape[-1]
  rot, rest = x[..., :r].astype(jnp.float32), x[..., r:]
  x1, x2 = jnp.split(rot, 2, axis=-1)
  rot = rot * cos + jnp.concatenate([-x2, x1], -1) * sin
  return jnp.concatenate([rot.astype(x.dtype), rest], axis=-1)


def linear_mixer(config, lp, h, state, window, valid, record: bool):
  """One Gated DeltaNet. h [B, T, D]; state [B, Hv, Dk, Dv] f32; window [B, W-1, C]; valid
  int32 [B], how many of the T tokens enter the state (the rest: g = beta = 0, no change).
  Returns (out [B, T, D], state, window, steps or None: (states [B, T, Hv, Dk, Dv], conv
  inputs [B, W-1+T, C]))."""
  c, dtype = config, h.dtype
  b, t, _ = h.shape
  s = hplan.linear_sizes(c)
  hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
  dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
  mixed = dot(h, lp["w_qkv"]).astype(dtype)
  z = dot(h, lp["w_z"]).astype(dtype).reshape(b, t, hv, dv)
  beta = jax.nn.sigmoid(dot(h, lp["w_b"]).astype(dtype))
  a = dot(h, lp["w_a"]).astype(dtype)
  conv, ext = deltanet.causal_conv(window, mixed, lp["conv_w"])
  q = conv[..., :s["key_dim"]].reshape(b, t, hk, dk)
  k = conv[..., s["key_dim"]:2 * s["key_dim"]].reshape(b, t, hk, dk)
  v = conv[..., 2 * s["key_dim"]:].reshape(b, t, hv, dv)
  g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * jax.nn.softplus(
      a.astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
  keep = jnp.arange(t)[None, :] < valid[:, None]                      # [B, T]
  g = jnp.where(keep[..., None], g, 0.0)
  beta = jnp.where(keep[..., None], beta, jnp.zeros_like(beta))
  steps = None
  if t <= VERIFY_SLOTS:
    o, states = deltanet.gated_delta_recurrent(q, k, v, g, beta, state)
    state = states[-1]
    if record:
      steps = (jnp.moveaxis(states, 0, 1), ext)
  else:
    o, state = deltanet.gated_delta_chunked(q, k, v, g, beta, state)
  o = deltanet.gated_rms_norm(o.astype(dtype), z, lp["gnorm"], c.rms_norm_eps)
  out = dot(o.reshape(b, t, hv * dv), lp["w_out"]).astype(dtype)
  window = deltanet.window_of(ext, valid, ext.shape[1] - t).astype(window.dtype)
  return out, state, window, steps


def attention_mixer(config, lp, h, rope, kv: KVCache, slot: int, offsets):
  """Gated full attention over the KV cache; writes this layer's K/V at offsets. Returns
  (out [B, T, D], kv)."""
  c, dtype = config, h.dtype
  b, t, _ = h.shape
  hq, hkv, dh = c.num_heads, c.num_kv_heads, c.head_dim
  qg = dot(h, lp["wq"]).astype(dtype).reshape(b, t, hq, 2 * dh)
  q, gate = qg[..., :dh], qg[..., dh:].reshape(b, t, hq * dh)
  q = norm(q, lp["q_norm"], c.rms_norm_eps)
  k = norm(dot(h, lp["wk"]).astype(dtype).reshape(b, t, hkv, dh), lp["k_norm"], c.rms_norm_eps)
  v = dot(h, lp["wv"]).astype(dtype).reshape(b, t, hkv, dh)
  cos, sin = rope
  q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
  kbuf = write_rows(kv.k, slot, k, offsets, kv.head_major)
  vbuf = write_rows(kv.v, slot, v, offsets, kv.head_major)
  attn = attention(AttentionSpec(c.attention_impl), q, kbuf, vbuf, offsets + t, None,
                   kv.head_major, layer=slot)
  attn = attn.reshape(b, t, hq * dh).astype(dtype)
  attn = (attn.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(dtype)
  return dot(attn, lp["wo"]).astype(dtype), KVCache(k=kbuf, v=vbuf, head_major=kv.head_major)


def swiglu(h, w_gate, w_up, w_down):
  gate = dot(h, w_gate).astype(h.dtype)
  up = dot(h, w_up).astype(h.dtype)
  return dot(jax.nn.silu(gate) * up, w_down).astype(h.dtype)


def moe(config, lp, h):
  """Qwen3NextSparseMoeBlock, densely: every expert on every token, weighted by the router's
  top-k (softmax in float32, renormalised over the top-k when norm_topk_prob), plus the
  sigmoid-gated shared expert. h [B, T, D] -> [B, T, D]."""
  c, dtype = config, h.dtype
  probs = jax.nn.softmax(dot(h, lp["router"]), axis=-1)                  # [B, T, E] f32
  top, idx = jax.lax.top_k(probs, c.num_experts_per_tok)
  if c.norm_topk_prob:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  top = top.astype(dtype)
  weights = jnp.sum(jax.nn.one_hot(idx, c.num_experts, dtype=dtype) * top[..., None], axis=-2)
  gate = jnp.einsum("btd,edf->btef", h, lp["experts_gate"],
                    preferred_element_type=jnp.float32).astype(dtype)
  up = jnp.einsum("btd,edf->btef", h, lp["experts_up"],
                  preferred_element_type=jnp.float32).astype(dtype)
  each = jnp.einsum("btef,efd->bted", jax.nn.silu(gate) * up, lp["experts_down"],
                    preferred_element_type=jnp.float32).astype(dtype)
  out = jnp.sum((each * weights[..., None]).astype(jnp.float32), axis=2).astype(dtype)
  if "shared_gate" in lp:
    shared = swiglu(h, lp["shared_gate"], lp["shared_up"], lp["shared_down"])
    g = jax.nn.sigmoid(dot(h, lp["shared_expert_gate"])).astype(dtype)
    out = out + g * shared
  return out


def mlp(config, plan, lp, h):
  if plan.sparse:
    return moe(config, lp, h)
  return swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"])


def embed_tokens(params, config, tokens):
  x = jnp.take(params["embed"], tokens, axis=0)
  return x.astype(jnp.dtype(activation_dtype(config)))


def forward(params, config, tokens, cache: HybridCache, offsets, *, positions=None,
            tree_mask=None, return_layers=(), logits_index=None):
  """sj.forward for hybrid configs (same arguments, same ForwardOutput; cache from init_cache).

  tokens int32 [B, T] at positions offsets[b] ..; logits [B, T, V] float32 (or [B, 1, V] at
  logits_index); hidden [B, T, D] after the final norm. logits_index (the prefill) also says
  which tokens are real: row b's first logits_index[b] + 1 (module docstring). Trees
  (positions / tree_mask) are refused: a recurrent state cannot branch."""
  if not isinstance(cache, HybridCache):
    raise ValueError(f"a {config.model_type} forward needs the hybrid cache (sj.KVCache.zeros("
                     f"config, B, S) makes it), got {type(cache).__name__}")
  if tree_mask is not None or positions is not None:
    raise ValueError(f"{config.model_type} (hybrid linear attention) cannot verify draft trees: "
                     "its recurrent state follows one sequence; use a chain")
  b, t = tokens.shape
  offsets = offsets.astype(jnp.int32)
  prefill = logits_index is not None
  valid = (jnp.clip(logits_index.astype(jnp.int32) + 1, 0, t) if prefill
           else jnp.full((b,), t, jnp.int32))
  record = (not prefill) and t <= VERIFY_SLOTS
  pos = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  rope = rope_tables(pos, hplan.rope_inv_freq(config))
  x = embed_tokens(params, config, tokens)
  kv, state, conv = cache.kv, cache.state, cache.conv
  state_steps, conv_steps = cache.state_steps, cache.conv_steps
  wanted = set(int(i) for i in return_layers)
  layer_hidden = {}
  eps = config.rms_norm_eps
  for p in hplan.layout(config).layers:
    lp = params["layers"][p.index]
    h = norm(x, lp["attn_norm"], eps)
    if p.kind == LINEAR:
      out, s_new, w_new, steps = linear_mixer(config, lp, h, state[p.slot], conv[p.slot], valid,
                                              record)
      state = state.at[p.slot].set(s_new)
      conv = conv.at[p.slot].set(w_new)
      if steps is not None:
        state_steps = state_steps.at[p.slot, :, :t].set(steps[0])
        conv_steps = conv_steps.at[p.slot, :, :steps[1].shape[1]].set(
            steps[1].astype(conv_steps.dtype))
    else:
      out, kv = attention_mixer(config, lp, h, rope, kv, p.slot, offsets)
    x = x + out
    x = x + mlp(config, p, lp, norm(x, lp["mlp_norm"], eps))
    x = residual_boundary(x)
    if p.index in wanted:
      layer_hidden[p.index] = x
  hidden = norm(x, params["final_norm"], eps)
  index = None if logits_index is None else jnp.maximum(logits_index, 0)
  logits = lm_head(params, config, select_rows(hidden, index))
  new_cache = HybridCache(kv=kv, state=state, conv=conv, state_steps=state_steps,
                          conv_steps=conv_steps)
  return ForwardOutput(logits, hidden, tuple(layer_hidden[i] for i in return_layers), new_cache)


# ----------------------------------------------------------------------------- init

def init_params(config, key) -> dict:
  """Random weights (normal std 0.02; zero-centred norms 0 = identity; gnorm 1; A_log
  log U(1, 16), dt_bias 1 as transformers initialises them) in the module docstring's layout."""
  c = config
  d, dtype = c.hidden_size, jnp.dtype(c.dtype)
  keys = iter(jax.random.split(key, 4 + 24 * c.num_layers))

  def normal(shape, std=0.02):
    return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  zeros = lambda *shape: jnp.zeros(shape, dtype)
  layers = []
  for p in hplan.layout(c).layers:
    lp = {"attn_norm": zeros(d), "mlp_norm": zeros(d)}
    if p.kind == LINEAR:
      s = hplan.linear_sizes(c)
      hv = c.linear_num_value_heads
      a = jax.random.uniform(next(keys), (hv,), jnp.float32, 1.0, 16.0)
      lp.update(w_qkv=normal((d, s["conv_dim"])), w_z=normal((d, s["value_dim"])),
                w_b=normal((d, hv)), w_a=normal((d, hv)),
                conv_w=normal((s["conv_dim"], c.linear_conv_kernel_dim), 0.3),
                dt_bias=jnp.ones((hv,), dtype), A_log=jnp.log(a).astype(dtype),
                gnorm=jnp.ones((c.linear_value_head_dim,), dtype),
                w_out=normal((s["value_dim"], d)))
    else:
      q = c.num_heads * c.head_dim
      kvw = c.num_kv_heads * c.head_dim
      lp.update(wq=normal((d, 2 * q)), wk=normal((d, kvw)), wv=normal((d, kvw)),
                wo=normal((q, d)), q_norm=zeros(c.head_dim), k_norm=zeros(c.head_dim))
    if p.sparse:
      e, fe, fs = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
      lp.update(router=normal((d, e)), experts_gate=normal((e, d, fe)),
                experts_up=normal((e, d, fe)), experts_down=normal((e, fe, d)))
      if fs:
        lp.update(shared_gate=normal((d, fs)), shared_up=normal((d, fs)),
                  shared_down=normal((fs, d)), shared_expert_gate=normal((d, 1)))
    else:
      f = c.intermediate_size
      lp.update(w_gate=normal((d, f)), w_up=normal((d, f)), w_down=normal((f, d)))
    layers.append(lp)
  params = {"embed": normal((c.vocab_size, d)), "layers": layers, "final_norm": zeros(d)}
  if not c.tie_embeddings:
    params["lm_head"] = normal((d, c.vocab_size))
  return params
