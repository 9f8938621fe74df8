"""The DFlash block drafter's layers: context features, their K/V, the block attention and masks.

Shapes: B rows, A blocks of b slots each (A = 1 at inference, many anchors in training), S
context slots (slot j = position j), N drafter layers, D the drafter's width. Every layer keys
and values the same context features c (`context_kv`, computed once per committed token at
inference) and its own block; which keys a query sees is `visibility` (inference) or
`training_visibility` (all anchors of a window in one pass). The drafter itself, its state
and its rounds: `spec_jax.drafters.dflash`; its shapes and checks: `dflash_shapes`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from spec_jax.models.config import ModelConfig
from spec_jax.models.blocks import apply_rope, rms_norm

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
_HIDDEN = -1e30          # score of a key a query may not see (every query sees >= 1 key)


def _dense(x, w):
  """x [..., in] @ w [in, out], accumulated in float32 (bf16 weights: bf16 operands)."""
  return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


def context_features(params, layer_hidden, eps: float):
  """c [B, T, D] float32 from the captured target layers (tuple of [B, T, D_target])."""
  cat = jnp.concatenate([h.astype(jnp.float32) for h in layer_hidden], axis=-1)
  return rms_norm(_dense(cat, params["fc"]), params["hidden_norm"], eps)


def layer_params(layers, i: int) -> dict:
  """Layer i's params from the stacked ([N, ...] leaves) or unstacked (a list) layout."""
  if isinstance(layers, (list, tuple)):
    return layers[i]
  return jax.tree.map(lambda w: w[i], layers)


def context_kv(cfg: ModelConfig, layers, feats, positions, inv_freq):
  """Every layer's context keys and values -> (k, v) float32 [N, B, Hkv, T, Dh].

  layers: the layer params (`layer_params`); feats [B, T, D]; positions int32 [B, T]."""
  b, t, _ = feats.shape
  hkv, dh = cfg.num_kv_heads, cfg.head_dim
  ks, vs = [], []
  for i in range(cfg.num_layers):
    lp = layer_params(layers, i)
    k = _dense(feats, lp["wk"]).reshape(b, t, hkv, dh)
    k = apply_rope(rms_norm(k, lp["k_norm"], cfg.rms_norm_eps), positions, inv_freq)
    ks.append(jnp.swapaxes(k, 1, 2))
    vs.append(jnp.swapaxes(_dense(feats, lp["wv"]).reshape(b, t, hkv, dh), 1, 2))
  return jnp.stack(ks), jnp.stack(vs)


def block_keys(x, num_blocks: int):
  """[B, A*b, ...] block keys / values -> [B, A, b, ...]: the keys each block attends to (its
  own; blocks never see each other's)."""
  return x.reshape((x.shape[0], num_blocks, x.shape[1] // num_blocks) + x.shape[2:])


def _attend(q, ctx_k, ctx_v, ctx_visible, blk_k, blk_v, blk_visible):
  """Softmax attention of A blocks of b queries over [context keys ; own block's keys] jointly.

  q [B, A*b, Hq, Dh]; ctx_k, ctx_v [B, Hkv, S, Dh]; blk_k, blk_v [B, A*b, Hkv, Dh];
  ctx_visible bool [B, A*b, S]; blk_visible bool [B, A, b, b] (within each block)
  -> [B, A*b, Hq * Dh]."""
  b, nq, hq, dh = q.shape
  hkv, s = ctx_k.shape[1], ctx_k.shape[2]
  a, bs = blk_visible.shape[1], blk_visible.shape[2]
  q = q.reshape(b, nq, hkv, hq // hkv, dh) * dh ** -0.5
  s_ctx = jnp.einsum("bqhgd,bhsd->bhgqs", q, ctx_k, preferred_element_type=jnp.float32)
  s_ctx = jnp.where(ctx_visible[:, None, None], s_ctx, _HIDDEN)
  qb = q.reshape(b, a, bs, hkv, hq // hkv, dh)
  kb, vb = block_keys(blk_k, a), block_keys(blk_v, a)                  # [B, A, b, Hkv, Dh]
  s_blk = jnp.einsum("bajhgd,bakhd->bhgajk", qb, kb, preferred_element_type=jnp.float32)
  s_blk = jnp.where(blk_visible[:, None, None], s_blk, _HIDDEN)
  scores = jnp.concatenate([s_ctx.reshape(b, hkv, hq // hkv, a, bs, s), s_blk], axis=-1)
  w = jax.nn.softmax(scores, axis=-1)
  out = (jnp.einsum("bhgajs,bhsd->bajhgd", w[..., :s], ctx_v, preferred_element_type=jnp.float32)
         + jnp.einsum("bhgajk,bakhd->bajhgd", w[..., s:], vb, preferred_element_type=jnp.float32))
  return out.reshape(b, nq, hq * dh)


def decoder_layer(cfg: ModelConfig, lp, x, positions, ctx_k, ctx_v, ctx_visible, blk_visible,
                  inv_freq):
  """One DFlash layer over the block tokens x [B, A*b, D] at positions int32 [B, A*b],
  attending to this layer's context cache (ctx_k, ctx_v [B, Hkv, S, Dh]) and each token's own
  block (masks: `visibility`) -> [B, A*b, D]."""
  b, nq, _ = x.shape
  hq, hkv, dh, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
  h = rms_norm(x, lp["attn_norm"], eps)
  q = rms_norm(_dense(h, lp["wq"]).reshape(b, nq, hq, dh), lp["q_norm"], eps)
  k = rms_norm(_dense(h, lp["wk"]).reshape(b, nq, hkv, dh), lp["k_norm"], eps)
  v = _dense(h, lp["wv"]).reshape(b, nq, hkv, dh)
  q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
  attn = _attend(q, ctx_k, ctx_v, ctx_visible, k, v, blk_visible)
  x = x + _dense(attn, lp["wo"])
  h = rms_norm(x, lp["mlp_norm"], eps)
  return x + _dense(jax.nn.silu(_dense(h, lp["w_gate"])) * _dense(h, lp["w_up"]), lp["w_down"])


def visibility(anchors, ctx_len: int, block_size: int, window: Optional[int]):
  """Which keys the queries of A blocks see -> (ctx_visible [B, A*b, S], blk_visible
  [B, A, b, b]).

  anchors int32 [B, A]: block i's start a, its queries at positions a .. a + b - 1, its context
  the positions j < a (slot j = position j, S = ctx_len slots). window None: a full-attention
  layer (all context before the anchor, the whole own block, bidirectional); an int: a sliding
  layer (keys within `window` positions of the query, causal inside the block). A block never
  sees another block (`block_keys`)."""
  b, a = anchors.shape
  offs = jnp.arange(block_size, dtype=jnp.int32)
  qpos = anchors[:, :, None] + offs[None, None]                          # [B, A, b]
  j = jnp.arange(ctx_len, dtype=jnp.int32)[None, None, None]
  ctx = jnp.broadcast_to(j < anchors[:, :, None, None], (b, a, block_size, ctx_len))
  blk = jnp.ones((b, a, block_size, block_size), bool)
  if window is not None:
    ctx &= j > qpos[..., None] - window
    blk = (offs[None, :] <= offs[:, None]) & (offs[None, :] > offs[:, None] - window)
    blk = jnp.broadcast_to(blk, (b, a, block_size, block_size))
  return ctx.reshape(b, a * block_size, ctx_len), blk


def training_visibility(anchors, seq_len: int, block_size: int, window: Optional[int]):
  """The mask of multi-anchor training: A blocks per row in one pass over a window of T tokens.

  anchors int32 [B, A]. Block i sees context j < anchors[:, i] (never its anchor's own hidden
  state, which inference does not have yet) and its own block only (SpecForge
  `create_dflash_block_mask`): exactly what each block sees alone at inference.
  Returns (ctx_visible [B, A*b, T], blk_visible [B, A, b, b])."""
  return visibility(anchors, seq_len, block_size, window)
