"""A separate small draft model with its own KV cache (Leviathan et al. 2023).

The draft model keeps a KV cache aligned with the target's positions. At each propose, its
cache is valid for positions < lengths-2 at least (after a round whose drafts were all
accepted, the last draft was never fed to it), so the first draft step always feeds the two
last committed tokens at positions lengths-2, lengths-1; rewriting the slot at lengths-2 with
the same token is harmless. Then K-1 single-token steps. No extra state is needed.

Trees (spec_jax.tree, EAGLE-2's dynamic tree on the draft model): a tree round writes its
frontier nodes into the draft cache past the last committed token, so the cache is only known
valid below the old lengths, and a round commits at most D+1 tokens: each propose_tree
re-feeds the last D+1 committed tokens (a causal block; the root's logits give depth 1), then
one forward per further depth over the new frontier nodes, placed after the block and the
earlier frontiers, each seeing the block up to the root and its ancestors (a tree mask over
those slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax import tree as tree_lib
from spec_jax.drafters.base import DraftContext, Drafter, PrefillInfo
from spec_jax.models.transformer import KVCache, forward, prepare_params


def _row_keys(key, batch):
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))


def check_same_vocabulary(draft, target, what="draft model"):
  """Raises ValueError when `draft` and `target` (Models) do not share one vocabulary."""
  dv, tv = draft.config.vocab_size, target.config.vocab_size
  if dv != tv:
    raise ValueError(f"the {what} has a vocabulary of {dv} tokens but the target has {tv}: "
                     "speculative decoding needs the same tokenizer and vocabulary for both")
  dt, tt = draft.tokenizer, target.tokenizer
  if dt is not None and tt is not None:
    dp, tp = list(dt.pieces()), list(tt.pieces())
    if dp != tp:
      diff = next((i for i, (a, b) in enumerate(zip(dp, tp)) if a != b), min(len(dp), len(tp)))
      raise ValueError(
          f"the {what}'s tokenizer differs from the target's (first difference at token id "
          f"{diff}: {dp[diff] if diff < len(dp) else None!r} vs "
          f"{tp[diff] if diff < len(tp) else None!r}): speculative decoding needs the same "
          "vocabulary, token for token")


class DraftModel(Drafter):
  """Drafts K tokens autoregressively from a small model.

  By default each draft is sampled from the same `sampling.probs` transform as the target, so
  draft_probs are the real q. With greedy_drafts=True the drafts are the draft model's argmax,
  proposed as deterministic tokens (draft_probs None: q one-hot), also lossless.
  """

  supports_tree = True

  def __init__(self, model, greedy_drafts: bool = False):
    self.model = model
    self.config = model.config
    self.params = model.params
    self.greedy_drafts = bool(greedy_drafts)

  def _static_key(self):
    return ("DraftModel", self.config, self.greedy_drafts)

  def check_compatible(self, target) -> None:
    check_same_vocabulary(self.model, target)

  def prepare(self, params):
    return prepare_params(params, self.config)

  def init_state(self, params, prefill: PrefillInfo):
    b, s = prefill.tokens.shape
    cache = KVCache.zeros(self.config, b, s)
    out = forward(params, self.config, prefill.prompt_tokens, cache, jnp.zeros((b,), jnp.int32))
    return out.cache

  def propose(self, params, cache, ctx: DraftContext):
    b, k = ctx.tokens.shape[0], ctx.num_draft
    keys = jax.random.split(ctx.key, k)
    idx = jnp.stack([ctx.lengths - 2, ctx.lengths - 1], axis=1)
    inputs = jnp.take_along_axis(ctx.tokens, idx, axis=1)
    out = forward(params, self.config, inputs, cache, ctx.lengths - 2)
    cache, logits = out.cache, out.logits[:, -1]
    greedy = self.greedy_drafts or ctx.greedy
    drafts, qs = [], []
    for i in range(k):
      if greedy:
        tok, q = jnp.argmax(logits, axis=-1).astype(jnp.int32), None
      else:
        q = sampling_lib.probs(logits, ctx.sampling)
        tok = jax.vmap(sampling_lib.sample)(_row_keys(keys[i], b), q)
      drafts.append(tok)
      qs.append(q)
      if i + 1 < k:
        out = forward(params, self.config, tok[:, None], cache, ctx.lengths + i)
        cache, logits = out.cache, out.logits[:, 0]
    draft_probs = None if greedy else jnp.stack(qs, 1)
    return jnp.stack(drafts, 1), draft_probs, cache

  def propose_tree(self, params, cache, ctx: DraftContext, spec):
    b, s = ctx.tokens.shape
    w = spec.depth + 1
    lengths = ctx.lengths
    start = jnp.maximum(lengths - w, 0)             # a short row's block runs past its root
    idx = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    block = jnp.take_along_axis(ctx.tokens, jnp.minimum(idx, s - 1), axis=1)
    root_at = lengths - 1 - start
    out = forward(params, self.config, block, cache, start)
    root_logits = jnp.take_along_axis(out.logits, root_at[:, None, None], axis=1)[:, 0]
    sees_block = jnp.arange(w)[None, None, :] <= root_at[:, None, None]     # [B, 1, w]

    def expand(tokens, parents, depths, first, cache):
      # Tree node i sits at slot start+w+i; the new ones (first..) see the block up to the
      # root and their ancestors: a mask over the w + T slots from `start`.
      t = tokens.shape[1]
      t_new = t - first
      mask = jnp.concatenate([jnp.broadcast_to(sees_block, (b, t_new, w)),
                              tree_lib.ancestor_mask(parents, spec.depth)[:, first:]], axis=2)
      out = forward(params, self.config, tokens[:, first:], cache, start + w + first,
                    positions=lengths[:, None] - 1 + depths[:, first:], tree_mask=mask)
      return out.logits, out.cache

    candidates = "topk" if (self.greedy_drafts or ctx.greedy) else spec.candidates
    return tree_lib.build_dynamic_tree(root_logits, expand, out.cache, spec, key=ctx.key,
                                       sampling=ctx.sampling, candidates=candidates)
