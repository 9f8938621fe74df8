"""Sampling parameters and the one logits -> probabilities transform, with the logits
processors (logit bias, repetition / frequency / presence penalties, min-p); the token
history the penalties read is `History` (`spec_jax.sampling_history`, re-exported here).

Target and draft distributions both come from `probs`, so the rejection sampler compares like
with like: p = probs(target_logits, s) and q = probs(draft_logits, s) are the exact
distributions that plain sampling would draw from. Greedy is temperature 0: a one-hot argmax,
which turns rejection sampling into exact matching.

Each field of `Sampling` is declared once, by `option(...)` (`spec_jax.sampling_options`) in
the class body: its dtype, default, the value that turns it off, its check and its help.
Everything that handles sampling settings iterates `OPTIONS` (the checks and per-row arrays
here, the decode loop's broadcast, the multi-process global batch, generate()'s agreement
between processes, the CLI), so a new option is its line in `Sampling` and its math in `probs`.

Order of operations (transformers' `generate`, `_get_logits_processor`: SequenceBias, then
RepetitionPenalty, then the warpers Temperature, TopK, TopP, MinP; transformers has no
presence / frequency penalty, they sit right after the repetition penalty as in vLLM's
`apply_penalties`):

    logits + logit_bias -> repetition_penalty (prompt + output tokens) -> - frequency * count
    - presence * [count > 0] (output tokens) -> logits processors (spec_jax.processors, a
    grammar constraint: transformers runs a user's processors after its own) -> / temperature
    -> top-k -> top-p -> min-p -> softmax;   temperature 0: one-hot at the argmax of the
    processed logits.

The penalties read the row's history (`History`): which tokens its prompt holds and how often
each token was generated so far; the logits processors read their own states, carried there.
Under speculation the history of a verify position is the committed history PLUS the drafted
tokens before it (a tree node: its ancestors), which is
what `History.along_chain` / `History.along_tree` give, so p at every verify position is
exactly the distribution plain decoding would draw from after that prefix (docs/sampling.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Re-exported: the token history the penalties read, the option kinds (Option, BiasOption),
# LogitBias and the CLI's bias parser.
from spec_jax import processors as processors_lib
from spec_jax.sampling_draw import (SAMPLE_BLOCK, SAMPLE_PARTS,  # noqa: F401 (re-exported)
                                   first_positive_above, sample, sample_layout)
from spec_jax.sampling_history import History  # noqa: F401
from spec_jax.sampling_options import (BiasOption, LogitBias, Option, bias_option,  # noqa: F401
                                       option, parse_logit_bias)


@flax.struct.dataclass
class Sampling:
  """Sampling settings, scalars or per-row [B] arrays (each field's Option says its rule).

  temperature: >= 0; 0 is greedy (one-hot argmax).
  top_k: >= 0 integer; 0 disables top-k.
  top_p: in (0, 1]; 1 disables top-p.
  """
  temperature: jax.Array | float = option(
      np.float32, 1.0, off=1.0, valid=lambda t: (t >= 0) & (t < math.inf),
      rule="finite and >= 0 (0 = greedy)", help="0 = greedy")
  top_k: jax.Array | int = option(
      np.int32, 0, off=0, valid=lambda k: (k >= 0) & (k == k // 1),
      rule="a non-negative integer (0 = off)", help="keep the k likeliest tokens (0 = off)")
  top_p: jax.Array | float = option(
      np.float32, 1.0, off=1.0, valid=lambda p: (p > 0) & (p <= 1),
      rule="in (0, 1] (1 = off)", help="keep the smallest set of tokens with this mass (1 = off)")
  min_p: jax.Array | float = option(
      np.float32, 0.0, off=0.0, valid=lambda p: (p >= 0) & (p <= 1),
      rule="in [0, 1] (0 = off)",
      help="drop tokens below min_p times the likeliest one's probability (0 = off)")
  repetition_penalty: jax.Array | float = option(
      np.float32, 1.0, off=1.0, valid=lambda r: (r > 0) & (r < math.inf),
      rule="finite and > 0 (1 = off)",
      help="CTRL's penalty on tokens of the prompt and the output: logit / r if > 0, else "
      "logit * r (1 = off)")
  presence_penalty: jax.Array | float = option(
      np.float32, 0.0, off=0.0, valid=lambda a: (a >= 0) & (a < math.inf),
      rule="finite and >= 0 (0 = off)",
      help="OpenAI's: subtract this from the logit of every token already generated (0 = off)")
  frequency_penalty: jax.Array | float = option(
      np.float32, 0.0, off=0.0, valid=lambda a: (a >= 0) & (a < math.inf),
      rule="finite and >= 0 (0 = off)",
      help="OpenAI's: subtract this times a token's count in the output so far (0 = off)")
  logit_bias: Any = bias_option(
      help="ID:BIAS,ID:BIAS added to those tokens' logits before everything else")
  draft_temperature_scale: jax.Array | float = option(
      np.float32, 1.0, off=1.0, valid=lambda s: (s >= 0) & (s < math.inf),
      rule="finite and >= 0 (1 = off)",
      help="drafters sample at this multiple of the row's temperature (1 = the same; below 1 "
      "sharper drafts, 0 greedy ones); the output keeps the target's distribution either way")

  def __post_init__(self):
    if all(opt.is_concrete(getattr(self, name)) for name, opt in OPTIONS.items()):
      self.check()

  def check(self, batch_size: Optional[int] = None,
            vocab_size: Optional[int] = None) -> "Sampling":
    """Raises ValueError on invalid values, per-row arrays whose length is not batch_size, or
    (when vocab_size is given) logit_bias ids outside the vocabulary."""
    for name, opt in OPTIONS.items():
      opt.check(name, getattr(self, name), batch_size, vocab_size)
    return self

  @property
  def needs_history(self) -> bool:
    """Static: some penalty may be on (not concretely off), so decoding carries the token
    history (History) and applies the penalties."""
    return any(OPTIONS[n].maybe_on(getattr(self, n)) for n in PENALTIES)

  def scalars(self) -> Optional[tuple]:
    """Every field as a host scalar (hashable, in field order), or None when some field is an
    array."""
    values = tuple(opt.scalar(getattr(self, name)) for name, opt in OPTIONS.items())
    return None if any(v is None for v in values) else values

  def rows(self, batch_size: int, xp=jnp) -> "Sampling":
    """Every field broadcast to its per-row array [B] (unchecked; traced values allowed)."""
    return Sampling(**{name: opt.rows(getattr(self, name), batch_size, xp)
                       for name, opt in OPTIONS.items()})

  def as_arrays(self, batch_size: int) -> "Sampling":
    """Checked per-row arrays of shape [B] (each field's dtype) for use inside jit."""
    self.check(batch_size)
    scalars = self.scalars()
    if scalars is not None:
      return _scalar_rows(scalars, int(batch_size))
    # Host values stay numpy (no eager device op per field); jax arrays and tracers stay jax.
    leaves = jax.tree.leaves([getattr(self, name) for name in OPTIONS])
    return self.rows(batch_size, jnp if any(isinstance(x, jax.Array) for x in leaves) else np)

  def for_drafts(self) -> "Sampling":
    """The settings drafters draw under: temperature * draft_temperature_scale, the rest as is.

    Speculative sampling is exact for any draft distribution q, provided q is the one each
    draft was drawn from (Leviathan et al. 2023, Theorem 1: accept with min(1, p/q), resample
    from norm(max(p - q, 0))); every drafter reports the q of its own draw, so a drafter may
    sample at another temperature than the target without changing the output. What changes
    is the acceptance, sum_x min(p(x), q(x)) per position: a draft broader than the target (a
    small draft model at T = 1) accepts more when sharpened (scale < 1). Greedy rows stay
    greedy (0 * scale); scale 0 makes a sampled row's drafts greedy (q one-hot)."""
    scale = self.draft_temperature_scale
    if not OPTIONS["draft_temperature_scale"].maybe_on(scale):
      return self
    return self.replace(temperature=self.temperature * scale)

  @property
  def is_greedy(self) -> bool:
    if isinstance(self.temperature, numbers.Real):
      return bool(self.temperature == 0)
    return bool(np.all(np.asarray(self.temperature) == 0))


OPTIONS: dict = {f.name: f.metadata["option"] for f in dataclasses.fields(Sampling)}
# The options that read the token history (History).
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


@functools.lru_cache(maxsize=256)
def _scalar_rows(scalars: tuple, batch_size: int) -> Sampling:
  """Sampling.as_arrays of checked scalar settings: read-only numpy rows, made once per
  (settings, batch) (generate() asks for them on every call)."""
  rows = Sampling(*scalars).rows(batch_size, np)
  for row in jax.tree.leaves(rows):
    row.flags.writeable = False
  return rows


def _per_row(value, ndim: int):
  """A scalar or [B] setting, reshaped to broadcast against [B, ..., V] (ndim dims in all)."""
  value = jnp.asarray(value)
  if value.ndim == 0:
    return value
  return value.reshape(value.shape + (1,) * (ndim - value.ndim))


def _rows_like(x, nd: int):
  """[B, V] per-row values broadcast against [B, ..., V] (nd dims); [V] as it is."""
  if x.ndim <= 1 or x.ndim == nd:
    return x
  return x.reshape(x.shape[:1] + (1,) * (nd - x.ndim) + x.shape[1:])


def process_logits(logits, sampling: Sampling, history: Optional[History] = None,
                   columns=None):
  """The logits processors before temperature (transformers' order): + logit_bias ->
  repetition penalty -> frequency and presence penalties -> the history's LogitsProcessors
  (spec_jax.processors; grammar constraints) in order. float32 [..., V] -> [..., V].

  columns: int32 [V_c], the target ids of the logits' last axis when the logits cover only
  those tokens (an EAGLE-3 draft vocabulary; every other token's logit is -inf, so leaving
  it out changes no probability): the bias and the penalties are read at those ids. None:
  the logits cover the whole vocabulary. Processors need the whole vocabulary.

  history: the rows' History, counts [B, V] or [..., V] like the logits (prompt [B, V]), the
  processors' states likewise; None skips the penalties and processors (no history: what a
  drafter that keeps none draws from). A logit_bias of width M = 0 and history None cost
  nothing: the checks are on static shapes."""
  x = logits.astype(jnp.float32)
  nd = x.ndim
  bias = sampling.logit_bias
  if bias is not None and not isinstance(bias, LogitBias):      # a host map: its rows
    bias = OPTIONS["logit_bias"].rows(bias, x.shape[0] if nd > 1 else 1)
    if nd == 1:
      bias = LogitBias(bias.ids[0], bias.values[0])
  if isinstance(bias, LogitBias) and bias.ids.shape[-1] > 0:
    ids, vals = jnp.asarray(bias.ids, jnp.int32), jnp.asarray(bias.values, jnp.float32)
    vocab = x.shape[-1]
    if columns is not None:        # each column's bias: the entries naming its target id
      hits = ids[..., :, None] == jnp.asarray(columns, jnp.int32)           # [(B,) M, V_c]
      dense = jnp.sum(jnp.where(hits, vals[..., :, None], 0.0), axis=-2)
    elif ids.ndim == 1:
      dense = jnp.zeros((vocab,), jnp.float32).at[ids].add(vals, mode="drop")
    else:
      rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
      dense = jnp.zeros((ids.shape[0], vocab), jnp.float32).at[rows, ids].add(vals, mode="drop")
    x = x + _rows_like(dense, nd)
  at_columns = lambda a: a if columns is None else jnp.take(a, jnp.asarray(columns), axis=-1)
  if history is not None and history.counts is not None:
    counts = _rows_like(at_columns(history.counts), nd)
    seen = _rows_like(at_columns(history.prompt), nd) | (counts > 0)
    r = _per_row(sampling.repetition_penalty, nd).astype(jnp.float32)
    # CTRL / transformers' RepetitionPenaltyLogitsProcessor: seen tokens' logits are divided
    # by r when positive, multiplied by r otherwise.
    x = jnp.where(seen, jnp.where(x < 0, x * r, x / r), x)
    # OpenAI: logit - frequency * count - presence * [count > 0], output tokens only.
    freq = _per_row(sampling.frequency_penalty, nd).astype(jnp.float32)
    pres = _per_row(sampling.presence_penalty, nd).astype(jnp.float32)
    x = x - freq * counts.astype(jnp.float32) - pres * (counts > 0).astype(jnp.float32)
  if history is not None and history.processors:
    if columns is not None:
      raise ValueError("logits processors (grammars) need logits over the whole vocabulary, "
                       "not a subset of columns")
    x = processors_lib.apply(history.processors, history.params, x, history.states,
                             history.lead)
  return x


def greedy_tokens(logits, sampling: Sampling, history: Optional[History] = None):
  """The greedy choice: argmax of the processed logits (bias and penalties; temperature,
  top-k, top-p and min-p keep the argmax). [..., V] -> int32 [...]."""
  return jnp.argmax(process_logits(logits, sampling, history), axis=-1).astype(jnp.int32)


def probs(logits, sampling: Sampling, history: Optional[History] = None, columns=None):
  """logit_bias -> repetition penalty -> frequency / presence penalties -> / T -> top-k ->
  top-p -> min-p -> softmax (the module docstring's order, transformers').

  Args:
    logits: [..., V]. Per-row settings of shape [B] (logit_bias: [B, M]) apply along the first
      axis.
    sampling: Sampling.
    history: History for the penalties (counts [B, V] or shaped like logits' leading dims);
      None applies no penalty (a draw without history, still exactly what it says).
    columns: int32 [V_c] or None: the logits cover only these target ids (process_logits);
      the probabilities are then those of the whole row, which is -inf elsewhere, at them.

  Returns:
    float32 probabilities [..., V] (or [..., V_c]); rows with temperature 0 are one-hot at the
    argmax of the processed logits (first index on ties, in the columns' order).
  """
  processed = process_logits(logits, sampling, history, columns)
  nd = processed.ndim
  temperature = _per_row(sampling.temperature, nd).astype(jnp.float32)
  top_k = _per_row(sampling.top_k, nd).astype(jnp.int32)
  top_p = _per_row(sampling.top_p, nd).astype(jnp.float32)
  min_p = _per_row(sampling.min_p, nd).astype(jnp.float32)
  vocab = processed.shape[-1]

  greedy = temperature <= 0
  scaled = processed / jnp.where(greedy, 1.0, temperature)

  # The filters (the sort behind top-k / top-p, min-p) are skipped at run time when no row
  # asks for any; a row with top_k = 0, top_p = 1 and min_p = 0 is left exactly as it is
  # either way (rows are independent), so the program with every filter off is as before.
  needs_filter = jnp.any(top_k > 0) | jnp.any(top_p < 1.0) | jnp.any(min_p > 0)
  masked = jax.lax.cond(needs_filter, lambda x: _filter_rows(x, top_k, top_p, min_p),
                        lambda x: x, scaled)
  sampled = jax.nn.softmax(masked, axis=-1)
  one_hot = jax.nn.one_hot(jnp.argmax(processed, axis=-1), vocab, dtype=jnp.float32)
  return jnp.where(greedy, one_hot, sampled)


def _filter_rows(scaled, top_k, top_p, min_p):
  """top-k -> top-p -> min-p over the rows of scaled [..., V] flattened to [N, V] (the
  settings broadcast to [..., 1] first): with the vocabulary split on a `model` mesh axis,
  XLA:TPU laid the nucleus' suffix sums of a [B, K+1, V] verify out with the K+1 axis minor,
  padded 18x (250 MiB per chip for an 8B EAGLE-3 round, docs/accelerators.md)."""
  lead, vocab = scaled.shape[:-1], scaled.shape[-1]
  flat = lambda s: jnp.broadcast_to(s, lead + (1,)).reshape(-1, 1)
  rows = scaled.reshape(-1, vocab)
  out = _min_p(_top_k_top_p(rows, flat(top_k), flat(top_p)), flat(min_p))
  return out.reshape(scaled.shape)


def _min_p(masked, min_p):
  """Masks (to -inf) the tokens whose probability is below min_p times the row's largest
  (transformers' MinPLogitsWarper after temperature, top-k and top-p; the likeliest token is
  always kept since min_p <= 1)."""
  p = jax.nn.softmax(masked, axis=-1)
  top = jnp.max(p, axis=-1, keepdims=True)
  return jnp.where(p < min_p * top, -jnp.inf, masked)


def _order_keys(x):
  """int32 keys [..., V] of float32 x whose integer order is x's value order (-inf lowest; -0.0
  is taken as +0.0): the bit pattern, with the magnitude bits flipped for negative numbers."""
  x = x.astype(jnp.float32)
  i = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.int32)
  return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _smallest_key_where(pred, lo, hi):
  """The smallest int32 key in (lo, hi] where pred (monotone: False ... False True ... True
  along the keys) holds, per row; lo, hi int32 [N, 1] with pred(lo) False and pred(hi) True.
  Bisection: 32 halvings close any int32 interval (hi - lo < 2^32), and the midpoint is
  computed without overflow."""
  def halve(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)            # floor((lo + hi) / 2)
    ok = pred(mid)
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)
  return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _top_k_top_p(scaled, top_k, top_p):
  """Masks (to -inf) the logits outside each row's top-k, then outside its top-p nucleus.

  scaled float32 [N, V]; top_k int32 [N, 1] (0: off), top_p float32 [N, 1] (1: off). Both
  cut-offs are thresholds found by bisection over the logits' order keys, each step a
  comparison and a sum over V, never a sort: with the vocabulary split on a `model` mesh
  axis a sort needs the whole vocabulary of a row on one device (XLA:TPU all-to-alls the rows
  and kept ~60 MiB of sort buffers per chip for an 8B EAGLE-3 round, docs/accelerators.md),
  while a sum over V is a local partial sum and an all-reduce of N numbers.
  """
  masked = _skip_unless(jnp.any(top_k > 0), _top_k, scaled, top_k)
  return _skip_unless(jnp.any(top_p < 1.0), _top_p, masked, top_p)


def _skip_unless(flag, filter_rows, x, setting):
  """filter_rows(x, setting) when flag (some row asks for the filter), else x, at run time:
  each filter's search is 32 passes over [N, V]; a row whose setting is off is left exactly
  as it is either way."""
  return jax.lax.cond(flag, filter_rows, lambda x, _: x, x, setting)


def _top_k(scaled, top_k):
  """The k-th largest logit c_k of each row, every token >= c_k kept (ties at c_k all kept,
  as transformers' TopKLogitsWarper); top_k 0 keeps the row. The smallest key with fewer than
  k tokens at or above it is c_k's key + 1."""
  vocab = scaled.shape[-1]
  keys = _order_keys(scaled)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  above_k = _smallest_key_where(
      lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) < k,
      jnp.min(keys, axis=-1, keepdims=True), jnp.max(keys, axis=-1, keepdims=True) + 1)
  return jnp.where(keys < above_k - 1, -jnp.inf, scaled)


def _top_p(masked, top_p):
  """Keeps the smallest set of the likeliest tokens whose mass reaches top_p: token i is kept
  when the mass of the tokens at or below its logit exceeds 1 - top_p (its mass-before, in
  descending order, is < top_p), i.e. every token at or above the cut-off c = the smallest
  logit v with mass(x <= v) > 1 - top_p (ties at c all kept). mass(x <= v) sums the tail
  only, so it keeps the tail's precision where a float32 running sum from the top reaches 1.0
  early. top_p >= 1 keeps every token of the row exactly (the filter is off); when rounding
  leaves even the whole row's mass <= 1 - top_p (top_p ~ 1e-7) the search ends at the
  largest logit: the likeliest token(s) kept."""
  keys = _order_keys(masked)
  lowest = jnp.min(keys, axis=-1, keepdims=True)
  p = jax.nn.softmax(masked, axis=-1)
  tail = 1.0 - top_p
  cut = _smallest_key_where(
      lambda t: jnp.sum(jnp.where(keys <= t, p, 0.0), axis=-1, keepdims=True) > tail,
      lowest - 1, jnp.max(keys, axis=-1, keepdims=True))
  cut = jnp.where(top_p >= 1.0, lowest, cut)
  return jnp.where(keys < cut, -jnp.inf, masked)
