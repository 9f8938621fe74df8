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
cache (in place: a scatter on the stacked cache, no copy) and attends through
`kernels_pallas.verify_attention`.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas
from kernels_pallas.layout import MAX_NEW_TOKENS
from kernels_pallas.reference import verify_attention_reference
from spec_jax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Stacked key/value cache.

  k, v: [L, B, S, Hkv, Dh], or with head_major [L, B, Hkv, S, Dh]. Which entries are valid is
  tracked by the caller (per-row lengths); entries past a row's length are stale and masked by
  attention. The layout is the one the attention reads without relaying it out: the Pallas
  kernels' [B, S, Hkv, Dh] where a kernel runs, head-major where the jnp attention runs (CPU):
  there the [S, Hkv] layout cost a transposing copy of every layer's keys and values per step,
  ~1.3 of the 16.6 ms of a plain step of the 78M widened model (profiled; README Speed).
  """
  k: jax.Array
  v: jax.Array
  head_major: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def seq_axis(self) -> int:
    """The axis of the S cache slots in k and v."""
    return 3 if self.head_major else 2

  @property
  def capacity(self) -> int:
    return self.k.shape[self.seq_axis]

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, capacity: int,
            head_major: Optional[bool] = None) -> "KVCache":
    """head_major None: the layout config's attention reads in place (default_head_major).
    Gemma configs get their own cache (spec_jax.models.gemma_cache.GemmaKVCache: one buffer per
    attention type, since their layers differ in KV shape)."""
    if config.is_gemma:
      from spec_jax.models.gemma_cache import GemmaKVCache
      return GemmaKVCache.zeros(config, batch, capacity, head_major)
    if head_major is None:
      head_major = default_head_major(config)
    l, h, dh = config.num_layers, config.num_kv_heads, config.head_dim
    shape = (l, batch, h, capacity, dh) if head_major else (l, batch, capacity, h, dh)
    dtype = jnp.dtype(config.dtype)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), head_major=bool(head_major))

  def seq_major(self) -> "KVCache":
    """The same entries in the [L, B, S, Hkv, Dh] layout (a copy when head-major)."""
    if not self.head_major:
      return self
    return KVCache(k=jnp.swapaxes(self.k, 2, 3), v=jnp.swapaxes(self.v, 2, 3), head_major=False)


def default_head_major(config: ModelConfig) -> bool:
  """Whether config's verify attention runs the jnp path on this backend (then the cache is
  head-major), rather than a Pallas kernel (which reads [B, S, Hkv, Dh])."""
  kernel, _ = kernels_pallas.dispatch.resolve(config.attention_impl)
  return kernel is None


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


def _write_rows(cache, layer: int, new, offsets, head_major: bool = False):
  """cache [L,B,S,H,Dh] (head_major: [L,B,H,S,Dh]) <- new [B,T,H,Dh] at layer, row b, slots
  offsets[b] .. offsets[b]+T-1.

  One scatter into the stacked buffer, which XLA performs in place (slicing a layer out, updating
  it and stacking it back would copy the whole cache every layer)."""
  b, t = new.shape[:2]
  rows = jnp.arange(b, dtype=jnp.int32)[:, None]
  cols = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if head_major:   # the advanced indices (rows, cols) around the head slice index [B, T, H, Dh]
    return cache.at[layer, rows, :, cols].set(new.astype(cache.dtype), mode="drop")
  return cache.at[layer, rows, cols].set(new.astype(cache.dtype), mode="drop")


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


def _dense(x, w, transposed: bool):
  """x [..., in] times a weight stored [in, out] (transposed False) or [out, in] (True); with
  transposed, w may be a tuple of row chunks [out_i, in] (see fuse_layers' chunks): one dot
  each, concatenated along out."""
  contract = 1 if transposed else 0
  dot = lambda w: jax.lax.dot_general(x, w, (((x.ndim - 1,), (contract,)), ((), ())))
  if isinstance(w, (tuple, list)):
    return jnp.concatenate([dot(c) for c in w], axis=-1)
  return dot(w)


def _qkv_projections(config: ModelConfig, lp, h):
  """q [B,T,Hq*Dh], k, v [B,T,Hkv*Dh] from the normed input, in either param layout."""
  nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  fused_key = "wqkv_t" if "wqkv_t" in lp else ("wqkv" if "wqkv" in lp else None)
  if fused_key is not None:
    y = _dense(h, lp[fused_key], transposed=fused_key.endswith("_t"))
    if config.qkv_bias:
      y = y + lp["bqkv"]
    return y[..., :nq], y[..., nq:nq + nkv], y[..., nq + nkv:]
  q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
  if config.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  return q, k, v


def _mlp(lp, h):
  """SwiGLU: down(silu(gate h) * up h), in either param layout."""
  if "w_gu_t" in lp or "w_gu" in lp:
    transposed = "w_gu_t" in lp
    gu = _dense(h, lp["w_gu_t" if transposed else "w_gu"], transposed)
    gate, up = jnp.split(gu, 2, axis=-1)
    inner = jax.nn.silu(gate) * up
  else:
    inner = jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])
  if "w_down_t" in lp:
    return _dense(inner, lp["w_down_t"], True)
  return inner @ lp["w_down"]


def _out_projection(lp, attn):
  if "wo_t" in lp:
    return _dense(attn, lp["wo_t"], True)
  return attn @ lp["wo"]


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
  """hidden [..., D] (after the final norm) -> float32 logits [..., V] (soft-capped,
  c * tanh(logits / c), when config.final_logit_softcap is set: Gemma)."""
  if config.tie_embeddings:
    w, transposed = params["embed"], True                # [V, D]
  elif "lm_head_t" in params:
    w, transposed = params["lm_head_t"], True            # execution layout [V, D]
  else:
    w, transposed = params["lm_head"], False             # [D, V]
  logits = jax.lax.dot_general(hidden, w, (((hidden.ndim - 1,), (1 if transposed else 0,)),
                                           ((), ())), preferred_element_type=jnp.float32)
  if config.final_logit_softcap is not None:
    cap = float(config.final_logit_softcap)
    logits = cap * jnp.tanh(logits / cap)
  return logits


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

  Gemma configs run spec_jax.models.gemma.forward (same arguments; their cache is a
  GemmaKVCache from KVCache.zeros).
  """
  if config.is_gemma:
    from spec_jax.models import gemma
    return gemma.forward(params, config, tokens, cache, offsets, positions=positions,
                         tree_mask=tree_mask, return_layers=return_layers)
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


def unstack_layers(params):
  """The same params with `layers` as a list of per-layer dicts (forward accepts both).

  XLA:CPU materialises a static slice of a stacked weight that feeds a dot: inside a decode
  loop every step would copy every layer's weights before reading them again (measured: about
  half the speed of a weight-streaming loop). Unstacking once per generate() call, outside the
  loop, costs one copy of the weights per call instead of one per token.
  """
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return params
  num_layers = jax.tree.leaves(layers)[0].shape[0]
  out = dict(params)
  out["layers"] = [jax.tree.map(lambda w: w[i], layers) for i in range(num_layers)]
  return out


def fuse_layers(layers, transpose: bool, chunks: int = 1):
  """Stacked canonical layer weights -> the fused execution layout (same math).

  wq|wk|wv -> wqkv [L, D, (Hq+2Hkv)Dh] (bq|bk|bv -> bqkv), w_gate|w_up -> w_gu [L, D, 2F]; with
  transpose, every projection is stored [out, in] under a `_t` name (wqkv_t, wo_t, w_gu_t,
  w_down_t): XLA:CPU's dot reads a weight whose contraction axis is the last one 23-45 % faster
  at the T = 1..17 rows of decode and verify (a measured microbenchmark, DESIGN.md).
  chunks > 1 (with transpose): each `_t` weight becomes a tuple of `chunks` row blocks
  [L, out/chunks, in] (fewer where out does not divide): XLA:CPU runs one small-M dot on one
  thread, but independent dots concurrently, so a projection split into row blocks streams its
  weights on every core (cpu_weight_chunks).
  """
  out = {k: v for k, v in layers.items()
         if k not in ("wq", "wk", "wv", "bq", "bk", "bv", "wo", "w_gate", "w_up", "w_down")}
  wqkv = jnp.concatenate([layers["wq"], layers["wk"], layers["wv"]], axis=-1)
  w_gu = jnp.concatenate([layers["w_gate"], layers["w_up"]], axis=-1)
  if "bq" in layers:
    out["bqkv"] = jnp.concatenate([layers["bq"], layers["bk"], layers["bv"]], axis=-1)
  if transpose:
    t = lambda w: _row_chunks(jnp.swapaxes(w, -1, -2), chunks)
    out.update(wqkv_t=t(wqkv), wo_t=t(layers["wo"]), w_gu_t=t(w_gu), w_down_t=t(layers["w_down"]))
  else:
    out.update(wqkv=wqkv, wo=layers["wo"], w_gu=w_gu, w_down=layers["w_down"])
  return out


def _row_chunks(w, chunks: int):
  """w [..., out, in] -> w itself (chunks 1) or a tuple of row blocks [..., out_i, in]."""
  n = w.shape[-2]
  chunks = max(1, min(int(chunks), n // 64))
  while n % chunks:
    chunks -= 1
  if chunks == 1:
    return w
  return tuple(jnp.split(w, chunks, axis=-2))


def cpu_weight_chunks() -> int:
  """Row blocks per projection weight in the CPU execution layout: $SPEC_JAX_CPU_WEIGHT_CHUNKS,
  default 1 (whole weights). A matmul-only microbenchmark on the 2-core machine (48 fp32
  weights, 302 MB) ran 25-40 % faster with 2-4 row blocks at T = 1..9, but whole decode and
  verify forwards of the 78M widened model showed no gain (T = 1: 19.9 / 23.2 / 21.9 ms with
  1 / 2 / 4 blocks, noisy), so the option stays off until a quiet measurement says otherwise."""
  env = os.environ.get("SPEC_JAX_CPU_WEIGHT_CHUNKS")
  return max(1, int(env)) if env else 1


def prepare_params(params, config: ModelConfig, mesh=None):
  """The execution layout of `params` for this backend: computed inside the caller's jit once
  per call, outside any decode loop (forward, decoder_layer and lm_head accept both layouts).

  Without a mesh: q/k/v and gate/up fused into one matmul each (fuse_layers); on CPU also every
  projection stored [out, in] and the layers unstacked (see unstack_layers). With a mesh the
  canonical weights are kept (their partition table splits whole heads), unstacked on CPU.
  Already-prepared params are returned unchanged. Gemma configs: gemma.prepare_params.
  """
  if config.is_gemma:
    from spec_jax.models import gemma
    return gemma.prepare_params(params, config, mesh)
  layers = params["layers"]
  if isinstance(layers, (list, tuple)) or "wqkv" in layers or "wqkv_t" in layers:
    return params
  cpu = jax.default_backend() == "cpu"
  if mesh is None:
    out = dict(params)
    out["layers"] = fuse_layers(layers, transpose=cpu, chunks=cpu_weight_chunks() if cpu else 1)
    if cpu and "lm_head" in out:
      out["lm_head_t"] = jnp.swapaxes(out.pop("lm_head"), 0, 1)
    params = out
  return unstack_layers(params) if cpu else params


# ----------------------------------------------------------------------------- init

def init_params(config: ModelConfig, key) -> dict:
  """Random weights (normal, std 0.02; norms at 1) in the layout of the module docstring
  (Gemma configs: gemma.init_params's layout)."""
  if config.is_gemma:
    from spec_jax.models import gemma
    return gemma.init_params(config, key)
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
