"""Logits processors for research code: a pure per-row transform of the logits with its own
carried state, applied identically by plain decoding, chains, trees and the drafters that
process their logits, so speculation stays exactly lossless (docs/sampling.md).

The protocol (`LogitsProcessor`) is written for ONE row at ONE position; the library vmaps it
over rows and verify positions:

    init(params, prompt [P] int32, prompt_len int32 []) -> state     the row before its output
    process(params, logits [V] float32, state) -> logits [V]         mask / shift the logits
    advance(params, state, token int32 []) -> state                  after emitting one token

`params` are the processor's arrays (say a grammar's transition table), traced arguments of
the jitted decode; the processor object itself is static (hashable: a frozen dataclass whose
`params` field is left out of the hash and of equality), like a drafter and its params. A
state is any pytree of arrays (no leading batch axis: the library adds [B] and, along a
verify's positions, [B, T]).

Why this is lossless under speculation: verify position i of a round sees the state advanced
along the committed tokens AND the drafts before i (a tree node: along its ancestors), which
is exactly the state plain decoding would have after that prefix; so p at every verify
position is the distribution plain decoding draws from, and the rejection sampler reproduces
it (`sampling.History.along_chain` / `along_tree`). A processor applied to the target only
is still lossless (a drafter's q need only be what its drafts were drawn from); applied to the
drafter too (the draft model does) it raises acceptance.

Processors run after logit_bias and the penalties, before temperature (transformers appends a
user's `logits_processor` list after its own processors; the warpers come last).

Two examples (tested; docs/sampling.md): `NoRepeatNGram` (transformers'
NoRepeatNGramLogitsProcessor over the output) and `BannedPhrases` (a token sequence may not be
completed). Grammar constraints (spec_jax.constraints) are a third.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LogitsProcessor:
  """Base of the processors (the module docstring's protocol). Subclasses are frozen
  dataclasses; a field holding arrays is declared with `params_field()` (not hashed)."""

  @property
  def params(self) -> Any:
    """The processor's arrays (a pytree; () when it has none): decode's processor_params."""
    return ()

  def init(self, params, prompt, prompt_len):
    raise NotImplementedError

  def process(self, params, logits, state):
    raise NotImplementedError

  def advance(self, params, state, token):
    raise NotImplementedError


def params_field(**kwargs):
  """A dataclass field for a processor's arrays: not part of its hash nor of equality."""
  return dataclasses.field(hash=False, compare=False, repr=False, **kwargs)


def check_processors(processors) -> tuple:
  """processors as a tuple of LogitsProcessor; ValueError otherwise."""
  if processors is None:
    return ()
  if isinstance(processors, LogitsProcessor):
    processors = (processors,)
  processors = tuple(processors)
  for p in processors:
    if not isinstance(p, LogitsProcessor):
      raise ValueError(f"processors must be spec_jax.processors.LogitsProcessor objects (or a "
                       f"compiled sj.constraints constraint), got {type(p).__name__}")
    try:
      hash(p)
    except TypeError as e:
      raise ValueError(f"processor {type(p).__name__} must be hashable (a frozen dataclass "
                       f"whose arrays are declared with params_field()): {e}") from e
  return processors


# ------------------------------------------------------------ batched forms (the library's)

def init_states(processors, params, prompt_tokens, prompt_lens) -> tuple:
  """Each processor's state for every row: leaves [B, ...]. prompt_tokens int32 [B, P]."""
  return tuple(jax.vmap(lambda t, n, p=p, pp=pp: p.init(pp, t, n))(prompt_tokens, prompt_lens)
               for p, pp in zip(processors, params))


def advance_states(processors, params, states, tokens, use=None) -> tuple:
  """states (leaves [B, ...]) after one token per row, tokens int32 [B]; use bool [B]: rows
  whose state moves (the others keep theirs)."""
  out = []
  for p, pp, s in zip(processors, params, states):
    moved = jax.vmap(lambda st, t, p=p, pp=pp: p.advance(pp, st, t))(s, jnp.maximum(tokens, 0))
    if use is not None:
      moved = jax.tree.map(lambda new, old: jnp.where(
          use.reshape(use.shape + (1,) * (new.ndim - 1)), new, old), moved, s)
    out.append(moved)
  return tuple(out)


def apply(processors, params, logits, states, lead: int):
  """The processed logits [..., V]: every processor in order, each row / position with its
  own state. states' leaves carry `lead` leading axes ([B] = 1, [B, T] = 2) that match the
  logits' leading axes, or broadcast to them ([B] states against [B, T, V] logits)."""
  nd = logits.ndim - 1
  x = logits
  for p, pp, s in zip(processors, params, states):
    fn = lambda lg, st, p=p, pp=pp: p.process(pp, lg, st)
    if lead < nd:     # the same state at every position of a row
      s = jax.tree.map(lambda a: jnp.broadcast_to(
          a.reshape(a.shape[:lead] + (1,) * (nd - lead) + a.shape[lead:]),
          x.shape[:nd] + a.shape[lead:]), s)
    for _ in range(nd):
      fn = jax.vmap(fn)
    x = fn(x, s)
  return x


def along_paths(processors, params, states, paths, valid) -> tuple:
  """One state per position: the row's state advanced along each position's prefix.
  paths int32 [B, T, D]: position t's prefix tokens in order (oldest first); valid bool
  [B, T, D]: which are real (a prefix may be shorter: its invalid entries are skipped).
  Returns states with leaves [B, T, ...]. D sequential steps, each vmapped over B x T."""
  b, t, d = paths.shape
  out = []
  for p, pp, s in zip(processors, params, states):
    s = jax.tree.map(lambda a: jnp.broadcast_to(a[:, None], (b, t) + a.shape[1:]), s)
    step = jax.vmap(jax.vmap(lambda st, tok, p=p, pp=pp: p.advance(pp, st, tok)))
    for j in range(d):
      moved = step(s, jnp.maximum(paths[:, :, j], 0))
      use = valid[:, :, j]
      s = jax.tree.map(lambda new, old: jnp.where(
          use.reshape(use.shape + (1,) * (new.ndim - 2)), new, old), moved, s)
    out.append(s)
  return tuple(out)


# ------------------------------------------------------------------------------ examples

@dataclasses.dataclass(frozen=True)
class NoRepeatNGram(LogitsProcessor):
  """No n-gram occurs twice in the row's tokens, prompt included (transformers'
  NoRepeatNGramLogitsProcessor). State: the last n-1 tokens and a table of the n-grams seen,
  the last `window` of them (older ones are forgotten: exact while prompt + output are at
  most window + n - 1 tokens)."""
  n: int = 3
  window: int = 1024

  def __post_init__(self):
    if not (isinstance(self.n, int) and self.n >= 2):
      raise ValueError(f"NoRepeatNGram.n must be an integer >= 2, got {self.n!r}")
    if not (isinstance(self.window, int) and self.window >= 1):
      raise ValueError(f"NoRepeatNGram.window must be an integer >= 1, got {self.window!r}")

  def init(self, params, prompt, prompt_len):
    empty = dict(recent=jnp.full((self.n - 1,), -1, jnp.int32),      # the last n-1 tokens
                 grams=jnp.full((self.window, self.n), -1, jnp.int32),  # n-grams seen
                 count=jnp.zeros((), jnp.int32))
    # The prompt's n-grams, one token at a time (P steps, once per decode).
    return jax.lax.fori_loop(0, prompt.shape[0], lambda i, st: jax.tree.map(
        lambda new, old: jnp.where(i < prompt_len, new, old),
        self.advance(params, st, prompt[i]), st), empty)

  def process(self, params, logits, state):
    del params
    # Banned: the last token of every seen n-gram whose first n-1 tokens are the recent ones.
    hit = jnp.all(state["grams"][:, :-1] == state["recent"][None, :], axis=1) & \
        jnp.all(state["recent"] >= 0)
    banned = jnp.zeros(logits.shape, bool).at[jnp.where(hit, state["grams"][:, -1],
                                                        logits.shape[0])].set(True, mode="drop")
    return jnp.where(banned, -jnp.inf, logits)

  def advance(self, params, state, token):
    del params
    gram = jnp.concatenate([state["recent"], token[None]])
    full = jnp.all(state["recent"] >= 0)
    slot = state["count"] % self.window
    grams = jnp.where(full, state["grams"].at[slot].set(gram), state["grams"])
    return dict(recent=gram[1:], grams=grams, count=state["count"] + full.astype(jnp.int32))


def _phrase_table(phrases: Sequence[Sequence[int]]):
  """Phrases as a padded int32 table [N, L] (-1 padding on the left) and their lengths."""
  phrases = [list(map(int, p)) for p in phrases]
  if not phrases or any(len(p) == 0 for p in phrases):
    raise ValueError("BannedPhrases needs at least one phrase, each a non-empty token list")
  length = max(len(p) for p in phrases)
  table = np.full((len(phrases), length), -1, np.int32)
  for i, p in enumerate(phrases):
    table[i, length - len(p):] = p
  return table, np.asarray([len(p) for p in phrases], np.int32)


@dataclasses.dataclass(frozen=True)
class BannedPhrases(LogitsProcessor):
  """The output never completes one of `phrases` (token-id sequences): the last token of a
  phrase is masked when the tokens before it were just emitted (a one-token phrase is always
  masked). State: the last L-1 tokens (L the longest phrase). transformers'
  NoBadWordsLogitsProcessor, with the prompt's tail counted as the recent tokens."""
  phrases: tuple = ()
  table: Any = params_field(default=None)

  def __post_init__(self):
    table, lengths = _phrase_table(self.phrases)
    object.__setattr__(self, "phrases", tuple(tuple(map(int, p)) for p in self.phrases))
    object.__setattr__(self, "table", (table, lengths))

  @property
  def params(self):
    return self.table

  @property
  def _tail(self) -> int:
    return max(1, max(len(p) for p in self.phrases) - 1)

  def init(self, params, prompt, prompt_len):
    del params
    idx = prompt_len - self._tail + jnp.arange(self._tail)
    return jnp.where(idx >= 0, prompt[jnp.maximum(idx, 0)], -1).astype(jnp.int32)

  def process(self, params, logits, state):
    table, lengths = params
    l = table.shape[1]
    recent = state[-(l - 1):] if l > 1 else state[:0]
    # phrase i's prefix (its last len-1 tokens before the final one) equals the recent tail
    prefix = table[:, :-1]
    match = jnp.all((prefix == recent[None, :]) | (prefix < 0), axis=1)
    last = jnp.where(match, table[:, -1], logits.shape[0])
    return jnp.where(jnp.zeros(logits.shape, bool).at[last].set(True, mode="drop"), -jnp.inf,
                     logits)

  def advance(self, params, state, token):
    del params
    return jnp.concatenate([state[1:], token[None].astype(jnp.int32)])
