"""Sampling parameters and the one logits -> probabilities transform.

Target and draft distributions both come from `probs`, so the rejection sampler compares like
with like: p = probs(target_logits, s) and q = probs(draft_logits, s) are the exact
distributions that plain sampling would draw from. Greedy is temperature 0: a one-hot argmax,
which turns rejection sampling into exact matching.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class Sampling:
  """Sampling settings, scalars or per-row [B] arrays.

  temperature: >= 0; 0 is greedy (one-hot argmax).
  top_k: >= 0 integer; 0 disables top-k.
  top_p: in (0, 1]; 1 disables top-p.
  """
  temperature: jax.Array | float = 1.0
  top_k: jax.Array | int = 0
  top_p: jax.Array | float = 1.0

  def __post_init__(self):
    if all(_is_concrete(v) for v in (self.temperature, self.top_k, self.top_p)):
      self.check()

  def _scalars(self) -> bool:
    """All three fields are host scalars (Python or numpy numbers): the cheap paths below."""
    return all(isinstance(v, numbers.Real)
               for v in (self.temperature, self.top_k, self.top_p))

  def check(self, batch_size: Optional[int] = None) -> "Sampling":
    """Raises ValueError on invalid values or per-row arrays whose length is not batch_size."""
    if self._scalars():       # the same checks and messages without numpy (generate() per call)
      t, k, p = float(self.temperature), self.top_k, float(self.top_p)
      if not math.isfinite(t) or t < 0:
        raise ValueError(f"Sampling.temperature must be finite and >= 0 (0 = greedy), got {t}")
      if not float(k).is_integer():
        raise ValueError(f"Sampling.top_k must be a non-negative integer (0 = off), got {k}")
      if k < 0:
        raise ValueError(f"Sampling.top_k must be >= 0 (0 = off), got {k}")
      if not math.isfinite(p) or p <= 0 or p > 1:
        raise ValueError(f"Sampling.top_p must lie in (0, 1] (1 = off), got {p}")
      return self
    t = np.asarray(self.temperature, dtype=np.float64)
    k = np.asarray(self.top_k)
    p = np.asarray(self.top_p, dtype=np.float64)
    for name, arr in (("temperature", t), ("top_k", k), ("top_p", p)):
      if arr.ndim > 1:
        raise ValueError(f"Sampling.{name} must be a scalar or a [batch] vector, got shape {arr.shape}")
      if batch_size is not None and arr.ndim == 1 and arr.shape[0] != batch_size:
        raise ValueError(f"Sampling.{name} has {arr.shape[0]} entries but the batch has "
                         f"{batch_size} rows; pass a scalar or one value per row")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
      raise ValueError(f"Sampling.temperature must be finite and >= 0 (0 = greedy), got {t.tolist()}")
    if not np.issubdtype(k.dtype, np.integer) and not np.all(np.equal(np.mod(k, 1), 0)):
      raise ValueError(f"Sampling.top_k must be a non-negative integer (0 = off), got {k.tolist()}")
    if np.any(k < 0):
      raise ValueError(f"Sampling.top_k must be >= 0 (0 = off), got {k.tolist()}")
    if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
      raise ValueError(f"Sampling.top_p must lie in (0, 1] (1 = off), got {p.tolist()}")
    return self

  def as_arrays(self, batch_size: int) -> "Sampling":
    """Per-row arrays of shape [B] (float32, int32, float32) for use inside jit."""
    self.check(batch_size)
    if self._scalars():
      return _scalar_rows(float(self.temperature), int(self.top_k), float(self.top_p),
                          int(batch_size))
    fields = (self.temperature, self.top_k, self.top_p)
    # Host values stay numpy (no eager device op per field); jax arrays and tracers stay jax.
    xp = jnp if any(isinstance(x, jax.Array) for x in fields) else np
    return Sampling(
        temperature=xp.broadcast_to(xp.asarray(self.temperature, xp.float32), (batch_size,)),
        top_k=xp.broadcast_to(xp.asarray(self.top_k, xp.int32), (batch_size,)),
        top_p=xp.broadcast_to(xp.asarray(self.top_p, xp.float32), (batch_size,)))

  @property
  def is_greedy(self) -> bool:
    if isinstance(self.temperature, numbers.Real):
      return bool(self.temperature == 0)
    return bool(np.all(np.asarray(self.temperature) == 0))


@functools.lru_cache(maxsize=256)
def _scalar_rows(temperature: float, top_k: int, top_p: float, batch_size: int) -> Sampling:
  """Sampling.as_arrays of checked scalar settings: read-only numpy rows, made once per
  (settings, batch) (generate() asks for them on every call)."""
  rows = (np.full((batch_size,), temperature, np.float32),
          np.full((batch_size,), top_k, np.int32),
          np.full((batch_size,), top_p, np.float32))
  for row in rows:
    row.flags.writeable = False
  return Sampling(*rows)


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
