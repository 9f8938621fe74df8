"""The Gated DeltaNet token mixer's math (Yang, Kautz, Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", 2024), as transformers' Qwen3-Next / Qwen3.5 compute it.

Per value head, with a state S [Dk, Dv], l2-normalised q_t, k_t (q_t also scaled by Dk^-1/2),
decay alpha_t = exp(g_t) (g_t = -exp(A_log) softplus(a_t + dt_bias) <= 0) and learning rate
beta_t = sigmoid(b_t):

    S_t = alpha_t S_{t-1} + k_t (beta_t (v_t - alpha_t S_{t-1}^T k_t))^T        (the delta rule)
    o_t = S_t^T q_t

Two exact forms:

  gated_delta_recurrent   one step per token in a lax.scan (transformers'
                          torch_recurrent_gated_delta_rule), returning the state after every
                          position [T, B, H, Dk, Dv]: the verify, whose accepted prefix is
                          selected afterwards (forward.commit_cache)
  gated_delta_chunked     the chunked (UT-transform / WY) form over chunks of C tokens in a
                          lax.scan over chunks (transformers' torch_chunk_gated_delta_rule):
                          the prefill

A position with g = 0 and beta = 0 leaves S unchanged in both forms (alpha = 1, no write):
how right-padded prefill rows keep the state of their last real token.

The causal depthwise conv over the q/k/v channels carries the last W - 1 inputs (W the kernel):
`causal_conv` convolves [window, x] and returns the extended inputs, from which
`window_of(ext, n, W - 1)` takes the window after n more tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64      # transformers' chunk_size


def l2norm(x, eps: float = 1e-6):
  """x * rsqrt(sum(x^2) + eps) over the last axis (transformers' l2norm, FLA's)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x, z, weight, eps: float):
  """Qwen3NextRMSNormGated: rmsnorm(x) * w * silu(z), in float32, cast to x's dtype.
  x, z [..., Dv]; weight [Dv] (plain, not zero-centred)."""
  dtype = x.dtype
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  y = weight.astype(jnp.float32) * x32.astype(dtype).astype(jnp.float32)
  return (y * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)


def causal_conv(window, x, weight):
  """Depthwise causal conv + SiLU (causal_conv1d_fn / causal_conv1d_update).

  window [B, W-1, C] (the previous inputs), x [B, T, C], weight [C, W] ->
  (y [B, T, C] in x's dtype, ext [B, W-1+T, C] = [window, x]). y_t = silu(sum_j w[:, j]
  ext[t + j])."""
  w = weight.shape[1]
  t = x.shape[1]
  ext = jnp.concatenate([window.astype(x.dtype), x], axis=1)
  e32 = ext.astype(jnp.float32)
  w32 = weight.astype(jnp.float32)
  y = sum(e32[:, j:j + t, :] * w32[None, None, :, j] for j in range(w))
  return jax.nn.silu(y).astype(x.dtype), ext


def window_of(ext, n, width: int):
  """ext[b, n[b] : n[b] + width] for every row: ext [B, E, C], n int32 [B] -> [B, width, C]."""
  return jax.vmap(lambda e, k: jax.lax.dynamic_slice_in_dim(e, k, width, axis=0))(ext, n)


def _heads_first(q, k, v, g, beta):
  """Grouped heads repeated (each q/k head serves Hv / Hk consecutive value heads), float32,
  [B, H, T, ...]; q, k l2-normalised, q scaled by Dk^-1/2."""
  r = v.shape[2] // q.shape[2]
  if r > 1:
    q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)
  f = lambda x: jnp.swapaxes(x.astype(jnp.float32), 1, 2)
  q, k, v, g, beta = f(q), f(k), f(v), f(g), f(beta)
  q = l2norm(q) * (q.shape[-1] ** -0.5)
  return q, l2norm(k), v, g, beta


def gated_delta_recurrent(q, k, v, g, beta, state):
  """The step-by-step gated delta rule.

  q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv] float32.
  Returns (o [B, T, Hv, Dv] float32, states [T, B, Hv, Dk, Dv]: the state after each
  position)."""
  q, k, v, g, beta = _heads_first(q, k, v, g, beta)

  def step(s, xs):
    q_t, k_t, v_t, g_t, b_t = xs                      # [B, H, D*], [B, H]
    s = s * jnp.exp(g_t)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
    delta = (v_t - kv_mem) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, (jnp.einsum("bhkv,bhk->bhv", s, q_t), s)

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
  _, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), xs)
  return jnp.moveaxis(o, 0, 1), states               # o: [T, B, H, Dv] -> [B, T, H, Dv]


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
  """The chunked gated delta rule (torch_chunk_gated_delta_rule, step for step).

  Same arguments as gated_delta_recurrent; returns (o [B, T, Hv, Dv] float32, final state
  [B, Hv, Dk, Dv]). T is padded to a multiple of `chunk` with g = beta = 0 (no effect)."""
  q, k, v, g, beta = _heads_first(q, k, v, g, beta)
  b, h, t, dk = k.shape
  pad = (-t) % chunk
  if pad:
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
  n = (t + pad) // chunk
  v_beta, k_beta = v * beta[..., None], k * beta[..., None]
  split = lambda x: x.reshape(b, h, n, chunk, x.shape[-1])
  q, k, k_beta, v_beta = split(q), split(k), split(k_beta), split(v_beta)
  cum = jnp.cumsum(g.reshape(b, h, n, chunk), axis=-1)          # log decay from chunk start
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))               # j <= i
  pair = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
  ut = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k) * pair
  intra = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * pair
  decayed_k_beta = k_beta * jnp.exp(cum)[..., None]
  # The UT transform: (I + strictly_lower(ut))^-1 applied to v_beta and the decayed k_beta.
  solve = lambda rhs: jax.lax.linalg.triangular_solve(
      ut, rhs, left_side=True, lower=True, unit_diagonal=True)
  new_values, k_cumdecay = solve(v_beta), solve(decayed_k_beta)
  q_dec = q * jnp.exp(cum)[..., None]
  k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])[..., None, None]            # [B, H, N, 1, 1]

  def step(s, xs):
    nv, kc, qd, kd, att, cd = xs
    v_new = nv - jnp.einsum("bhck,bhkv->bhcv", kc, s)
    o = jnp.einsum("bhck,bhkv->bhcv", qd, s) + jnp.einsum("bhij,bhjv->bhiv", att, v_new)
    s = s * cd + jnp.einsum("bhck,bhcv->bhkv", kd, v_new)
    return s, o

  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, q_dec, k_dec, intra,
                                              chunk_decay))
  final, o = jax.lax.scan(step, state.astype(jnp.float32), xs)   # o [N, B, H, C, Dv]
  o = jnp.moveaxis(o, 0, 2).reshape(b, h, n * chunk, -1)[:, :, :t]
  return jnp.swapaxes(o, 1, 2), final
