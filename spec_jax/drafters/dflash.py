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
top-k or sampled tree over the per-slot distributions from the one forward, and
`spec_jax.tree.build_best_first_tree` DDTree's best-first tree (TreeSpec(candidates=
"best_first"): the N likeliest sequences under the factorized q), verified by the existing tree
verifiers.

Training (`train.losses.dflash_loss`): many anchors a per window run in one pass; block a sees
context j < a and its own block only (`training_visibility`); slot k learns token a + k.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax import tree as tree_lib
from spec_jax.drafters import dflash_layers as layers_lib
from spec_jax.drafters import dflash_shapes
from spec_jax.drafters import head_layer
from spec_jax.drafters.base import (DraftContext, FrozenDrafter, PrefillInfo, VerifyInfo,
                                   frozen_drafter, params_field)
from spec_jax.drafters.dflash_layers import (FULL, SLIDING, context_features, context_kv,
                                             decoder_layer, layer_params)
from spec_jax.drafters.dflash_shapes import (check_shape, default_target_layers, init_layers,
                                             layer_config)
from spec_jax.models.config import ModelConfig
from spec_jax.models.prefill import PREFILL_CHUNK
from spec_jax.models.blocks import embed, lm_head, rms_norm, rope_inv_freq

# ----------------------------------------------------------------------------- state

@flax.struct.dataclass
class DFlashState:
  """The context K/V of every drafter layer, after k_norm and RoPE.

  k, v: float32 [N, B, Hkv, S, Dh] (N drafter layers, S the engine's capacity). Slot j holds
  committed token j's context feature; slots < lengths - 1 are valid (the last committed token
  has no target hidden state yet: it is the block's first token)."""
  k: jax.Array
  v: jax.Array


# ----------------------------------------------------------------------------- the drafter

@frozen_drafter
class DFlash(FrozenDrafter):
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
  supports_best_first = True

  params: Any = params_field()
  target_config: ModelConfig = dataclasses.field()
  layer_config: ModelConfig = dataclasses.field()
  target_layers: Sequence[int] = dataclasses.field()
  block_size: int = dataclasses.field()
  layer_types: Optional[tuple] = None          # None: every layer full_attention
  sliding_window: Optional[int] = None
  mask_token_id: Optional[int] = None
  greedy_drafts: bool = False

  def __post_init__(self):
    n = self.layer_config.num_layers
    set_ = lambda name, value: object.__setattr__(self, name, value)
    set_("target_layers", tuple(int(i) for i in self.target_layers))
    if not isinstance(self.block_size, bool):
      set_("block_size", int(self.block_size))
    set_("layer_types", tuple(self.layer_types) if self.layer_types is not None else (FULL,) * n)
    set_("sliding_window", None if self.sliding_window is None else int(self.sliding_window))
    set_("mask_token_id", None if self.mask_token_id is None else int(self.mask_token_id))
    set_("greedy_drafts", bool(self.greedy_drafts))
    check_shape(self, self.params)

  @property
  def max_draft(self) -> int:
    return self.block_size - 1

  def param_shapes(self) -> dict:
    """The shape of every param leaf this configuration needs (`dflash_shapes.check_shape`
    compares the params against it; subclasses add their own leaves)."""
    return dflash_shapes.expected_shapes(self)

  # ----------------------------------------------------------------------- identity / io

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

  def check_compatible(self, target) -> None:
    head_layer.check_target_shape("this DFlash drafter", self.target_config, target.config)

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
    by_window = {w: layers_lib.visibility(p[:, None], s, self.block_size, w)
                 for w in set(self._windows())}
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
    by_window = {w: layers_lib.training_visibility(anchors, t, self.block_size, w)
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

    return state.replace(k=write(state.k, k), v=write(state.v, v))   # subclasses' state too

  def init_state(self, params, prefill: PrefillInfo):
    b, s = prefill.tokens.shape
    c = self.layer_config
    shape = (c.num_layers, b, c.num_kv_heads, s, c.head_dim)
    state = DFlashState(k=jnp.zeros(shape, jnp.float32), v=jnp.zeros(shape, jnp.float32))
    # The prompt's features at slots 0..P-1, PREFILL_CHUNK positions at a time and only as
    # many chunks as the longest prompt needs, as the target's prefill runs (slots >=
    # prompt_lens are padding or zeros: past the valid length, overwritten by later commits).
    # generate() pads prompts to the cache capacity: over the whole buffer this cost 1.2 s of a
    # 3.8 s B = 32 prefill for 12-token prompts in a 128-slot buffer (widened stories260K).
    hidden = prefill.layer_hidden
    p = hidden[0].shape[1]
    c = max(1, min(PREFILL_CHUNK, p))
    if c == p:
      return self._write_context(params, state, hidden, jnp.zeros((b,), jnp.int32))
    padded = -(-p // c) * c
    hidden = tuple(jnp.pad(h, ((0, 0), (0, padded - p), (0, 0))) for h in hidden)

    def chunk(i, state):
      piece = tuple(jax.lax.dynamic_slice_in_dim(h, i * c, c, axis=1) for h in hidden)
      return self._write_context(params, state, piece, jnp.full((b,), i * c, jnp.int32))

    n_chunks = (jnp.max(prefill.prompt_lens) + c - 1) // c
    return jax.lax.fori_loop(0, n_chunks, chunk, state)

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
    """A tree over the per-slot distributions: a node at depth d gets its children from slot
    d + 1 (the same distribution for every node of that depth); one drafter forward in all.
    candidates "best_first": DDTree's best-first tree (`tree.build_best_first_tree`, the N
    likeliest sequences under the factorized q); otherwise EAGLE-2's top-k / sampled candidate
    selection in `tree.build_dynamic_tree`."""
    if spec.depth > self.block_size - 1:
      raise ValueError(f"a DFlash drafter with block_size {self.block_size} drafts at most "
                       f"{self.block_size - 1} tokens ahead; TreeSpec.depth={spec.depth}")
    logits = self.block_logits(params, state, ctx, spec.depth)          # [B, D, V]
    if spec.candidates == "best_first":     # DDTree: the N likeliest sequences, best first
      return tree_lib.build_best_first_tree(logits, spec), state
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
