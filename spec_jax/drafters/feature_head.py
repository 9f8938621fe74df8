"""Feature-level autoregressive draft heads: the shared machinery of EAGLE, EAGLE-3 and MTP.

All three heads are one small decoder layer that runs beside the frozen target, reads the
target's features, reuses the target's frozen embedding and LM head, and drafts K tokens
autoregressively by feeding its own predicted feature back in. They differ only in

  kind     feature f_j the head reads                   input x_j                     logits
  eagle    target hidden after the final norm (what     fc(concat(emb, f)) + fc_b     lm_head(o)
           the LM head reads; EAGLE-1's convention)
  eagle3   fc(concat(low, mid, high)): three target     residual f, attention over    own lm_head(norm(o))
           layers' residual streams (target_layers)     concat(enorm(emb), hnorm(f))  (draft vocabulary)
  eagle3_  concat(low, mid, high) @ fuse                fc(concat(emb, f)) + fc_b     lm_head(norm(o))
  fused
  mtp      the target's last layer output before the    fc(concat(enorm(emb),         lm_head(norm(o)))
           final norm (DeepSeek-V3 / Qwen3-Next)         hnorm(f)))

where emb is the target's embedding of the NEXT token, o the output of the head's decoder
layer (the residual stream), norm the head's own RMSNorm, lm_head the target's (EAGLE-3 has its
own, see `spec_jax.drafters.eagle`). A kind changes how one step is computed by overriding
`_step` (cached drafting), `_pre_attention` (the training unroll) and `_propose_token`.

Positions and the head's KV cache (capacity S = the engine's), one convention for all kinds:

  slot j holds the pair (f_j, token_{j+1}): the feature of position j (the target's state
  after token j, which predicted token j+1) with the embedding of the token that actually
  followed. RoPE position j. The layer's output o_j at slot j is the head's prediction of
  f_{j+1}, and lm_head(o_j) its distribution for token j+2.

With `lengths` committed tokens, the target has features for positions < lengths-1 (the last
committed token has not been fed to the target yet), so the head cache is valid for slots
< lengths-1, and the state also carries `next_feature` = o at slot lengths-2: the prediction
of f_{lengths-1}, whose logits give the first draft (token `lengths`).

  init_state: pairs (prefill hidden j, tokens j+1) for j < P at offset 0 (the padded prompt in
    chunks of C positions, as the target's prefill; slots >= prompt_lens are stale and
    overwritten later); next_feature = o at slot prompt_lens-1.
  propose: draft 1 from next_feature; then for i = 1..K-1 the pair (o_prev, draft_i) goes to
    slot lengths-2+i, its output gives draft i+1. These speculative slots are overwritten.
  commit: the verify fed [last committed, d_1..d_K] at positions p = lengths_before-1 ..
    p+K and returned features f_p..f_{p+K}; the accepted prefix is inputs 0..n_accepted, whose
    next tokens are emitted[0..n_accepted] (accepted drafts, then the correction / bonus). One
    head forward over the K+1 pairs (f_{p+i}, emitted[i]) at offset p rewrites slots p..p+K
    (those past p+n_accepted are stale, beyond the new valid range) and next_feature = o at
    slot p+n_accepted = lengths-2.

Training (train/): `unroll` runs the same layer over whole windows with teacher features at
step 1 and, for the training-time-test steps s > 1 (EAGLE-3), the head's own step s-1 outputs
fed back as features, with the attention pattern the drafter sees at test time (the real
prefix up to slot j-s+1 plus the s-1 drafted slots j-s+2..j).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax import tree as tree_lib
from spec_jax.drafters import head_layer
from spec_jax.drafters.base import (DraftContext, FrozenDrafter, PrefillInfo, VerifyInfo,
                                   frozen_drafter, params_field)
from spec_jax.models import matmul
from spec_jax.models.config import ModelConfig
from spec_jax.models.blocks import (ForwardOutput, apply_rope, embed, lm_head, rms_norm,
                                    rope_inv_freq)
from spec_jax.models.cache import default_head_major
from spec_jax.models.llama import layout
from spec_jax.models.llama.forward import decoder_layer
from spec_jax.models.prefill import PREFILL_CHUNK, chunked_prefill


@flax.struct.dataclass
class FeatureHeadState:
  """k, v: [B, S, Hkv, Dh] the head's KV cache (slot convention: module docstring).
  next_feature: [B, D] float32, the head's prediction of the last committed token's feature."""
  k: jax.Array
  v: jax.Array
  next_feature: jax.Array


def head_layer_config(target_config: ModelConfig, intermediate_size: Optional[int] = None,
                      num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                      copy_attention_flags: bool = False) -> ModelConfig:
  """The head's one-layer ModelConfig (float32): the target's width and RoPE, its own MLP (a
  llama-style layer whatever the target's family: its family's llama_view)."""
  c = target_config.family.llama_view(target_config)
  return head_layer.layer_config(c, 1, intermediate_size, num_heads, num_kv_heads,
                                 qkv_bias=c.qkv_bias and copy_attention_flags,
                                 qk_norm=c.qk_norm and copy_attention_flags)


@frozen_drafter
class FeatureHead(FrozenDrafter):
  """EAGLE / EAGLE-3 / MTP drafter (see the module docstring). Subclasses fix `kind`.

  Args:
    params: the head's pytree (fc, [fc_b], [fuse], [enorm, hnorm], layer, [out_norm]).
    target_config: the target's ModelConfig (static; heads are built for one target shape).
    layer_config: the head's one-layer ModelConfig.
    target_layers: the target layers the head reads (eagle3: low/mid/high; mtp: (L-1,)).
    greedy_drafts: propose the argmax deterministically (draft_probs None) instead of samples.
  """

  kind = "eagle"
  supports_tree = True
  # Prompt positions per head forward in init_state (static; the target's prefill chunk).
  prefill_chunk = PREFILL_CHUNK

  params: Any = params_field()
  target_config: ModelConfig = dataclasses.field()
  layer_config: ModelConfig = dataclasses.field()
  target_layers: tuple = ()
  greedy_drafts: bool = False

  def __post_init__(self):
    object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
    object.__setattr__(self, "greedy_drafts", bool(self.greedy_drafts))
    bad = [i for i in self.target_layers if not 0 <= i < self.target_config.num_layers]
    if bad:
      raise ValueError(f"{self.kind}: target_layers {bad} outside the target's "
                       f"{self.target_config.num_layers} layers")

  # ----------------------------------------------------------------------- identity / io

  # Saved hyper-parameters that a rebuild derives (head_layer_config) instead of taking.
  _DERIVED = ("head_dim", "qkv_bias", "qk_norm", "num_kv_heads", "target_layers")

  @classmethod
  def from_hyper_params(cls, target, hyper_params: dict, key=None, **options):
    """A fresh head of the shape `hyper_params()` saved: the derived entries are dropped (the
    kv heads checked against the rebuilt layer's)."""
    hp = {k: v for k, v in hyper_params.items() if k not in cls._DERIVED}
    drafter = cls.init(target, key=key, **hp, **options)
    kv = hyper_params.get("num_kv_heads")
    if kv is not None and drafter.layer_config.num_kv_heads != kv:
      raise ValueError(f"saved head has {kv} kv heads but the rebuilt one has "
                       f"{drafter.layer_config.num_kv_heads}")
    return drafter

  def hyper_params(self) -> dict:
    c = self.layer_config
    return {"intermediate_size": c.intermediate_size, "num_heads": c.num_heads,
            "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "qkv_bias": c.qkv_bias,
            "qk_norm": c.qk_norm, "target_layers": list(self.target_layers)}

  def check_compatible(self, target) -> None:
    head_layer.check_target_shape(f"these {self.kind} heads", self.target_config, target.config)

  # ----------------------------------------------------------------------- the math

  def target_feature(self, params, hidden, layer_hidden):
    """The feature f [..., T, D] (float32) the head reads, from a target forward's outputs."""
    if self.kind == "eagle":
      return hidden.astype(jnp.float32)
    return layer_hidden[-1].astype(jnp.float32)                        # mtp

  def combine(self, params, target_params, tokens, feature):
    """x [B, T, D] from next tokens [B, T] and features [B, T, D]."""
    e = embed(target_params, tokens).astype(jnp.float32)
    eps = self.target_config.rms_norm_eps
    if self.kind == "mtp":
      cat = jnp.concatenate([rms_norm(e, params["enorm"], eps),
                             rms_norm(feature, params["hnorm"], eps)], axis=-1)
      return matmul.dense_named(cat, params, "fc")
    return matmul.dense_named(jnp.concatenate([e, feature], axis=-1), params, "fc") + params["fc_b"]

  def logits(self, params, target_params, out):
    """Head output o [..., D] -> float32 logits [..., V] through the target's LM head."""
    if "out_norm" in params:
      out = rms_norm(out, params["out_norm"], self.target_config.rms_norm_eps)
    w_dtype = target_params["embed"].dtype
    return lm_head(target_params, self.target_config, out.astype(w_dtype))

  def proposal_logits(self, params, target_params, out):
    """Head output o [..., D] -> logits over the tokens the head can propose: the
    target's whole vocabulary [..., V] here; EAGLE-3 with a draft vocabulary: [..., V_d]
    over proposal_vocab's ids."""
    return self.logits(params, target_params, out)

  @property
  def proposal_vocab(self):
    """int32 [V_d] target ids of proposal_logits' columns, or None (the whole vocabulary)."""
    return None

  def _layer(self, params, x, k, v, offsets, positions=None, tree_mask=None):
    """Cached decoder layer over T new pairs at per-row offsets -> (o, k, v). positions
    default to the slots (offsets + t); trees pass their own with an ancestor tree_mask."""
    t = x.shape[1]
    if positions is None:
      positions = offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    return decoder_layer(self.layer_config, params["layer"], x, positions, k, v, offsets,
                         tree_mask, rope_inv_freq(self.layer_config),
                         head_major=self.head_major_cache)

  @property
  def head_major_cache(self) -> bool:
    """The head's one-layer cache is [B, Hkv, S, Dh] where its attention runs the jnp path
    (CPU), else the kernels' [B, S, Hkv, Dh] (the target's rule: transformer.KVCache)."""
    return default_head_major(self.layer_config)

  def _empty_cache(self, batch, capacity):
    """(k, v) of the head's one-layer cache, zeros in its layout (head_major_cache) and the
    target's activation dtype (models.matmul.activation_dtype)."""
    c = self.layer_config
    shape = ((batch, c.num_kv_heads, capacity, c.head_dim) if self.head_major_cache else
             (batch, capacity, c.num_kv_heads, c.head_dim))
    # The target's activation dtype: bf16 beside a bf16 target on an accelerator (the kernel
    # then runs in bf16, as the target's does), float32 on CPU and for float32 targets.
    dtype = jnp.dtype(matmul.activation_dtype(self.target_config))
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

  def _step(self, params, target_params, tokens, feature, k, v, offsets, positions=None,
            tree_mask=None):
    """One cached head forward over T new pairs: next tokens int32 [B, T] and features
    [B, T, D] at slots offsets[b] .. offsets[b]+T-1 -> (o [B, T, D], k, v). positions int32
    [B, T] (default the slots) and tree_mask bool [B, T, W] (default causal; W >= T: over the
    last W slots, which end with the new ones) are for draft trees. Subclasses that override
    it (EAGLE3) keep both arguments."""
    x = self.combine(params, target_params, tokens, feature)
    return self._layer(params, x, k, v, offsets, positions, tree_mask)

  def _pre_attention(self, params, target_params, tokens, feature):
    """(residual [B, T, D], attention input [B, T, D_in]) of the head's layer, for `unroll`."""
    x = self.combine(params, target_params, tokens, feature)
    return x, rms_norm(x, params["layer"]["attn_norm"], self.layer_config.rms_norm_eps)

  def _propose_token(self, params, target_params, feature, key, sampling, greedy):
    """One draft from the head's output `feature` [B, D] -> (tokens int32 [B], q [B, V] or
    None when drafting deterministically)."""
    return self._draw(self.logits(params, target_params, feature), key, sampling, greedy)

  # ----------------------------------------------------------------------- drafter interface

  # The head's weights in the target's CPU execution layout (what a draft step reads).
  DENSE_WEIGHTS = ("fc", "fuse", "lm_head")

  def prepare(self, params):
    """Once per generate() call, before the loop (and once per drafter outside the jit by
    decoding.compiled): the head's layer and its 2-D projections in the target's CPU execution
    layout (models.llama.layout.head_layer_layout / dense_layout: fused, stored [out, in]);
    the same math. On accelerators the params as they are. Idempotent."""
    if not isinstance(params, dict):
      return params
    out = dict(params)
    if "layer" in out:
      out["layer"] = layout.head_layer_layout(out["layer"])
    return layout.dense_layout(out, self.DENSE_WEIGHTS)

  def init_state(self, params, prefill: PrefillInfo):
    """The prompt's pairs (f_j, token j+1), j < P, through the head's layer at slots 0..P-1,
    in chunks of `prefill_chunk` positions by the target's own chunked prefill
    (models.prefill.chunked_prefill, the head's output o standing for its logits), so the
    head's activations are [B, C, ...] rather than [B, P, ...] (at 8B, B = 8, P = 512 the
    unchunked MLP alone held two float32 [B, P, 14336] buffers)."""
    b, s = prefill.tokens.shape
    p = prefill.prompt_tokens.shape[1]
    c = max(1, min(int(self.prefill_chunk), p))
    padded = -(-p // c) * c                     # chunked_prefill pads the tokens to this
    pad = lambda x: None if x is None else jnp.pad(
        x, ((0, 0), (0, padded - p)) + ((0, 0),) * (x.ndim - 2))
    hidden, layer_hidden = pad(prefill.hidden), tuple(pad(h) for h in prefill.layer_hidden)
    nxt = jnp.pad(prefill.tokens, ((0, 0), (0, 1)))[:, 1:p + 1]                    # token j+1

    def forward(tokens, cache, offsets, last, layers):
      del layers
      piece = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(
          x, offsets[0], tokens.shape[1], axis=1)
      feats = self.target_feature(params, piece(hidden), tuple(map(piece, layer_hidden)))
      o, k, v = self._step(params, prefill.target_params, tokens, feats, *cache, offsets)
      o_last = jnp.take_along_axis(o, jnp.maximum(last, 0)[:, None, None], axis=1)
      return ForwardOutput(o_last, None, (), (k, v))

    out = chunked_prefill(forward, nxt, prefill.prompt_lens, self._empty_cache(b, s), chunk=c,
                          keep_hidden=False)
    k, v = out.cache
    return FeatureHeadState(k=k, v=v, next_feature=out.last_logits)   # float32 [B, D]

  def _draw(self, logits, key, sampling, greedy=False):
    if self.greedy_drafts or greedy:
      return jnp.argmax(logits, -1).astype(jnp.int32), None
    q = sampling_lib.probs(logits, sampling)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(logits.shape[0]))
    return jax.vmap(sampling_lib.sample)(keys, q), q

  def propose(self, params, state: FeatureHeadState, ctx: DraftContext):
    k_draft = ctx.num_draft
    keys = jax.random.split(ctx.key, k_draft)
    feature, kc, vc = state.next_feature, state.k, state.v
    greedy = self.greedy_drafts or ctx.greedy
    if ctx.rolled and k_draft > 2:          # steps 1..K-2 as a loop: the same drafts
      b = feature.shape[0]
      v = self.target_config.vocab_size

      def step(i, carry):
        feature, kc, vc, drafts, qs = carry
        tok, q = self._propose_token(params, ctx.target_params, feature, keys[i],
                                     ctx.sampling, ctx.greedy)
        drafts = drafts.at[:, i].set(tok)
        if not greedy:
          qs = qs.at[:, i].set(q)
        o, kc, vc = self._step(params, ctx.target_params, tok[:, None], feature[:, None], kc, vc,
                               ctx.lengths - 1 + i)
        return o[:, 0], kc, vc, drafts, qs

      qs0 = jnp.zeros((b, k_draft, v), jnp.float32) if not greedy else jnp.zeros((0,))
      feature, kc, vc, drafts, qs = jax.lax.fori_loop(
          0, k_draft - 1, step, (feature, kc, vc, jnp.zeros((b, k_draft), jnp.int32), qs0))
      tok, q = self._propose_token(params, ctx.target_params, feature, keys[k_draft - 1],
                                   ctx.sampling, ctx.greedy)
      drafts = drafts.at[:, k_draft - 1].set(tok)
      probs = None if greedy else qs.at[:, k_draft - 1].set(q)
      return drafts, probs, state.replace(k=kc, v=vc)
    drafts, qs = [], []
    for i in range(k_draft):
      tok, q = self._propose_token(params, ctx.target_params, feature, keys[i], ctx.sampling,
                                   ctx.greedy)
      drafts.append(tok)
      qs.append(q)
      if i + 1 < k_draft:
        o, kc, vc = self._step(params, ctx.target_params, tok[:, None], feature[:, None], kc, vc,
                               ctx.lengths - 2 + i + 1)
        feature = o[:, 0]
    probs = None if (self.greedy_drafts or ctx.greedy) else jnp.stack(qs, 1)
    # The speculative slots are rewritten by commit; keep the cache buffers, not the feature.
    return jnp.stack(drafts, 1), probs, state.replace(k=kc, v=vc)

  def commit(self, params, state: FeatureHeadState, tokens, n_accepted, verify: VerifyInfo):
    if verify.target_params is None:
      raise ValueError(f"{self.kind} heads need VerifyInfo.target_params (the target's "
                       "embedding) in commit")
    feats = self.target_feature(params, verify.hidden, verify.layer_hidden)       # [B, K+1, D]
    o, k, v = self._step(params, verify.target_params, jnp.maximum(tokens, 0), feats, state.k,
                         state.v, verify.lengths_before - 1)
    last = jnp.take_along_axis(o, n_accepted[:, None, None], axis=1)[:, 0]
    return FeatureHeadState(k=k, v=v, next_feature=last)

  def propose_tree(self, params, state: FeatureHeadState, ctx: DraftContext, spec):
    """EAGLE-2's dynamic tree (spec_jax.tree.build_dynamic_tree). A node at depth d is the
    pair (its parent's feature, its token) at RoPE position lengths-2+d, as in a chain. Frontier
    node i of the tree so far sits at head-cache slot lengths-1+i (speculative slots, rewritten
    by commit_tree along the accepted path); each depth's new frontier goes through the head's
    layer once, reading its parents' outputs o (the root's: next_feature) and attending to the
    committed slots plus its ancestors through a tree mask over the tree's slots."""
    tp = ctx.target_params
    nf = state.next_feature
    b, d = nf.shape
    lengths = ctx.lengths

    def expand(tokens, parents, depths, start, carry):
      o_prev, k, v = carry
      new_par = parents[:, start:]
      t_new = new_par.shape[1]
      root_feat = jnp.broadcast_to(nf[:, None, :], (b, t_new, d))
      if o_prev is None:
        parent_feat = root_feat
      else:
        gathered = jnp.take_along_axis(o_prev, jnp.maximum(new_par, 0)[:, :, None], axis=1)
        parent_feat = jnp.where(new_par[:, :, None] < 0, root_feat, gathered)
      mask = tree_lib.ancestor_mask(parents, spec.depth)[:, start:]         # [B, t_new, T]
      o, k, v = self._step(params, tp, tokens[:, start:], parent_feat, k, v, lengths - 1 + start,
                           positions=lengths[:, None] - 2 + depths[:, start:], tree_mask=mask)
      o_all = o if o_prev is None else jnp.concatenate([o_prev, o], axis=1)
      return self.proposal_logits(params, tp, o), (o_all, k, v)

    candidates = "topk" if self.greedy_drafts else spec.candidates_for(ctx.greedy)
    # An EAGLE-3 draft vocabulary: the tree is built over it (logits and q of V_d tokens).
    tree, (_, k, v) = tree_lib.build_dynamic_tree(
        self.proposal_logits(params, tp, nf), expand, (None, state.k, state.v), spec,
        key=ctx.key, sampling=ctx.sampling, candidates=candidates, vocab=self.proposal_vocab)
    return tree, state.replace(k=k, v=v)

  # ----------------------------------------------------------------------- training

  def unroll(self, params, target_params, tokens, feats, steps: int = 1):
    """Training forward over whole windows, without a cache.

    Args:
      tokens: int32 [B, T] a window of text; feats: [B, T, D] the target's features f_j
        (target_feature of a forward over `tokens`).
      steps: training-time-test steps (1 = teacher forcing only).
    Returns:
      outs: list of `steps` arrays [B, T-1, D]: outs[s-1][:, j] is the head's output at slot j
        (predicting f_{j+1} and token j+2) when slots j-s+2..j hold the head's own earlier
        predictions (s-1 drafted steps) and slots <= j-s+1 the target's features. Entries with
        j < s-1 have no real prefix; mask them out of the loss.
    """
    cfg = self.layer_config
    lp = params["layer"]
    nxt = tokens[:, 1:]
    t = nxt.shape[1]
    b = tokens.shape[0]
    inv_freq = rope_inv_freq(cfg)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    eps = cfg.rms_norm_eps
    hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = hq // hkv
    slot = jnp.arange(t)
    ks, vs, outs = [], [], []
    feature = feats[:, :-1].astype(jnp.float32)
    for s in range(1, steps + 1):
      if s > 1:
        feature = _shift_right(outs[-1], 1)
      x, h = self._pre_attention(params, target_params, nxt, feature)
      q, k, v = (matmul.dense(h, lp[name]) for name in ("wq", "wk", "wv"))
      if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
      q = q.reshape(b, t, hkv, group, dh)
      k = k.reshape(b, t, hkv, dh)
      v = v.reshape(b, t, hkv, dh)
      if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], eps)
        k = rms_norm(k, lp["k_norm"], eps)
      q = apply_rope(q.reshape(b, t, hq, dh), positions, inv_freq).reshape(b, t, hkv, group, dh)
      k = apply_rope(k, positions, inv_freq)
      ks.append(k)
      vs.append(v)
      scale = dh ** -0.5
      # Real prefix: step-1 keys at slots i <= j-(s-1).
      scores = matmul.einsum("bthgd,bshd->bhgts", q, ks[0]) * scale
      visible = slot[None, :] <= slot[:, None] - (s - 1)                   # [T(query), T(key)]
      scores = jnp.where(visible, scores, -1e30)
      # Drafted slots: step-r keys at slot j-(s-r), r = 2..s (a diagonal each).
      diag_k = [_shift_right(ks[r - 1], s - r) for r in range(2, s + 1)]
      diag_v = [_shift_right(vs[r - 1], s - r) for r in range(2, s + 1)]
      diag = [matmul.einsum("bthgd,bthd->bhgt", q, kk)[..., None] * scale for kk in diag_k]
      all_scores = jnp.concatenate([scores] + diag, axis=-1)
      weights = jax.nn.softmax(all_scores, axis=-1)
      attn = matmul.einsum("bhgts,bshd->bthgd", weights[..., :t], vs[0])
      for r, vv in enumerate(diag_v):
        attn = attn + matmul.einsum("bhgt,bthd->bthgd", weights[..., t + r], vv)
      x = x + matmul.dense(attn.reshape(b, t, hq * dh), lp["wo"])
      h = rms_norm(x, lp["mlp_norm"], eps)
      inner = jax.nn.silu(matmul.dense(h, lp["w_gate"])) * matmul.dense(h, lp["w_up"])
      x = x + matmul.dense(inner, lp["w_down"])
      outs.append(x)
    return outs


def _shift_right(x, d):
  """x [B, T, ...] -> y with y[:, j] = x[:, j-d] (zeros for j < d)."""
  if d == 0:
    return x
  pad = jnp.zeros_like(x[:, :d])
  return jnp.concatenate([pad, x[:, :-d]], axis=1)
