"""Prompt lookup (n-gram) drafting over prompt + generated tokens (Saxena 2023).

The last n committed tokens are searched for in each row's earlier text, for n from max_ngram
down to min_ngram; the most recent earlier occurrence of the longest matching n-gram wins and
the tokens that followed it are proposed. Fixed-size search: every start position of the
[B, S] token buffer is compared at once, no host loop. Fewer than K continuation tokens (or no
match) are expressed as -1 padding, which the engine turns into draft_lengths.

Trees: several matches become several branches. Every continuation start c < lengths is ranked
by the longest n-gram (min_ngram..max_ngram) ending at c-1 that equals the last n committed
tokens, then by recency (so branch 0 is the chain's proposal); the top_k starts give branches
of up to D tokens, merged into a trie (equal prefixes share nodes), N nodes at most.
"""

from __future__ import annotations

import jax.numpy as jnp

import jax

from spec_jax import tree as tree_lib
from spec_jax.drafters.base import DraftContext, FrozenDrafter, frozen_drafter


MAX_NGRAM = 32


@frozen_drafter
class NGram(FrozenDrafter):
  """Deterministic drafts (draft_probs None): lossless through the rejection sampler.
  No params; static configuration MAX_NGRAM >= max_ngram >= min_ngram >= 1 (the program holds
  max_ngram (max_ngram + 1) / 2 shifted comparisons of the [B, S] buffer: at 64 it compiled in
  14 s on this CPU, at 1000 it ran out of memory compiling; lookup decoding uses 2-5)."""

  params = None
  supports_tree = True
  samples_tree_candidates = False        # its trees are tries of matches
  reads_prompt_hidden = False

  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    for name, v in (("max_ngram", self.max_ngram), ("min_ngram", self.min_ngram)):
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"NGram {name} must be an integer >= 1, got {v!r}")
    if self.max_ngram > MAX_NGRAM:
      raise ValueError(f"NGram max_ngram must be <= {MAX_NGRAM} (its program grows with "
                       f"max_ngram squared), got {self.max_ngram}")
    if self.min_ngram > self.max_ngram:
      raise ValueError(f"NGram min_ngram ({self.min_ngram}) must be <= max_ngram "
                       f"({self.max_ngram})")

  def propose(self, params, state, ctx: DraftContext):
    tokens, lengths, k = ctx.tokens, ctx.lengths, ctx.num_draft
    b, s = tokens.shape
    starts = jnp.arange(s, dtype=jnp.int32)[None, :]                      # candidate start j
    best_start = jnp.full((b,), -1, jnp.int32)                             # continuation start
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      # pattern = the last n committed tokens of each row.
      pattern = jnp.take_along_axis(
          tokens, jnp.clip(lengths[:, None] - n + jnp.arange(n)[None, :], 0, s - 1), axis=1)
      match = jnp.ones((b, s), bool)
      for i in range(n):
        shifted = jnp.roll(tokens, -i, axis=1)                             # shifted[j] = tokens[j+i]
        match &= shifted == pattern[:, i:i + 1]
      # The match must end before the pattern's own end and have a continuation: j + n < lengths.
      match &= (starts + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
      latest = jnp.max(jnp.where(match, starts, -1), axis=1)
      found = (latest >= 0) & (best_start < 0)
      best_start = jnp.where(found, latest + n, best_start)
    offs = jnp.arange(k, dtype=jnp.int32)[None, :]
    idx = jnp.clip(best_start[:, None] + offs, 0, s - 1)
    cont = jnp.take_along_axis(tokens, idx, axis=1)
    ok = (best_start[:, None] >= 0) & (best_start[:, None] + offs < lengths[:, None])
    return jnp.where(ok, cont, -1), None, state

  def propose_tree(self, params, state, ctx: DraftContext, spec):
    tokens, lengths = ctx.tokens, ctx.lengths
    b, s = tokens.shape
    d = spec.depth
    starts = jnp.arange(s, dtype=jnp.int32)[None, :]
    longest = jnp.zeros((b, s), jnp.int32)        # longest match ending just before start c
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      pattern = jnp.take_along_axis(
          tokens, jnp.clip(lengths[:, None] - n + jnp.arange(n)[None, :], 0, s - 1), axis=1)
      match = jnp.ones((b, s), bool)
      for i in range(n):
        match &= jnp.roll(tokens, -i, axis=1) == pattern[:, i:i + 1]
      match &= (starts + n < lengths[:, None]) & (lengths[:, None] >= n + 1)
      at_start = jnp.roll(match, n, axis=1) & (starts >= n)       # n-gram at c-n, continuation c
      longest = jnp.where((longest == 0) & at_start, n, longest)
    rank = jnp.where(longest > 0, longest * s + starts, -1)
    best, cont = jax.lax.top_k(rank, min(spec.top_k, s))         # [B, R] best first
    idx = cont[:, :, None] + jnp.arange(d, dtype=jnp.int32)[None, None, :]
    branch = jnp.take_along_axis(tokens, jnp.minimum(idx, s - 1).reshape(b, -1),
                                 axis=1).reshape(idx.shape)
    ok = (best[:, :, None] >= 0) & (idx < lengths[:, None, None])
    return tree_lib.trie_from_branches(branch, ok, spec.num_nodes), state
