"""Prompt lookup first, a model drafter where lookup finds nothing (per row, every round).

Prompt lookup (spec_jax.drafters.ngram) is nearly free and drafts long runs where an answer
copies its question or its own earlier text (extraction, summarisation, code edits); a trained
head or a draft model drafts everywhere else, at the cost of its own steps. This drafter runs
both as one: each round, a row whose last tokens match earlier text (an n-gram of the lookup's
min_ngram..max_ngram tokens) takes the lookup's continuation, and every other row takes the
model's drafts. vLLM's and SGLang's n-gram and suffix drafters are separate methods; suffix
decoding with an EAGLE fallback (Arctic Inference) is this idea with a suffix tree.

Lossless as each part is: the choice between the two is a function of the committed tokens
only (made before anything is drawn), and each row's q is the distribution its drafts came
from: one-hot at a looked-up token (what a deterministic draft is), the model's q elsewhere.

Cost: the lookup is one [B, S] comparison per n-gram length, and the fallback proposes in
every round (its drafts are dropped where the lookup matched). Skipping it by a `lax.cond` in
rounds where every row matched measured the same time on SmolLM2 at B = 1 (within 1 %,
docs/real_model.md), so the round stays this simple.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from spec_jax.drafters.base import (DraftContext, Drafter, FrozenDrafter, derived_field,
                                    frozen_drafter)
from spec_jax.drafters.ngram import NGram


@frozen_drafter
class LookupFirst(FrozenDrafter):
  """Per row and round: prompt lookup's drafts where it finds a match, else the model's.

  Args:
    fallback: the drafter for rows without a match (a trained head, DFlash, a DraftModel,
      ...); its params are this drafter's params.
    lookup: the prompt lookup (NGram; default NGram(3, 2): the longest match of 3 or 2
      tokens, so that one repeated token does not displace the model).
  """

  fallback: Drafter = dataclasses.field()
  lookup: NGram = NGram(3, 2)
  params: Any = derived_field(compare=False)

  supports_tree = False

  def __post_init__(self):
    if not isinstance(self.fallback, Drafter) or isinstance(self.fallback,
                                                             (NGram, LookupFirst)):
      raise ValueError(f"LookupFirst's fallback must be a model drafter (a trained head, DFlash, "
                       f"a DraftModel, ...), not {type(self.fallback).__name__}: the lookup is "
                       f"its `lookup` argument")
    if not isinstance(self.lookup, NGram):
      raise ValueError(f"LookupFirst's lookup must be a spec_jax.drafters.NGram, got "
                       f"{type(self.lookup).__name__}")
    object.__setattr__(self, "params", self.fallback.params)

  # What the engine reads of a drafter: the fallback's (the lookup needs no features).
  reads_prompt_hidden = property(lambda self: self.fallback.reads_prompt_hidden)
  target_layers = property(lambda self: tuple(self.fallback.target_layers))
  max_draft = property(lambda self: self.fallback.max_draft)
  rolls_steps_on = property(lambda self: self.fallback.rolls_steps_on)
  greedy_drafts = property(lambda self: bool(getattr(self.fallback, "greedy_drafts", False)))

  def with_params(self, params, greedy_drafts=None):
    return self.replace(fallback=self.fallback.with_params(params, greedy_drafts))

  def check_compatible(self, target) -> None:
    self.fallback.check_compatible(target)

  def prepare(self, params):
    return self.fallback.prepare(params)

  def init_state(self, params, prefill):
    return self.fallback.init_state(params, prefill)

  def catch_up(self, params, state, tokens, lengths):
    return self.fallback.catch_up(params, state, tokens, lengths)

  def commit(self, params, state, tokens, n_accepted, verify):
    return self.fallback.commit(params, state, tokens, n_accepted, verify)

  def propose(self, params, state, ctx: DraftContext):
    """-> (drafts int32 [B, K] (-1 past a row's drafts), q float32 [B, K, V] or None when
    every row drafts deterministically, state)."""
    looked, _, _ = self.lookup.propose(None, (), ctx)
    use_lookup = looked[:, 0] >= 0                                       # [B]
    # A row whose last round verified the lookup's drafts may have left the fallback behind
    # (a DraftModel's cache holds its own drafts there, disowned below): it catches up first.
    state = self.fallback.catch_up(params, state, ctx.tokens, ctx.lengths)
    drafts, q, state = self.fallback.propose(params, state, ctx)
    state = self.fallback.disown(state, use_lookup)
    drafts = jnp.where(use_lookup[:, None], looked, drafts)
    if q is not None:
      # A looked-up draft is deterministic: its q is one-hot (positions past the row's drafts
      # are never read).
      one_hot = jax.nn.one_hot(jnp.maximum(looked, 0), q.shape[-1], dtype=q.dtype)
      q = jnp.where(use_lookup[:, None, None], one_hot, q)
    return drafts, q, state
