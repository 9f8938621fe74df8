"""DFlash block drafters: one drafter forward proposes a whole block of b - 1 tokens.

DFlash (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"; z-lab/dflash
`dflash/model.py`, SpecForge `specforge/core/dflash.py`) drafts the next b - 1 tokens in
parallel: a few decoder layers denoise a block of mask tokens in one pass, conditioned on the
target's hidden states. With D the target's width, b the block size:

  context   c_j = hidden_norm(fc(concat(g^1_j, ..., g^n_j)))      one feature per committed
            token j, g^i = the residual stream after target layer target_layers[i] (the
            published `target_layer_ids` read `hidden_states[id + 1]` of transformers, the
            output of decoder layer id: exactly what `forward(return_layers=...)` returns)
  block     x = [embed(x_p), m, ..., m]  at positions p .. p + b - 1, x_p the last committed
            token (p = lengths - 1), m the mask embedding (the target's embedding of
            `mask_token_id`, or a learned vector `params["mask_embed"]` when the target has
            no spare id: ours, not in the published format)
  layers    N pre-norm Qwen3 layers (q/k RMSNorm per head, SwiGLU). Keys and values are
            [k_norm(c W_k) ; k_norm(norm(x) W_k)] and [c W_v ; norm(x) W_v] with the same
            weights for context and block, queries come from the block only, and RoPE uses the
            absolute positions (context j at j). Full-attention layers see every context token
            j < p and the whole block (bidirectional); sliding layers see keys within
            `sliding_window` positions and are causal inside the block.
  output    logits_k = lm_head(norm(x_k)) of the target's frozen LM head at block slots
            k = 1 .. b - 1: the k-th draft. Slot k's distribution q_k is a marginal given the
            context alone; it does not depend on the other slots' drafts.

The context features never pass through the layers (every layer projects the same c), so each
layer's context K/V is computed once per committed token and kept in the drafter's own cache
(`DFlashState`, capacity S = the engine's); the block's K/V live only inside one forward (the
cache's valid length is the pointer p, nothing is copied or cropped).

Lossless drafting. Greedy: the argmax of every slot (exact-match verification). Sampling: each
slot drafts x_k ~ q_k independently and reports its real q_k, so the engine's rejection sampler
(accept with min(1, p / q_k), resample a rejection from norm(max(p - q_k, 0))) keeps the
target's distribution: no proposal depends on an earlier draft, so q_k is exactly the law of
x_k given everything the verifier conditions on. (The reference implementations draft the argmax
at every temperature, also lossless but accepting less.) Trees: slot d + 1's marginal is the
child distribution of every node at depth d, so `spec_jax.tree.build_dynamic_tree` builds a
top-k or sampled tree over the per-slot distributions from the one forward (the DDTree / JetSpec
idea), verified by the existing tree verifiers.

Training (`train.losses.dflash_loss`): many anchors a per window run in one pass; block a sees
context j < a and its own block only (`training_visibility`); slot k learns token a + k.
"""

from __future__ import annotations

from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sampling as sampling_lib
from spec_jax import tree as tree_lib
from spec_jax.drafters.base import DraftContext, Drafter, PrefillInfo, VerifyInfo
from spec_jax.models.config import ModelConfig
from spec_jax.models.blocks import apply_rope, embed, lm_head, rms_norm, rope_inv_freq

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
_HIDDEN = -1e30          # score of a key a query may not see (every query sees >= 1 key)


# ----------------------------------------------------------------------------- state

@flax.struct.dataclass
class DFlashState:
  """The context K/V of every drafter layer, after k_norm and RoPE.

  k, v: float32 [N, B, Hkv, S, Dh] (N drafter layers, S the engine's capacity). Slot j holds
  committed token j's context feature; slots < lengths - 1 are valid (the last committed token
  has no target hidden state yet: it is the block's first token)."""
  k: jax.Array
  v: jax.Array


# ----------------------------------------------------------------------------- the math

def _dense(x, w):
  """x [..., in] @ w [in, out], accumulated in float32 (bf16 weights: bf16 operands)."""
  return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple:
  """The published default (z-lab `build_target_layer_ids`): the middle layer for a one-layer
  drafter, else num_draft_layers ids spread evenly from layer 1 to L - 3."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  start, end = 1, num_target_layers - 3
  return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1)))
               for i in range(num_draft_layers))


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


# ----------------------------------------------------------------------------- the drafter

class DFlash(Drafter):
  """A DFlash block drafter (module docstring) for one target shape.

  Params: fc [n D_target, D]; hidden_norm, norm [D]; layers {attn_norm, mlp_norm [N, D];
  wq [N, D, Hq Dh]; wk, wv [N, D, Hkv Dh]; wo [N, Hq Dh, D]; q_norm, k_norm [N, Dh];
  w_gate, w_up [N, D, F]; w_down [N, F, D]}; mask_embed [D] when mask_token_id is None.

  Args:
    params: the pytree above.
    target_config: the target's ModelConfig (static).
    layer_config: the drafter layers' ModelConfig (num_layers N, heads, MLP, eps, RoPE).
    target_layers: the captured target layers, layer-output indices (= target_layer_ids).
    block_size: b; the drafter proposes up to b - 1 tokens per round (num_draft <= b - 1
      uses the first num_draft slots of the same b-token block it was trained on).
    layer_types: per drafter layer, "full_attention" or "sliding_attention".
    sliding_window: the window of the sliding layers.
    mask_token_id: the target id whose embedding fills the mask slots, or None for the learned
      params["mask_embed"].
    greedy_drafts: propose the argmax deterministically at every temperature.
  """

  kind = "dflash"
  supports_tree = True

  def __init__(self, params, target_config: ModelConfig, layer_config: ModelConfig,
               target_layers: Sequence[int], block_size: int, layer_types=None,
               sliding_window: Optional[int] = None, mask_token_id: Optional[int] = None,
               greedy_drafts: bool = False):
    self.params = params
    self.target_config = target_config
    self.layer_config = layer_config
    self.target_layers = tuple(int(i) for i in target_layers)
    self.block_size = int(block_size)
    n = layer_config.num_layers
    self.layer_types = tuple(layer_types) if layer_types is not None else (FULL,) * n
    self.sliding_window = None if sliding_window is None else int(sliding_window)
    self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
    self.greedy_drafts = bool(greedy_drafts)
    self.max_draft = self.block_size - 1
    check_shape(self, params)

  # ----------------------------------------------------------------------- identity / io

  def _static_key(self):
    return (type(self).__name__, self.target_config, self.layer_config, self.target_layers,
            self.block_size, self.layer_types, self.sliding_window, self.mask_token_id,
            self.greedy_drafts)

  def hyper_params(self) -> dict:
    c, t = self.layer_config, self.target_config
    hp = {"num_layers": c.num_layers, "intermediate_size": c.intermediate_size,
          "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
          "target_layers": list(self.target_layers), "block_size": self.block_size,
          "layer_types": list(self.layer_types), "sliding_window": self.sliding_window,
          "mask_token_id": self.mask_token_id}
    if (c.rms_norm_eps, c.rope_theta, c.rope_scaling) != (t.rms_norm_eps, t.rope_theta,
                                                          t.rope_scaling):
      hp.update(rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                rope_scaling=None if c.rope_scaling is None else [list(x) for x in c.rope_scaling])
    return hp

  def with_params(self, params, greedy_drafts=None):
    return type(self)(params, self.target_config, self.layer_config, self.target_layers,
                      self.block_size, self.layer_types, self.sliding_window,
                      self.mask_token_id,
                      self.greedy_drafts if greedy_drafts is None else greedy_drafts)

  def check_compatible(self, target) -> None:
    c, t = target.config, self.target_config
    for name in ("hidden_size", "vocab_size", "num_layers", "tie_embeddings"):
      if getattr(c, name) != getattr(t, name):
        raise ValueError(f"this DFlash drafter was built for a target with {name}="
                         f"{getattr(t, name)}; this target has {getattr(c, name)}")

  # ----------------------------------------------------------------------- the forward

  @property
  def _inv_freq(self):
    return rope_inv_freq(self.layer_config)

  def _windows(self):
    return [self.sliding_window if kind == SLIDING else None for kind in self.layer_types]

  def block_embeddings(self, params, target_params, first_tokens):
    """[x_a, m, ..., m] per block: first_tokens int32 [B, A] -> float32 [B, A * b, D]."""
    b, a = first_tokens.shape
    first = embed(target_params, first_tokens).astype(jnp.float32)
    if self.mask_token_id is None:
      mask = params["mask_embed"].astype(jnp.float32)
    else:
      mask = target_params["embed"][self.mask_token_id].astype(jnp.float32)
    mask = jnp.broadcast_to(mask, (b, a, self.block_size - 1, mask.shape[-1]))
    return jnp.concatenate([first[:, :, None], mask], axis=2).reshape(b, a * self.block_size, -1)

  def _layers(self, params, x, positions, ctx_k, ctx_v, masks):
    """The N layers; masks: per layer (ctx_visible, blk_visible). Returns norm(x) [B, Q, D]."""
    cfg, inv_freq = self.layer_config, self._inv_freq
    for i in range(cfg.num_layers):
      x = decoder_layer(cfg, layer_params(params["layers"], i), x, positions, ctx_k[i],
                        ctx_v[i], *masks[i], inv_freq)
    return rms_norm(x, params["norm"], cfg.rms_norm_eps)

  def logits(self, params, target_params, hidden):
    """Drafter output [..., D] -> float32 logits [..., V] through the target's LM head."""
    return lm_head(target_params, self.target_config,
                   hidden.astype(target_params["embed"].dtype))

  def block_hidden(self, params, state: DFlashState, target_params, tokens, lengths):
    """The drafter's output over the block [x_p, m, ...] at p = lengths - 1 -> [B, b, D]."""
    p = (lengths - 1).astype(jnp.int32)
    last = jnp.take_along_axis(tokens, p[:, None], axis=1)
    x = self.block_embeddings(params, target_params, last)
    positions = p[:, None] + jnp.arange(self.block_size, dtype=jnp.int32)[None]
    s = state.k.shape[3]
    by_window = {w: visibility(p[:, None], s, self.block_size, w) for w in set(self._windows())}
    return self._layers(params, x, positions, state.k, state.v,
                        [by_window[w] for w in self._windows()])

  def block_logits(self, params, state: DFlashState, ctx: DraftContext, num_slots=None):
    """float32 [B, K, V]: the logits of block slots 1..K (K = num_slots, default b - 1)."""
    k = self.block_size - 1 if num_slots is None else int(num_slots)
    hidden = self.block_hidden(params, state, ctx.target_params, ctx.tokens, ctx.lengths)
    return self.logits(params, ctx.target_params, hidden[:, 1:k + 1])

  def training_hidden(self, params, target_params, tokens, layer_hidden, anchors):
    """All anchors' blocks in one pass with the training block mask.

    tokens int32 [B, T]; layer_hidden: the captured target layers over tokens ([B, T, D_t]
    each); anchors int32 [B, A] block starts (0 <= a < T). Returns norm(x) [B, A, b, D]:
    [:, i, k] is slot k of the block anchored at anchors[:, i] (it predicts token a + k)."""
    bsz, t = tokens.shape
    a = anchors.shape[1]
    cfg = self.layer_config
    feats = context_features(params, layer_hidden, cfg.rms_norm_eps)
    ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (bsz, t))
    ctx_k, ctx_v = context_kv(cfg, params["layers"], feats, ctx_pos, self._inv_freq)
    first = jnp.take_along_axis(tokens, anchors, axis=1)
    x = self.block_embeddings(params, target_params, first)
    positions = (anchors[:, :, None] +
                 jnp.arange(self.block_size, dtype=jnp.int32)[None, None]).reshape(bsz, -1)
    by_window = {w: training_visibility(anchors, t, self.block_size, w)
                 for w in set(self._windows())}
    out = self._layers(params, x, positions, ctx_k, ctx_v,
                       [by_window[w] for w in self._windows()])
    return out.reshape(bsz, a, self.block_size, -1)

  # ----------------------------------------------------------------------- drafter interface

  def prepare(self, params):
    """The layers unstacked, once per generate() call: inside the decode loop XLA:CPU would
    copy every static slice of a stacked weight each round (transformer.unstack_layers)."""
    if isinstance(params["layers"], (list, tuple)):
      return params
    n = self.layer_config.num_layers
    return dict(params, layers=[layer_params(params["layers"], i) for i in range(n)])

  def _write_context(self, params, state: DFlashState, layer_hidden, offsets):
    """Writes the context K/V of T committed tokens at slots offsets[b] .. offsets[b] + T - 1
    (positions = slots) of every layer's cache."""
    cfg = self.layer_config
    t = layer_hidden[0].shape[1]
    positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    feats = context_features(params, layer_hidden, cfg.rms_norm_eps)
    k, v = context_kv(cfg, params["layers"], feats, positions, self._inv_freq)
    rows = jnp.arange(k.shape[1])[:, None]

    def write(cache, new):
      # [N, B, Hkv, S, Dh] at (rows, slots): the advanced indices around the head slice index
      # [B, T, N, Hkv, Dh].
      return cache.at[:, rows, :, positions].set(new.transpose(1, 3, 0, 2, 4), mode="drop")

    return DFlashState(k=write(state.k, k), v=write(state.v, v))

  def init_state(self, params, prefill: PrefillInfo):
    b, s = prefill.tokens.shape
    c = self.layer_config
    shape = (c.num_layers, b, c.num_kv_heads, s, c.head_dim)
    state = DFlashState(k=jnp.zeros(shape, jnp.float32), v=jnp.zeros(shape, jnp.float32))
    # The prompt's features at slots 0..P-1 (slots >= prompt_lens are padding: past the valid
    # length, overwritten by later commits).
    return self._write_context(params, state, prefill.layer_hidden,
                               jnp.zeros((b,), jnp.int32))

  def commit(self, params, state: DFlashState, tokens, n_accepted, verify: VerifyInfo):
    # The verify fed [last committed, d_1..d_K] at positions lengths_before - 1 + i; the
    # accepted prefix (inputs 0..n_accepted) becomes context. All K + 1 are written; those past
    # n_accepted lie beyond the new valid length (lengths - 1) and are overwritten later.
    del tokens, n_accepted
    return self._write_context(params, state, verify.layer_hidden, verify.lengths_before - 1)

  def _draw(self, logits, key, sampling):
    """Independent draws per row and slot from q = sampling.probs(logits) [B, K, V]."""
    q = sampling_lib.probs(logits, sampling)
    b, k = logits.shape[:2]
    keys = jax.vmap(lambda r: jax.vmap(lambda i: jax.random.fold_in(
        jax.random.fold_in(key, r), i))(jnp.arange(k)))(jnp.arange(b))
    return jax.vmap(jax.vmap(sampling_lib.sample))(keys, q), q

  def propose(self, params, state: DFlashState, ctx: DraftContext):
    if ctx.num_draft > self.block_size - 1:
      raise ValueError(f"a DFlash drafter with block_size {self.block_size} proposes at most "
                       f"{self.block_size - 1} tokens per round; num_draft={ctx.num_draft}")
    logits = self.block_logits(params, state, ctx, ctx.num_draft)
    if self.greedy_drafts or ctx.greedy:
      return jnp.argmax(logits, -1).astype(jnp.int32), None, state
    drafts, q = self._draw(logits, ctx.key, ctx.sampling)
    return drafts, q, state

  def propose_tree(self, params, state: DFlashState, ctx: DraftContext, spec):
    """A dynamic tree over the per-slot distributions: a node at depth d gets its children
    from slot d + 1 (the same distribution for every node of that depth), EAGLE-2's top-k /
    sampled candidate selection in `tree.build_dynamic_tree`; one drafter forward in all."""
    if spec.depth > self.block_size - 1:
      raise ValueError(f"a DFlash drafter with block_size {self.block_size} drafts at most "
                       f"{self.block_size - 1} tokens ahead; TreeSpec.depth={spec.depth}")
    logits = self.block_logits(params, state, ctx, spec.depth)          # [B, D, V]
    rows = jnp.arange(logits.shape[0])[:, None]

    def expand(tokens, parents, depths, start, carry):
      del tokens, parents
      return logits[rows, depths[:, start:]], carry      # depth d -> slot d + 1 = index d

    candidates = "topk" if self.greedy_drafts else spec.candidates_for(ctx.greedy)
    tree, _ = tree_lib.build_dynamic_tree(logits[:, 0], expand, (), spec, key=ctx.key,
                                          sampling=ctx.sampling, candidates=candidates)
    return tree, state

  # ----------------------------------------------------------------------- construction

  @classmethod
  def init(cls, target, key=None, block_size: int = 8, num_layers: int = 1,
           target_layers: Optional[Sequence[int]] = None,
           intermediate_size: Optional[int] = None, num_heads: Optional[int] = None,
           num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
           layer_types=None, sliding_window: Optional[int] = None,
           mask_token_id: Optional[int] = None, rms_norm_eps: Optional[float] = None,
           rope_theta: Optional[float] = None, rope_scaling=None, init_std: float = 0.02,
           greedy_drafts: bool = False, **kw) -> "DFlash":
    """A fresh DFlash drafter for `target` (a Model).

    The layers are normal(init_std), the norms 1 except the output norm (the target's final
    norm, so the first logits have the target's scale), fc the identity on the last captured
    layer plus normal(init_std), the learned mask embedding (mask_token_id None) zero (a mask
    slot starts as the attention average of what it sees: a 4x lower first loss on stories260K
    than the target's mean embedding, which makes every slot confidently wrong). target_layers default to `default_target_layers(L, num_layers)`; the
    other options rebuild a saved or loaded drafter's exact shape."""
    if kw:
      raise ValueError(f"unknown DFlash option(s): {', '.join(sorted(kw))}")
    key = jax.random.key(0) if key is None else key
    tc = target.config
    layers = tuple(target_layers) if target_layers is not None else \
        default_target_layers(tc.num_layers, num_layers)
    cfg = layer_config(tc, num_layers, intermediate_size, num_heads, num_kv_heads, head_dim,
                       rms_norm_eps, rope_theta, rope_scaling)
    d, n = tc.hidden_size, len(layers)
    k_fc, k_layers = jax.random.split(key)
    params = {
        "fc": (jnp.concatenate([jnp.zeros(((n - 1) * d, d)), jnp.eye(d)], axis=0) +
               init_std * jax.random.normal(k_fc, (n * d, d))),
        "hidden_norm": jnp.ones((d,)),
        "layers": init_layers(cfg, k_layers, init_std),
        "norm": jnp.asarray(target.params["final_norm"], jnp.float32),
    }
    if mask_token_id is None:
      params["mask_embed"] = jnp.zeros((d,), jnp.float32)
    return cls(params, tc, cfg, layers, block_size, layer_types, sliding_window, mask_token_id,
               greedy_drafts)


def layer_config(target_config: ModelConfig, num_layers: int,
                 intermediate_size: Optional[int] = None, num_heads: Optional[int] = None,
                 num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 rms_norm_eps: Optional[float] = None, rope_theta: Optional[float] = None,
                 rope_scaling=None) -> ModelConfig:
  """The drafter layers' ModelConfig (float32, q/k norms): the target's width; heads, MLP, eps
  and RoPE default to the target's."""
  c = target_config
  heads = int(num_heads or c.num_heads)
  kv = int(num_kv_heads or (c.num_kv_heads if heads == c.num_heads else heads))
  dh = int(head_dim or (c.head_dim if heads == c.num_heads else c.hidden_size // heads))
  out = c.replace(num_layers=int(num_layers), num_heads=heads, num_kv_heads=kv, head_dim=dh,
                  intermediate_size=int(intermediate_size or c.intermediate_size),
                  qk_norm=True, qkv_bias=False, sliding_window=None, dtype="float32",
                  num_mtp_layers=0)
  if rms_norm_eps is not None:
    out = out.replace(rms_norm_eps=float(rms_norm_eps))
  if rope_theta is not None:
    scaling = None if rope_scaling is None else tuple(tuple(x) for x in rope_scaling)
    out = out.replace(rope_theta=float(rope_theta), rope_scaling=scaling)
  return out


def init_layers(cfg: ModelConfig, key, std: float) -> dict:
  """Stacked [N, ...] layer params in the llama family's names (models.llama.forward), plus q_norm / k_norm."""
  n, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  ks = iter(jax.random.split(key, 7))
  normal = lambda *shape: std * jax.random.normal(next(ks), (n,) + shape, jnp.float32)
  return {"attn_norm": jnp.ones((n, d)), "mlp_norm": jnp.ones((n, d)),
          "wq": normal(d, hq * dh), "wk": normal(d, hkv * dh), "wv": normal(d, hkv * dh),
          "wo": normal(hq * dh, d), "q_norm": jnp.ones((n, dh)), "k_norm": jnp.ones((n, dh)),
          "w_gate": normal(d, f), "w_up": normal(d, f), "w_down": normal(f, d)}


def expected_shapes(drafter: DFlash) -> dict:
  """The shape of every param leaf of `drafter`'s configuration."""
  c, t = drafter.layer_config, drafter.target_config
  n, d, f = c.num_layers, c.hidden_size, c.intermediate_size
  hq, hkv, dh = c.num_heads, c.num_kv_heads, c.head_dim
  shapes = {"fc": (len(drafter.target_layers) * t.hidden_size, d), "hidden_norm": (d,),
            "norm": (d,),
            "layers": {"attn_norm": (n, d), "mlp_norm": (n, d), "wq": (n, d, hq * dh),
                       "wk": (n, d, hkv * dh), "wv": (n, d, hkv * dh), "wo": (n, hq * dh, d),
                       "q_norm": (n, dh), "k_norm": (n, dh), "w_gate": (n, d, f),
                       "w_up": (n, d, f), "w_down": (n, f, d)}}
  if drafter.mask_token_id is None:
    shapes["mask_embed"] = (d,)
  return shapes


def check_shape(drafter: DFlash, params) -> None:
  """Raises ValueError naming what does not fit: the static configuration or a param shape."""
  t, c = drafter.target_config, drafter.layer_config
  if isinstance(drafter.block_size, bool) or drafter.block_size < 2:
    raise ValueError(f"dflash: block_size must be an integer >= 2 (the last committed token and "
                     f"at least one mask slot), got {drafter.block_size}")
  if not drafter.target_layers:
    raise ValueError("dflash: target_layers must name at least one target layer")
  bad = [i for i in drafter.target_layers if not 0 <= i < t.num_layers]
  if bad:
    raise ValueError(f"dflash: target_layers {bad} outside the target's {t.num_layers} layers; "
                     f"allowed: 0 <= id < {t.num_layers} (id = the output of decoder layer id)")
  if c.hidden_size != t.hidden_size:
    raise ValueError(f"dflash: the drafter's hidden_size {c.hidden_size} must be the target's "
                     f"{t.hidden_size} (it reads the target's embedding and LM head)")
  if len(drafter.layer_types) != c.num_layers:
    raise ValueError(f"dflash: layer_types has {len(drafter.layer_types)} entries for "
                     f"{c.num_layers} drafter layers; allowed: one per layer")
  unknown = sorted(set(drafter.layer_types) - set(LAYER_TYPES))
  if unknown:
    raise ValueError(f"dflash: layer_types {unknown}; allowed: {', '.join(LAYER_TYPES)}")
  if SLIDING in drafter.layer_types and (drafter.sliding_window is None or
                                         drafter.sliding_window < 1):
    raise ValueError(f"dflash: sliding_attention layers need a sliding_window >= 1, got "
                     f"{drafter.sliding_window}")
  m = drafter.mask_token_id
  if m is not None and not 0 <= m < t.vocab_size:
    raise ValueError(f"dflash: mask_token_id={m} outside the target's vocabulary [0, "
                     f"{t.vocab_size}); allowed: a reserved id of the vocabulary, or None for a "
                     f"learned mask embedding")
  want = expected_shapes(drafter)
  got = jax.tree.map(lambda x: tuple(np.shape(x)), params)
  if got != want:
    raise ValueError(f"dflash: params have shapes {got}; this configuration needs {want}")


def is_dflash(drafter) -> bool:
  return getattr(drafter, "kind", None) == "dflash"


__all__ = ["DFlash", "DFlashState", "default_target_layers", "context_features", "context_kv",
           "decoder_layer", "visibility", "training_visibility", "block_keys", "layer_config", "init_layers",
           "expected_shapes"]
