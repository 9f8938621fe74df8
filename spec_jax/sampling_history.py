"""The token history the sampling transform reads (`spec_jax.sampling.probs`): each row's
prompt tokens and generated-token counts (the repetition / presence / frequency penalties) and
its logits processors' states (`spec_jax.processors`), committed (`add`) or extended along a
verify's positions (`along_chain`, `along_tree`), so p at every verify position is exactly the
distribution plain decoding would draw from after that prefix (docs/sampling.md).

Re-exported as `spec_jax.sampling.History`.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from spec_jax import processors as processors_lib


@flax.struct.dataclass
class History:
  """What the transform reads of each row's tokens so far (B rows, V the vocabulary): the
  penalties' token counts and the logits processors' states (spec_jax.processors).

  counts: int32 [B, V] how often each token was generated (the output: every token after the
    prompt, the first one sampled at the prefill included); or [B, T, V], one history per
    verify position (along_chain, along_tree). None when no penalty is applied.
  prompt: bool [B, V] the tokens of the row's prompt (None with counts).
  states: one state per processor, leaves [B, ...] (or [B, T, ...] along positions).
  params: the processors' arrays (processor_params), carried unchanged.
  processors: (static) the LogitsProcessor objects, applied in order after the penalties.
  lead: (static) the leading axes of the states: 1 ([B]) or 2 ([B, T]).

  The repetition penalty reads prompt | counts > 0 (transformers: every input id), presence
  and frequency read counts (OpenAI: the output only); a processor reads its own state.
  """
  counts: Optional[jax.Array]
  prompt: Optional[jax.Array]
  states: tuple = ()
  params: tuple = ()
  processors: tuple = flax.struct.field(pytree_node=False, default=())
  lead: int = flax.struct.field(pytree_node=False, default=1)

  @classmethod
  def of_prompt(cls, prompt_tokens, prompt_lens, vocab_size: int, *, penalties: bool = True,
                processors: tuple = (), params: tuple = ()) -> "History":
    """The history before any output: prompt_tokens int32 [B, P] right-padded, prompt_lens [B].
    penalties: keep the token counts (False: processors only); processors, params: the
    LogitsProcessors and their arrays (each processor's init reads the row's prompt)."""
    b, p = prompt_tokens.shape
    counts = prompt = None
    if penalties:
      real = jnp.arange(p)[None, :] < prompt_lens[:, None]
      rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, p))
      prompt = jnp.zeros((b, vocab_size), jnp.int32).at[rows, prompt_tokens].add(
          real.astype(jnp.int32), mode="drop") > 0
      counts = jnp.zeros((b, vocab_size), jnp.int32)
    processors, params = tuple(processors), tuple(params)
    states = processors_lib.init_states(processors, params, prompt_tokens, prompt_lens)
    return cls(counts=counts, prompt=prompt, states=states, params=params,
               processors=processors)

  def add(self, tokens, n) -> "History":
    """The history after committing tokens[b, :n[b]] (tokens int32 [B, T], n int32 [B])."""
    b, t = tokens.shape
    new = self
    if self.counts is not None:
      rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
      used = (jnp.arange(t)[None, :] < n[:, None]).astype(jnp.int32)
      new = new.replace(counts=self.counts.at[rows, jnp.maximum(tokens, 0)].add(used))
    states = self.states
    for j in range(t):          # the processors advance token by token (T <= K + 1)
      states = processors_lib.advance_states(self.processors, self.params, states,
                                             tokens[:, j], use=j < n)
    return new.replace(states=states)

  def along(self, prefix_tokens, prefix_valid) -> "History":
    """One history per position: counts [B, T, V] = counts [B, V] + the valid tokens of each
    position's prefix (prefix_tokens int32 [B, T, D] in order, oldest first; prefix_valid
    bool [B, T, D]); one scatter-add into the broadcast counts, no [.., V] one-hots. The
    processors' states advance along each prefix in order (D steps)."""
    b, t, d = prefix_tokens.shape
    counts = None
    if self.counts is not None:
      base = jnp.broadcast_to(self.counts[:, None, :], (b, t, self.counts.shape[-1]))
      rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, t, d))
      pos = jnp.broadcast_to(jnp.arange(t)[None, :, None], (b, t, d))
      counts = base.at[rows, pos, jnp.maximum(prefix_tokens, 0)].add(
          prefix_valid.astype(jnp.int32))
    states = processors_lib.along_paths(self.processors, self.params, self.states,
                                        prefix_tokens, prefix_valid)
    return self.replace(counts=counts, states=states, lead=2)

  def along_chain(self, draft_tokens) -> "History":
    """The histories of a chain's K+1 verify positions [B, K+1, V]: position i (the token
    after draft i, 0 = after the last committed one) has seen drafts 0..i-1.
    draft_tokens: int32 [B, K] (-1 padding: counted as token 0, in positions never used)."""
    b, k = draft_tokens.shape
    toks = jnp.broadcast_to(draft_tokens[:, None, :], (b, k + 1, k))
    valid = jnp.arange(k)[None, None, :] < jnp.arange(k + 1)[None, :, None]
    return self.along(toks, jnp.broadcast_to(valid, (b, k + 1, k)))

  def along_tree(self, tokens, parents, depth: int) -> "History":
    """The histories of a draft tree's nodes [B, N+1, V]: node i has seen its ancestors and
    itself, the root (node 0, the last committed token, already counted) excluded.
    tokens, parents: int32 [B, N+1] (spec_jax.tree.DraftTree); depth: D, the deepest node."""
    b, n1 = tokens.shape
    cur = jnp.broadcast_to(jnp.arange(n1, dtype=jnp.int32), (b, n1))
    toks, valid = [], []
    for _ in range(depth):                     # node, parent, grandparent, ... (root excluded)
      toks.append(jnp.take_along_axis(tokens, jnp.maximum(cur, 0), axis=1))
      valid.append(cur > 0)
      cur = jnp.where(cur > 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1)
    # oldest first: the root's child, ..., the node itself
    return self.along(jnp.stack(toks[::-1], -1), jnp.stack(valid[::-1], -1))
