"""The Gemma 4 assistant: Gemma 4's own multi-token-prediction drafter (`*-it-assistant`).

    target = sj.load("google/gemma-4-E2B-it")
    assistant = sj.drafters.load("google/gemma-4-E2B-it-assistant", target)
    out = sj.generate(target, prompts, drafter=assistant, num_draft=4)

A few Gemma 4 decoder layers with no KV cache of their own: every layer's queries attend to the
TARGET's KV cache (DraftContext.target_cache), the layer of its type that the target's own
KV-shared layers read (the last non-shared sliding / full layer). One draft step, for the token
x after the last committed one (transformers' SinglePositionMultiTokenCandidateGenerator):

    a = pre_projection(concat(E_target[x] * sqrt(D_target), h))       [B, D_assistant]
    a = assistant layers at RoPE position lengths-1 (constant within a round), attending to the
        target's entries < lengths-1: all of them on full layers, the last sliding_window + 1
        on sliding layers (the reference's flipped bidirectional window)
    n = final_norm(a);  logits = head(n);  h' = post_projection(n)     [B, V], [B, D_target]

where h is, for the first draft of a round, the target's final-normed hidden state that
predicted the last committed token (at position lengths-2: the verify's output at n_accepted,
or the prefill's at prompt_len-1), and after that the previous step's h' with x the previous
draft. The head is the tied full-vocabulary LM head, or with use_ordered_embeddings the
centroid head: n -> centroid logits [C], the top centroid_intermediate_top_k centroids, and
logits only for their tokens (token_ordering lists each centroid's V/C tokens).

Lossless sampling: q is ONE distribution, used for the draw, the acceptance test and the
residual: sampling.probs of these logits with -inf outside the selected tokens (the softmax over
the selected tokens). transformers fills unselected tokens with a floor value (min - 1) and
drafts the argmax: a q that is not the distribution the drafts came from, which is not lossless
at T > 0 (tests/test_gemma_assistant.py measures both).

Trees (propose_tree): EAGLE-2's dynamic tree over the assistant's top-k (or sampled)
candidates: a node's children come from one assistant step on (its token, its parent step's h'),
all at the same position; nodes never attend to each other (the assistant has no cache), so a
depth's frontier is one batched step with the frontier folded into the query heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax import tree as tree_lib
from spec_jax.drafters.base import (DraftContext, FrozenDrafter, PrefillInfo, VerifyInfo,
                                   frozen_drafter, params_field)
from spec_jax.models.blocks import AttentionSpec, attention
from spec_jax.models.cache import KVCache
from spec_jax.models.gemma import forward as gemma, plan as gemma_layout


@dataclasses.dataclass(frozen=True)
class AssistantHead:
  """The assistant's static head settings. backbone_hidden_size: D_target; ordered: the
  centroid head (num_centroids C, top_k centroids kept) instead of the full LM head."""
  backbone_hidden_size: int
  ordered: bool = False
  num_centroids: int = 0
  top_k: int = 0


@flax.struct.dataclass
class AssistantState:
  """h: [B, D_target] the target's final-normed hidden state that predicted the last committed
  token (the first draft's input)."""
  h: jax.Array


def _fold_queries(q, num_kv_heads: int):
  """q [B, F, Hq, Dh] -> [B, 1, Hkv*F*G, Dh]: F independent queries as extra query heads of
  their kv head (head kv*F*G + f*G + g), so one T = 1 attention serves a whole frontier."""
  b, f, hq, dh = q.shape
  g = hq // num_kv_heads
  q = q.reshape(b, f, num_kv_heads, g, dh).transpose(0, 2, 1, 3, 4)
  return q.reshape(b, 1, num_kv_heads * f * g, dh)


def _unfold_output(o, f: int, num_heads: int, num_kv_heads: int):
  b, _, _, dh = o.shape
  g = num_heads // num_kv_heads
  o = o.reshape(b, num_kv_heads, f, g, dh).transpose(0, 2, 1, 3, 4)
  return o.reshape(b, f, num_heads, dh)


def check_pair(decoder_config, head: AssistantHead, target_config) -> None:
  """ValueError unless the assistant can draft for this target (a Gemma 4 of the same
  vocabulary and width whose cache has the KV shapes the assistant's queries read)."""
  if target_config.model_type != "gemma4":
    raise ValueError(f"the Gemma 4 assistant drafts for Gemma 4 targets only, got model_type "
                     f"{target_config.model_type!r}")
  if target_config.vocab_size != decoder_config.vocab_size:
    raise ValueError(f"the assistant has a vocabulary of {decoder_config.vocab_size} tokens but "
                     f"the target has {target_config.vocab_size}")
  if target_config.hidden_size != head.backbone_hidden_size:
    raise ValueError(f"the assistant was made for a target of hidden_size "
                     f"{head.backbone_hidden_size} (backbone_hidden_size), the target has "
                     f"{target_config.hidden_size}")
  target_layout = gemma_layout.layout(target_config)
  for plan in gemma_layout.layout(decoder_config).layers:
    store = target_layout.store_layer(plan.layer_type)
    if (store.num_kv_heads, store.head_dim) != (plan.num_kv_heads, plan.head_dim):
      raise ValueError(
          f"assistant layer {plan.index} ({plan.layer_type}) reads {plan.num_kv_heads} kv heads "
          f"of dim {plan.head_dim}; the target's {plan.layer_type} cache has "
          f"{store.num_kv_heads} kv heads of dim {store.head_dim}")


def assistant_step(params, decoder_config, head: AssistantHead, target_config, target_params,
                   target_cache, lengths, tokens, h):
  """One draft step for F independent queries per row (module docstring).

  tokens int32 [B, F]; h [B, F, D_target]; lengths int32 [B] committed tokens (the target cache
  holds positions < lengths-1). Returns (logits float32 [B, F, V] with -inf outside the
  centroid head's selected tokens, h' [B, F, D_target])."""
  c = decoder_config
  dtype = jnp.dtype(c.dtype)
  b, f = tokens.shape
  e = gemma.embed_tokens(target_params, target_config, tokens)
  x = gemma.dot(jnp.concatenate([e.astype(dtype), h.astype(dtype)], -1),
                params["pre_projection"]).astype(dtype)
  positions = jnp.broadcast_to((lengths - 1)[:, None], (b, f)).astype(jnp.int32)
  rope = gemma.rope_by_type(c, positions)
  target_layout = gemma_layout.layout(target_config)
  kv_lengths = (lengths - 1).astype(jnp.int32)
  eps = c.rms_norm_eps
  for plan in gemma_layout.layout(c).layers:
    lp = params["layers"][plan.index]
    store = target_layout.store_layer(plan.layer_type)
    k_all = target_cache.k[store.cache_group][store.cache_slot]
    v_all = target_cache.v[store.cache_group][store.cache_slot]
    hn = gemma.norm(x, lp["attn_norm"], eps).astype(dtype)
    q = _fold_queries(gemma.project_q(c, plan, lp, hn, rope[plan.layer_type]),
                      store.num_kv_heads)
    # The query sits after the cache's last valid entry (slot lengths-2): a window of W+1
    # there is the reference's last W+1 entries.
    window = None if plan.window is None else plan.window + 1
    attn = attention(AttentionSpec(c.attention_impl, window), q.astype(k_all.dtype),
                      k_all, v_all, kv_lengths, None, target_cache.head_major)
    attn = _unfold_output(attn, f, c.num_heads, store.num_kv_heads).astype(dtype)
    o = gemma.dot(attn.reshape(b, f, c.num_heads * plan.head_dim), lp["wo"]).astype(dtype)
    x = x + gemma.norm(o, lp["post_attn_norm"], eps).astype(dtype)
    hn = gemma.norm(x, lp["mlp_norm"], eps).astype(dtype)
    x = x + gemma.norm(gemma.mlp(c, lp, hn), lp["post_mlp_norm"], eps).astype(dtype)
    if c.layer_scalar:
      x = x * lp["layer_scalar"].astype(dtype)
  normed = gemma.norm(x, params["final_norm"], eps).astype(dtype)
  h_next = gemma.dot(normed, params["post_projection"]).astype(dtype)
  return head_logits(params, c, head, normed), h_next


def head_logits(params, decoder_config, head: AssistantHead, normed):
  """normed [B, F, D_a] -> float32 logits [B, F, V]: the tied LM head, or the centroid head
  (only the selected centroids' tokens finite)."""
  table = params["embed"] if decoder_config.tie_embeddings else params["lm_head"].T   # [V, D_a]
  if not head.ordered:
    return jax.lax.dot_general(normed, table, (((2,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
  b, f, _ = normed.shape
  v = decoder_config.vocab_size
  centroid_logits = gemma.dot(normed, params["centroids"])                       # [B, F, C]
  _, top = jax.lax.top_k(centroid_logits, head.top_k)                             # [B, F, k]
  per_centroid = params["token_ordering"].reshape(head.num_centroids, v // head.num_centroids)
  selected = per_centroid[top].reshape(b, f, -1)                                  # [B, F, n]
  rows = jnp.take(table, selected, axis=0)                                        # [B, F, n, D]
  picked = jnp.einsum("bfd,bfnd->bfn", normed, rows, preferred_element_type=jnp.float32)
  bi = jnp.arange(b)[:, None, None]
  fi = jnp.arange(f)[None, :, None]
  return jnp.full((b, f, v), -jnp.inf, jnp.float32).at[bi, fi, selected].set(picked)


@frozen_drafter
class Gemma4Assistant(FrozenDrafter):
  """Drafts with a Gemma 4 assistant checkpoint (module docstring). Build it with
  `sj.drafters.load(folder, target)` (spec_jax.drafters.formats.gemma4_assistant).

  Args:
    params: the assistant's pytree (pre_projection [2 D_t, D_a], post_projection [D_a, D_t],
      layers (q-only Gemma 4 layers), final_norm, embed [V, D_a] (the tied LM head) or
      lm_head, and for the centroid head centroids [D_a, C], token_ordering int32 [V]).
    decoder_config: the assistant decoder's ModelConfig (its rope, norms, head dims).
    head: AssistantHead. target_config: the target's ModelConfig.
    greedy_drafts: propose the argmax deterministically (draft_probs None).
  """

  supports_tree = True

  params: Any = params_field()
  decoder_config: Any = dataclasses.field()
  head: AssistantHead = dataclasses.field()
  target_config: Any = dataclasses.field()
  greedy_drafts: bool = False

  def __post_init__(self):
    check_pair(self.decoder_config, self.head, self.target_config)
    object.__setattr__(self, "greedy_drafts", bool(self.greedy_drafts))

  def check_compatible(self, target) -> None:
    check_pair(self.decoder_config, self.head, target.config)
    if target.config != self.target_config:
      raise ValueError("this assistant drafter was built for another target config; load it "
                       "again with sj.drafters.load(folder, target)")

  def step(self, params, target_params, target_cache, lengths, tokens, h):
    """assistant_step with this drafter's static settings."""
    return assistant_step(params, self.decoder_config, self.head, self.target_config,
                          target_params, target_cache, lengths, tokens, h)

  def init_state(self, params, prefill: PrefillInfo):
    h = jnp.take_along_axis(prefill.hidden, (prefill.prompt_lens - 1)[:, None, None], axis=1)
    return AssistantState(h=h[:, 0])

  def commit(self, params, state: AssistantState, tokens, n_accepted, verify: VerifyInfo):
    h = jnp.take_along_axis(verify.hidden, n_accepted[:, None, None], axis=1)[:, 0]
    return AssistantState(h=h.astype(state.h.dtype))

  def _draw(self, logits, key, sampling, greedy):
    if greedy:
      return jnp.argmax(logits, -1).astype(jnp.int32), None
    q = sampling_lib.probs(logits, sampling)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(logits.shape[0]))
    return jax.vmap(sampling_lib.sample)(keys, q), q

  def _last_token(self, ctx: DraftContext):
    """The last committed token [B, 1] (the first draft step's input)."""
    return jnp.take_along_axis(ctx.tokens, (ctx.lengths - 1)[:, None], axis=1)

  def _target_cache(self, ctx: DraftContext):
    """ctx.target_cache; a caller without one (the bench's drafter timers) gets an all-zero
    cache of the target's shape: the same cost, drafts that mean nothing (still lossless)."""
    if ctx.target_cache is not None:
      return ctx.target_cache
    b, s = ctx.tokens.shape
    return KVCache.zeros(self.target_config, b, s)

  def propose(self, params, state: AssistantState, ctx: DraftContext):
    k = ctx.num_draft
    greedy = self.greedy_drafts or ctx.greedy
    tok = self._last_token(ctx)
    keys = jax.random.split(ctx.key, k)
    b = tok.shape[0]
    cache = self._target_cache(ctx)
    run = lambda tok, h: self.step(params, ctx.target_params, cache, ctx.lengths, tok, h)

    def one(i, tok, h):
      logits, h = run(tok, h)
      draft, q = self._draw(logits[:, 0], keys[i], ctx.sampling, greedy)
      return draft, q, h

    h = state.h[:, None].astype(jnp.dtype(self.decoder_config.dtype))
    if ctx.rolled and k > 2:                 # the same drafts as a loop (smaller program)
      v = self.decoder_config.vocab_size

      def body(i, carry):
        tok, h, drafts, qs = carry
        draft, q, h = one(i, tok, h)
        drafts = drafts.at[:, i].set(draft)
        if not greedy:
          qs = qs.at[:, i].set(q)
        return draft[:, None], h, drafts, qs

      qs0 = jnp.zeros((b, k, v), jnp.float32) if not greedy else jnp.zeros((0,), jnp.float32)
      _, _, drafts, qs = jax.lax.fori_loop(0, k, body,
                                           (tok, h, jnp.zeros((b, k), jnp.int32), qs0))
      return drafts, None if greedy else qs, state
    drafts, qs = [], []
    for i in range(k):
      draft, q, h = one(i, tok, h)
      drafts.append(draft)
      qs.append(q)
      tok = draft[:, None]
    return jnp.stack(drafts, 1), None if greedy else jnp.stack(qs, 1), state

  def propose_tree(self, params, state: AssistantState, ctx: DraftContext, spec):
    """EAGLE-2's dynamic tree over the assistant's candidates (module docstring)."""
    last = self._last_token(ctx)
    cache = self._target_cache(ctx)
    run = lambda tok, h: self.step(params, ctx.target_params, cache, ctx.lengths, tok, h)
    h0 = state.h[:, None].astype(jnp.dtype(self.decoder_config.dtype))
    root_logits, h_root = run(last, h0)                      # [B,1,V], [B,1,D]

    def expand(tokens, parents, depths, start, h_all):
      new_par = parents[:, start:]
      root = jnp.broadcast_to(h_root, (h_root.shape[0], new_par.shape[1], h_root.shape[2]))
      if h_all is None:
        parent_h = root
      else:
        gathered = jnp.take_along_axis(h_all, jnp.maximum(new_par, 0)[:, :, None], axis=1)
        parent_h = jnp.where(new_par[:, :, None] < 0, root, gathered)
      logits, h_new = run(tokens[:, start:], parent_h)
      h_all = h_new if h_all is None else jnp.concatenate([h_all, h_new], axis=1)
      return logits, h_all

    candidates = "topk" if self.greedy_drafts else spec.candidates_for(ctx.greedy)
    tree, _ = tree_lib.build_dynamic_tree(root_logits[:, 0], expand, None, spec, key=ctx.key,
                                          sampling=ctx.sampling, candidates=candidates)
    return tree, state

