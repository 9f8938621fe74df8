"""A separate small draft model with its own KV cache (Leviathan et al. 2023).

The draft model keeps a KV cache aligned with the target's positions, and `synced` [B]: slots
< synced hold the right entries. At each propose the cache must be valid for positions
< lengths-2; the first draft step then feeds the two last committed tokens at positions
lengths-2, lengths-1 (after a round whose drafts were all accepted the last draft was never
fed, so lengths-2 may be missing; rewriting a valid slot with the same token is harmless),
then K-1 single-token steps. After a round of K >= 1 drafts with n accepted, slots
< lengths_before + min(n, K-1) are valid (the fed drafts that were accepted), which is
>= the new lengths - 2: a chain of K >= 1 rounds never needs more. Where a wrapper verified
other drafts in their place (LookupFirst's lookup rows: `disown`), only slots < lengths_before
are, and the wrapper calls catch_up before the next propose.

A K = 0 round (the governor's plain step) does not run the draft model: commit leaves the
state as it is, so the cache falls behind by one token per such round. Before the next
propose the governor calls `catch_up` (Drafter.catch_up): while a row has synced < lengths-2,
it feeds that row's next `catch_up_chunk` committed tokens (one [B, chunk] forward per
iteration of a lax.while_loop; rows already in sync rewrite valid slots or slots past their
length, which are never read before they are written again). Catching up g tokens costs
ceil(g / chunk) batched forwards, paid only when drafting resumes, instead of one draft step
in every plain round. Under the governor (PrefillInfo.lazy) even the prompt's prefill is left
to catch_up: a batch that never drafts never runs the draft model.

Trees (spec_jax.tree, EAGLE-2's dynamic tree on the draft model): a tree round writes its
frontier nodes into the draft cache past the last committed token, so after it the cache is
only known valid below the old lengths (synced = lengths_before), and a round commits at most
D+1 tokens: each propose_tree re-feeds the last D+1 committed tokens (a causal block; the
root's logits give depth 1), then one forward per further depth over the new frontier nodes,
placed after the block and the earlier frontiers, each seeing the block up to the root and its
ancestors (a tree mask over those slots). Trees do not run under the governor (no K = 0
rounds, no catch_up).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from kernels_pallas import platform as platform_lib
from spec_jax import sampling as sampling_lib
from spec_jax import tree as tree_lib
from spec_jax.drafters.base import (DraftContext, FrozenDrafter, PrefillInfo, VerifyInfo,
                                   derived_field, frozen_drafter)
from spec_jax.models.prefill import chunked_prefill
from spec_jax.models.layout import prepare_params
from spec_jax.models.transformer import KVCache, forward


def _row_keys(key, batch):
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))


@flax.struct.dataclass
class DraftModelState:
  """cache: the draft model's KVCache [L, B, S, Hkv, Dh]; synced: int32 [B], slots < synced
  hold the right entries (see the module docstring); own: bool [B], the row verifies the
  drafts this propose fed into the cache (False where a wrapper, LookupFirst, put other drafts
  in their place: commit then counts none of them as fed)."""
  cache: KVCache
  synced: jax.Array
  own: jax.Array


# Tokenizer pairs already compared piece by piece (generate() checks on every call, and a
# Hugging Face vocabulary of 150k pieces takes tens of ms to list): draft tokenizer ->
# {target tokenizer: (both vocabulary sizes then)}. Weak, so a dropped tokenizer is forgotten.
_SAME_PIECES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _known_same(dt, tt) -> bool:
  if dt is tt:
    return True
  try:
    seen = _SAME_PIECES.get(dt, {}).get(tt)
  except TypeError:                        # a tokenizer that cannot be weakly referenced
    return False
  return seen == (dt.vocab_size, tt.vocab_size)


def check_same_vocabulary(draft, target, what="draft model"):
  """Raises ValueError when `draft` and `target` (Models) do not share one vocabulary."""
  dv, tv = draft.config.vocab_size, target.config.vocab_size
  if dv != tv:
    raise ValueError(f"the {what} has a vocabulary of {dv} tokens but the target has {tv}: "
                     "speculative decoding needs the same tokenizer and vocabulary for both")
  dt, tt = draft.tokenizer, target.tokenizer
  if dt is not None and tt is not None and not _known_same(dt, tt):
    dp, tp = list(dt.pieces()), list(tt.pieces())
    if dp == tp:
      try:
        _SAME_PIECES.setdefault(dt, weakref.WeakKeyDictionary())[tt] = (len(dp), len(tp))
      except TypeError:                    # not weakly referenceable: compared every call
        pass
    else:
      diff = next((i for i, (a, b) in enumerate(zip(dp, tp)) if a != b), min(len(dp), len(tp)))
      raise ValueError(
          f"the {what}'s tokenizer differs from the target's (first difference at token id "
          f"{diff}: {dp[diff] if diff < len(dp) else None!r} vs "
          f"{tp[diff] if diff < len(tp) else None!r}): speculative decoding needs the same "
          "vocabulary, token for token")


def _platforms(names) -> tuple:
  """A platform name or several (DraftModel.rolls_steps_on) -> a tuple of "cpu" / "gpu" /
  "tpu" ("cuda" is "gpu"); ValueError naming what is allowed."""
  names = (names,) if isinstance(names, str) else names
  try:
    return tuple(sorted({platform_lib.normalize(n) for n in names}))
  except (TypeError, ValueError) as e:
    raise ValueError(f"DraftModel rolls_steps_on must name platforms among "
                     f"{platform_lib.PLATFORMS}, got {names!r}") from e


@frozen_drafter
class DraftModel(FrozenDrafter):
  """Drafts K tokens autoregressively from a small model.

  By default each draft is sampled from the same `sampling.probs` transform as the target, so
  draft_probs are the real q. With greedy_drafts=True the drafts are the draft model's argmax,
  proposed as deterministic tokens (draft_probs None: q one-hot), also lossless.
  catch_up_chunk: tokens per forward when the cache catches up after plain (K = 0) rounds.
  rolls_steps_on: the platforms on which a chain decode runs the K-1 later draft steps as a
  loop, the same drafts (why TPU and CPU: decoding.loop.rolls_draft_steps). () unrolls them
  everywhere, e.g. to time both programs on a chip.
  The static configuration is the model's config (`config`) with these; its params are the
  model's (`params`, traced). Another model: `drafter.replace(model=...)`.
  """

  supports_tree = True
  reads_prompt_hidden = False

  model: Any = dataclasses.field(compare=False, repr=False)
  greedy_drafts: bool = False
  catch_up_chunk: int = 16
  rolls_steps_on: tuple = ("cpu", "tpu")
  config: Any = derived_field()
  params: Any = derived_field(compare=False)

  def __post_init__(self):
    chunk = self.catch_up_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
      raise ValueError(f"DraftModel catch_up_chunk must be an integer >= 1, got {chunk!r}")
    object.__setattr__(self, "greedy_drafts", bool(self.greedy_drafts))
    object.__setattr__(self, "rolls_steps_on", _platforms(self.rolls_steps_on))
    if not (hasattr(self.model, "config") and hasattr(self.model, "params")):
      raise ValueError(f"DraftModel takes a model loaded with sj.load(path), got "
                       f"{type(self.model).__name__}")
    object.__setattr__(self, "config", self.model.config)
    object.__setattr__(self, "params", self.model.params)
    if self.model.config.family.commit_cache is not None:
      raise ValueError(f"a {self.model.config.model_type} model (recurrent state) cannot be a "
                       "DraftModel: its cache would keep rejected drafts; use it as the target, "
                       "or a KV-cache model as the draft")

  def with_params(self, params, greedy_drafts=None):
    """The same draft model (configuration) with other weights."""
    changes = {"model": dataclasses.replace(self.model, params=params)}
    if greedy_drafts is not None:
      changes["greedy_drafts"] = bool(greedy_drafts)
    return dataclasses.replace(self, **changes)

  def check_compatible(self, target) -> None:
    check_same_vocabulary(self.model, target)

  def prepare(self, params):
    return prepare_params(params, self.config)

  def init_state(self, params, prefill: PrefillInfo):
    b, s = prefill.tokens.shape
    cache = KVCache.zeros(self.config, b, s)
    if prefill.lazy:                        # catch_up prefills when (if) drafting starts
      return DraftModelState(cache=cache, synced=jnp.zeros((b,), jnp.int32),
                             own=jnp.ones((b,), bool))
    out = chunked_prefill(
        lambda tok, cache, offsets, last, layers: forward(
            params, self.config, tok, cache, offsets, logits_index=last),
        prefill.prompt_tokens, prefill.prompt_lens, cache, keep_hidden=False)
    return DraftModelState(cache=out.cache, synced=prefill.prompt_lens, own=jnp.ones((b,), bool))

  def catch_up(self, params, state: DraftModelState, tokens, lengths) -> DraftModelState:
    """Feeds committed tokens until every row has synced >= lengths - 2 (no work when none
    is behind; see the module docstring). tokens int32 [B, S]; lengths int32 [B]."""
    s = tokens.shape[1]
    chunk = min(self.catch_up_chunk, s)
    need = lengths - 2

    def behind(st):
      return jnp.any(st.synced < need)

    def step(st):
      start = jnp.clip(jnp.minimum(st.synced, need), 0, s - chunk)
      idx = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]
      out = forward(params, self.config, jnp.take_along_axis(tokens, idx, axis=1), st.cache,
                    start)
      synced = jnp.maximum(st.synced, jnp.minimum(start + chunk, lengths))
      return st.replace(cache=out.cache, synced=synced)

    return jax.lax.while_loop(behind, step, state)

  def propose(self, params, state: DraftModelState, ctx: DraftContext):
    b, k = ctx.tokens.shape[0], ctx.num_draft
    cache = state.cache                     # in sync: the governor calls catch_up first
    keys = jax.random.split(ctx.key, k)
    idx = jnp.stack([ctx.lengths - 2, ctx.lengths - 1], axis=1)
    inputs = jnp.take_along_axis(ctx.tokens, idx, axis=1)
    out = forward(params, self.config, inputs, cache, ctx.lengths - 2)
    cache, logits = out.cache, out.logits[:, -1]
    greedy = self.greedy_drafts or ctx.greedy
    one = jnp.ones((b,), jnp.int32)

    def draw(logits, key, hist):
      """A draft from the processed distribution of its own prefix: the committed history
      plus the drafts before it (penalties; hist None without them) -> (tok, q, hist)."""
      if greedy:
        tok, q = sampling_lib.greedy_tokens(logits, ctx.sampling, hist), None
      else:
        q = sampling_lib.probs(logits, ctx.sampling, hist)
        tok = jax.vmap(sampling_lib.sample)(_row_keys(key, b), q)
      return tok, q, None if hist is None else hist.add(tok[:, None], one)

    hist = ctx.history
    if ctx.rolled and k > 2:                # steps 1..K-2 as a loop: the same drafts
      v = logits.shape[-1]

      def step(i, carry):
        cache, logits, drafts, qs, hist = carry
        tok, q, hist = draw(logits, keys[i], hist)
        drafts = drafts.at[:, i].set(tok)
        if not greedy:
          qs = qs.at[:, i].set(q)
        out = forward(params, self.config, tok[:, None], cache, ctx.lengths + i)
        return out.cache, out.logits[:, 0], drafts, qs, hist

      qs0 = jnp.zeros((b, k, v), jnp.float32) if not greedy else jnp.zeros((0,), jnp.float32)
      cache, logits, drafts, qs, hist = jax.lax.fori_loop(
          0, k - 1, step, (cache, logits, jnp.zeros((b, k), jnp.int32), qs0, hist))
      tok, q, _ = draw(logits, keys[k - 1], hist)
      drafts = drafts.at[:, k - 1].set(tok)
      draft_probs = None if greedy else qs.at[:, k - 1].set(q)
      return drafts, draft_probs, DraftModelState(cache=cache, synced=ctx.lengths,
                                                  own=jnp.ones((b,), bool))
    drafts, qs = [], []
    for i in range(k):
      tok, q, hist = draw(logits, keys[i], hist)
      drafts.append(tok)
      qs.append(q)
      if i + 1 < k:
        out = forward(params, self.config, tok[:, None], cache, ctx.lengths + i)
        cache, logits = out.cache, out.logits[:, 0]
    draft_probs = None if greedy else jnp.stack(qs, 1)
    return jnp.stack(drafts, 1), draft_probs, DraftModelState(cache=cache, synced=ctx.lengths,
                                                              own=jnp.ones((b,), bool))

  def commit(self, params, state: DraftModelState, tokens, n_accepted, verify: VerifyInfo):
    k = tokens.shape[1] - 1                 # this round's K (static)
    if k == 0:                              # a plain round: nothing fed, catch up later
      return state
    # Slots < lengths_before were fed committed tokens by propose; past them its own drafts,
    # right where they were accepted (in a row whose drafts were replaced: none of them).
    fed = jnp.where(state.own, jnp.minimum(n_accepted, k - 1), 0)
    synced = verify.lengths_before + fed
    return state.replace(synced=jnp.minimum(synced, verify.lengths))

  def disown(self, state: DraftModelState, rows) -> DraftModelState:
    """Drafter.disown: these rows verify other drafts than the ones propose fed."""
    return state.replace(own=state.own & ~rows)

  def propose_tree(self, params, state: DraftModelState, ctx: DraftContext, spec):
    """EAGLE-2's dynamic tree on the draft model (module docstring) -> (DraftTree, state)."""
    b, s = ctx.tokens.shape
    w = spec.depth + 1
    lengths = ctx.lengths
    start = jnp.maximum(lengths - w, 0)             # a short row's block runs past its root
    idx = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    block = jnp.take_along_axis(ctx.tokens, jnp.minimum(idx, s - 1), axis=1)
    root_at = lengths - 1 - start
    out = forward(params, self.config, block, state.cache, start)
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

    candidates = "topk" if self.greedy_drafts else spec.candidates_for(ctx.greedy)
    tree, cache = tree_lib.build_dynamic_tree(root_logits, expand, out.cache, spec, key=ctx.key,
                                              sampling=ctx.sampling, candidates=candidates)
    # The block made slots < lengths right; the nodes past them are out of place.
    return tree, DraftModelState(cache=cache, synced=lengths, own=jnp.ones((b,), bool))

  def commit_tree(self, params, state: DraftModelState, tokens, n_accepted, verify: VerifyInfo):
    # The accepted path's nodes sit at their list slots, not at their positions: nothing past
    # lengths_before (= synced after propose_tree) is known valid; the next propose_tree
    # re-feeds the last D+1 committed tokens.
    return state
