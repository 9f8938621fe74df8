"""Sampling parameters and the one logits -> probabilities transform.

Target and draft distributions both come from `probs`, so the rejection sampler compares like
with like: p = probs(target_logits, s) and q = probs(draft_logits, s) are the exact
distributions that plain sampling would draw from. Greedy is temperature 0: a one-hot argmax,
which turns rejection sampling into exact matching.

Each field of `Sampling` is declared once, by `option(...)` in the class body: its dtype,
default, the value that turns it off, its check and its help. Everything that handles sampling
settings iterates `OPTIONS` (the checks and per-row arrays here, the decode loop's broadcast,
the multi-process global batch, generate()'s agreement between processes, the CLI), so a new
option is its line in `Sampling` and its math in `probs`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Option:
  """One field of Sampling, scalar or per-row [B].

  dtype: the per-row dtype inside jit (np.float32 or np.int32).
  default: the field's default; off: the value that leaves the distribution as it is.
  valid: value -> bool, elementwise on a float64 numpy array or on one Python number (written
    with comparisons and `&` only, so one predicate serves both).
  rule: what `valid` allows, in words, for the ValueError ("must be {rule}, got ...").
  help: the command line's help text.

  The three methods below are what the rest of the library calls; an option of another shape
  (issue 32's per-row logit_bias map) overrides them.
  """
  dtype: Any
  default: Any
  off: Any
  valid: Callable[[Any], Any]
  rule: str
  help: str = ""

  @property
  def parse(self) -> type:
    """The Python type of one value (the CLI's argparse type)."""
    return int if np.issubdtype(self.dtype, np.integer) else float

  def check(self, name: str, value, batch_size: Optional[int] = None) -> None:
    """ValueError unless value is valid: a host number, or a scalar or [batch_size] array."""
    if isinstance(value, numbers.Real):      # generate() checks per call: no numpy here
      if not self.valid(float(value)):
        raise ValueError(f"Sampling.{name} must be {self.rule}, got {value}")
      return
    arr = np.asarray(value)
    if arr.ndim > 1:
      raise ValueError(f"Sampling.{name} must be a scalar or a [batch] vector, got shape "
                       f"{arr.shape}")
    if batch_size is not None and arr.ndim == 1 and arr.shape[0] != batch_size:
      raise ValueError(f"Sampling.{name} has {arr.shape[0]} entries but the batch has "
                       f"{batch_size} rows; pass a scalar or one value per row")
    if not np.all(self.valid(arr.astype(np.float64))):
      raise ValueError(f"Sampling.{name} must be {self.rule}, got {arr.tolist()}")

  def rows(self, value, batch_size: int, xp=jnp):
    """value broadcast to the option's per-row array [batch_size] (xp: jnp, or np on the host;
    no checks: traced values pass through)."""
    return xp.broadcast_to(xp.asarray(value, self.dtype), (batch_size,))

  def scalar(self, value):
    """The host scalar of a scalar setting (hashable), or None for per-row arrays."""
    if not isinstance(value, numbers.Real):
      return None
    return self.parse(value)


def option(dtype, default, *, off, valid, rule: str, help: str = ""):
  """A Sampling field declared with its Option (dataclass metadata, read into OPTIONS)."""
  return flax.struct.field(default=default, metadata={"option": Option(
      dtype=dtype, default=default, off=off, valid=valid, rule=rule, help=help)})


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

  def __post_init__(self):
    if all(_is_concrete(getattr(self, name)) for name in OPTIONS):
      self.check()

  def check(self, batch_size: Optional[int] = None) -> "Sampling":
    """Raises ValueError on invalid values or per-row arrays whose length is not batch_size."""
    for name, opt in OPTIONS.items():
      opt.check(name, getattr(self, name), batch_size)
    return self

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
    fields = [getattr(self, name) for name in OPTIONS]
    return self.rows(batch_size, jnp if any(isinstance(x, jax.Array) for x in fields) else np)

  @property
  def is_greedy(self) -> bool:
    if isinstance(self.temperature, numbers.Real):
      return bool(self.temperature == 0)
    return bool(np.all(np.asarray(self.temperature) == 0))


OPTIONS: dict = {f.name: f.metadata["option"] for f in dataclasses.fields(Sampling)}


@functools.lru_cache(maxsize=256)
def _scalar_rows(scalars: tuple, batch_size: int) -> Sampling:
  """Sampling.as_arrays of checked scalar settings: read-only numpy rows, made once per
  (settings, batch) (generate() asks for them on every call)."""
  rows = Sampling(*scalars).rows(batch_size, np)
  for row in jax.tree.leaves(rows):
    row.flags.writeable = False
  return rows


def _is_concrete(x) -> bool:
  """Whether x's values can be read on the host here (not a tracer, nor an array spread over
  other processes' devices, which was checked before it was placed there)."""
  if isinstance(x, jax.core.Tracer):
    return False
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return False
  return isinstance(x, (numbers.Number, np.ndarray, jax.Array, list, tuple))


def _per_row(value, ndim: int):
  """A scalar or [B] setting, reshaped to broadcast against [B, ..., V] (ndim dims in all)."""
  value = jnp.asarray(value)
  if value.ndim == 0:
    return value
  return value.reshape(value.shape + (1,) * (ndim - value.ndim))


def probs(logits, sampling: Sampling):
  """logits / T -> top-k -> top-p -> softmax.

  Args:
    logits: [..., V]. Per-row settings of shape [B] apply along the first axis.
    sampling: Sampling.

  Returns:
    float32 probabilities [..., V]; rows with temperature 0 are one-hot at the argmax
    (first index on ties).
  """
  logits = logits.astype(jnp.float32)
  nd = logits.ndim
  temperature = _per_row(sampling.temperature, nd).astype(jnp.float32)
  top_k = _per_row(sampling.top_k, nd).astype(jnp.int32)
  top_p = _per_row(sampling.top_p, nd).astype(jnp.float32)
  vocab = logits.shape[-1]

  greedy = temperature <= 0
  scaled = logits / jnp.where(greedy, 1.0, temperature)

  # The sort behind top-k / top-p is skipped at run time when no row asks for either; a row
  # with top_k = 0 and top_p = 1 is left exactly as it is either way (rows are independent).
  needs_filter = jnp.any(top_k > 0) | jnp.any(top_p < 1.0)
  masked = jax.lax.cond(needs_filter, lambda x: _top_k_top_p(x, top_k, top_p), lambda x: x,
                        scaled)
  sampled = jax.nn.softmax(masked, axis=-1)
  one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
  return jnp.where(greedy, one_hot, sampled)


def _top_k_top_p(scaled, top_k, top_p):
  """Masks (to -inf) the logits outside each row's top-k, then outside its top-p nucleus."""
  vocab = scaled.shape[-1]
  # One descending sort serves both filters; ties at a threshold are all kept.
  sorted_logits = jnp.sort(scaled, axis=-1)[..., ::-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_logits, jnp.broadcast_to(k - 1, scaled.shape[:-1] + (1,)),
                            axis=-1)
  masked = jnp.where(scaled < kth, -jnp.inf, scaled)

  # top-p: keep the smallest prefix of the sorted (top-k filtered) distribution whose mass
  # reaches top_p, i.e. token i is kept when the mass strictly before it is < top_p, or
  # equivalently when the mass from it onwards (its suffix) is > 1 - top_p. The suffix is
  # summed from the smallest probability up, so the tail keeps its precision: a float32
  # running sum from the top reaches 1.0 early and would cut tokens whose exact mass-before is
  # still below top_p. top_p >= 1 keeps every token of the row exactly (the filter is off).
  sorted_masked = jnp.where(sorted_logits < kth, -jnp.inf, sorted_logits)
  sorted_probs = jax.nn.softmax(sorted_masked, axis=-1)
  mass_from = jnp.flip(jnp.cumsum(jnp.flip(sorted_probs, -1), axis=-1), -1)
  keep_sorted = (mass_from > 1.0 - top_p) | (top_p >= 1.0)
  # The smallest kept logit is the cut-off (keep_sorted is a prefix of the sorted order).
  n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1, keepdims=True), 1)
  cutoff = jnp.take_along_axis(sorted_masked, n_keep - 1, axis=-1)
  masked = jnp.where(masked < cutoff, -jnp.inf, masked)

  return masked


def sample(key, probabilities):
  """Draws one token per row from probabilities [..., V] -> int32 [...]."""
  logp = jnp.log(jnp.maximum(probabilities, 0.0))
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
