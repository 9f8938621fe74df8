"""The building blocks the families' forwards share: norms, RoPE, the verify attention over a
cache layer, the projections (in any execution layout, accumulated in f32 for bf16), the
embedding and the LM head. spec_jax.models.llama and spec_jax.models.gemma assemble them into
layers; draft heads build their own layers from them.

The blocks read a few config fields only (duck-typed: a ModelConfig, or an AttentionSpec where
a layer's attention differs from the model's)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas
from kernels_pallas import lanes, platform
from kernels_pallas.blocked import BLOCK, verify_attention_blocked
from kernels_pallas.layout import MAX_NEW_TOKENS
from kernels_pallas.reference import verify_attention_reference, visibility
from spec_jax.models import matmul


class AttentionSpec(NamedTuple):
  """What `attention` reads of a config, for one layer: the impl (ModelConfig.attention_impl)
  and the sliding window (None: full attention)."""
  attention_impl: str
  sliding_window: Optional[int] = None


class ForwardOutput(NamedTuple):
  """logits [B,T,V] float32; hidden [B,T,D] (after the final norm, what the LM head reads);
  layer_hidden: tuple of [B,T,D], the residual stream after each requested layer;
  cache: the updated KVCache."""
  logits: jax.Array
  hidden: jax.Array
  layer_hidden: tuple
  cache: Any


# ----------------------------------------------------------------------------- building blocks

def rms_norm(x, weight, eps):
  """RMSNorm in float32, cast back to x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(config) -> np.ndarray:
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




def attention(config, q, k_layer, v_layer, kv_lengths, tree_mask, head_major: bool = False,
              layer: Optional[int] = None):
  """Verify attention of q [B,T,Hq,Dh] over one layer's cache, [B,S,Hkv,Dh] or (head_major)
  [B,Hkv,S,Dh] (or lane-packed [B,Hkv/p,S,p*Dh], kernels_pallas.lanes) -> [B,T,Hq,Dh];
  kv_lengths, tree_mask as kernels_pallas.verify_attention's.
  config: a ModelConfig or an AttentionSpec (attention_impl, sliding_window).

  layer: k_layer, v_layer are the stacked caches [L, B, ...] and `layer` (a static int) the
  slab attended to. On TPU the kernel and the blocked prefill read it in place: the cache
  kernels (kernels_pallas.kv_write_tpu) keep the stack row-major, and a slab sliced out and
  handed to a custom call or a loop was a copy of that layer's K and V every call. Elsewhere
  the slab is sliced here."""
  if layer is not None:
    stacked = (k_layer, v_layer)
    k_layer, v_layer = k_layer[layer], v_layer[layer]
  s = k_layer.shape[2 if head_major else 1]
  window = config.sliding_window
  needs_window = window is not None and window < s
  # A lane-packed cache (kernels_pallas.lanes, the TPU kernel's layout for head_dim < 128) is
  # read packed by the TPU kernel and by the blocked jnp attention (block by block); the
  # reference and the GPU kernel get the layer's slab unpacked (_jnp_attention, dispatch).
  if not _kernel_path(config, q, s, tree_mask):
    # Prefill and sliding-window attention take the jnp path; the kernel is for small T (draft
    # trees: up to its 64 new tokens) with a square tree mask.
    if layer is not None and q.shape[-1] % 128 == 0:
      # Key blocks sliced straight out of the stacked cache. (With a head_dim below the 128
      # lanes XLA:TPU lays whatever the loop's dots read out transposed: handed the stack it
      # copied the whole stack per layer, 512 MiB for Llama-3.2-1B's cache at B = 8,
      # S = 4096; handed a slab, one slab. A lane-packed stack handed whole measured
      # more temporaries per chip than its slab (15 MiB, the 1B draft model under model=4).)
      return _jnp_attention(q, *stacked, kv_lengths, tree_mask,
                            window if needs_window else None, head_major, layer=layer)
    return _jnp_attention(q, k_layer, v_layer, kv_lengths, tree_mask,
                          window if needs_window else None, head_major)
  if kernels_pallas.dispatch.resolve(config.attention_impl)[0] is None:   # no kernel here (CPU)
    return _jnp_attention(q, k_layer, v_layer, kv_lengths, tree_mask, None, head_major)
  if layer is not None and head_major and platform.current() == "tpu":
    # The TPU write kernel keeps the stacked cache in its row-major layout, so the attention
    # kernel reads slab `layer` of it in place (a slice would be a copy per call).
    return _kernel_attention(config, q, *stacked, kv_lengths, tree_mask, head_major,
                             layer=layer)
  return _kernel_attention(config, q, k_layer, v_layer, kv_lengths, tree_mask, head_major)


def windowed_tree_mask(kv_lengths, t: int, s: int, tree_mask, positions, window: int):
  """bool [B, T, S]: which cache slots each new query sees, with the sliding window applied on
  RoPE positions (key slot > query position - window), in verify_attention_reference's
  full-width tree-mask encoding (entry j = cache slot kv_lengths - S + j).

  Tree nodes sit at slots past their positions; the reference's own window counts slots, which
  would hide prefix keys a node at depth d < its index must see."""
  vis = visibility(kv_lengths, t, s, tree_mask)                         # [B, T, S] by slot
  slot = jnp.arange(s, dtype=jnp.int32)[None, None, :]
  vis = vis & (slot > positions[:, :, None] - window)
  src = slot - (s - kv_lengths)[:, None, None]                          # slot of entry j
  wide = jnp.take_along_axis(vis, jnp.broadcast_to(jnp.clip(src, 0, s - 1), vis.shape), axis=2)
  return wide & (src >= 0)


def _jnp_attention(q, k_layer, v_layer, kv_lengths, tree_mask, window, head_major: bool,
                   layer: Optional[int] = None):
  """The jnp attention: over a cache longer than one block, in key blocks up to the longest
  row (kernels_pallas.blocked): a prefill never makes float32 scores [B, Hq, T, S] over the
  whole capacity (the largest buffer of the program otherwise), and a decode step reads only
  the filled part of a generous capacity bucket."""
  seq_axis = (2 if head_major else 1) + (layer is not None)
  if k_layer.shape[seq_axis] > BLOCK:
    return verify_attention_blocked(q, k_layer, v_layer, kv_lengths, tree_mask,
                                    sliding_window=window, head_major=head_major, layer=layer)
  if layer is not None:
    k_layer, v_layer = k_layer[layer], v_layer[layer]
  if head_major:           # a lane-packed slab unpacked (kernels_pallas.lanes)
    k_layer, v_layer = (lanes.unpacked(c, q.shape[-1]) for c in (k_layer, v_layer))
  return verify_attention_reference(q, k_layer, v_layer, kv_lengths, tree_mask,
                                    sliding_window=window, head_major=head_major)


def _kernel_path(config, q, s: int, tree_mask) -> bool:
  """Whether this call goes to kernels_pallas.verify_attention (small T, no window in reach,
  a square tree mask) rather than a jnp path."""
  t = q.shape[1]
  window = config.sliding_window
  needs_window = window is not None and window < s
  wide_mask = tree_mask is not None and tree_mask.shape[-1] != t
  return not (needs_window or (t > 16 and tree_mask is None) or t > MAX_NEW_TOKENS or wide_mask)


def _kernel_attention(config, q, k_cache, v_cache, kv_lengths, tree_mask,
                      head_major: bool = False, layer: Optional[int] = None):
  """kernels_pallas.verify_attention over [B,S,Hkv,Dh] caches ([B,Hkv,S,Dh] head-major): the
  jnp reference, the TPU or the GPU kernel, as it resolves for the platform."""
  # A float32 query (a drafter head's) on a bf16 cache: the kernel runs in the cache's dtype
  # (float32 tiles would double the kernel's registers and VMEM; issue 35).
  low = matmul.is_low_precision(k_cache.dtype) and q.dtype != k_cache.dtype
  out = kernels_pallas.verify_attention(q.astype(k_cache.dtype) if low else q, k_cache, v_cache,
                                        kv_lengths, tree_mask, impl=config.attention_impl,
                                        head_major=head_major, layer=layer)
  return out.astype(q.dtype)


def residual_boundary(x):
  """x itself, materialised between layers when the forward is wide (T > 16: a prefill) and
  not on CPU. XLA:TPU otherwise fuses the residual adds of every layer into one final sum and
  keeps each layer's attention and MLP outputs [B*T, D] alive until then: 2 L of them, 2 GiB
  for an 8B prefill of 8 x 512 tokens (buffer report, docs/accelerators.md)."""
  if x.shape[1] > 16 and not platform.is_cpu():
    return jax.lax.optimization_barrier(x)
  return x


def dense(x, w, transposed: bool = False):
  """x [..., in] times a weight stored [in, out] (transposed False) or [out, in] (True), in x's
  dtype, accumulated in float32 for bf16 (spec_jax.models.matmul); with transposed, w may be a
  tuple of row chunks [out_i, in] (see models.layout.fuse_layers' chunks)."""
  return matmul.dense(x, w, transposed)


def _rows(x) -> int:
  """The rows of a product over x [..., in] (B*T): what picks a weight's orientation."""
  return math.prod(x.shape[:-1])


def project(lp, name: str, x):
  """x times projection `name` of layer params lp, in whichever orientation it is stored for
  this many rows (models.layout.pick_weight); None when lp has no such projection."""
  picked = matmul.pick_weight(lp, name, _rows(x))
  return None if picked is None else dense(x, *picked)


def qkv_projections(config, lp, h):
  """q [B,T,Hq*Dh], k, v [B,T,Hkv*Dh] from the normed input, in either param layout."""
  nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  y = project(lp, "wqkv", h)
  if y is not None:
    if config.qkv_bias:
      y = y + lp["bqkv"]
    return y[..., :nq], y[..., nq:nq + nkv], y[..., nq + nkv:]
  q, k, v = dense(h, lp["wq"]), dense(h, lp["wk"]), dense(h, lp["wv"])
  if config.qkv_bias:
    q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
  return q, k, v


def swiglu_mlp(lp, h):
  """SwiGLU: down(silu(gate h) * up h), in either param layout."""
  gu = project(lp, "w_gu", h)
  if gu is not None:
    gate, up = jnp.split(gu, 2, axis=-1)
    inner = jax.nn.silu(gate) * up
  else:
    inner = jax.nn.silu(dense(h, lp["w_gate"])) * dense(h, lp["w_up"])
  return project(lp, "w_down", inner)


def out_projection(lp, attn):
  return project(lp, "wo", attn)


def embed(params, tokens):
  return jnp.take(params["embed"], tokens, axis=0)


def select_rows(hidden, index):
  """hidden [B,T,D] -> [B,1,D] at token index[b] of row b (int32 [B]); hidden itself when index
  is None."""
  if index is None:
    return hidden
  return jnp.take_along_axis(hidden, index.astype(jnp.int32)[:, None, None], axis=1)


def lm_head(params, config, hidden):
  """hidden [..., D] (after the final norm) -> float32 logits [..., V] (soft-capped,
  c * tanh(logits / c), when config.final_logit_softcap is set: Gemma)."""
  if config.tie_embeddings:
    w, transposed = params["embed"], True                # [V, D]
  else:                                                  # [D, V], or [V, D] as lm_head_t
    w, transposed = matmul.pick_weight(params, "lm_head", _rows(hidden))
  logits = matmul.dense(hidden, w, transposed, out_dtype=jnp.float32)
  if config.final_logit_softcap is not None:
    cap = float(config.final_logit_softcap)
    logits = cap * jnp.tanh(logits / cap)
  return logits
