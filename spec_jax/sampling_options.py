"""How a field of `sj.Sampling` is declared: `option(...)` (a scalar or per-row [B] value, its
dtype, default, "off" value, check and help) and `bias_option(...)` (logit_bias, a sparse
{token: bias} map that becomes `LogitBias` [B, M] inside jit). `spec_jax.sampling` declares the
fields with them and iterates OPTIONS; the math is there, not here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


def _is_concrete(x) -> bool:
  """Whether x's values can be read on the host here (not a tracer, nor an array spread over
  other processes' devices, which was checked before it was placed there)."""
  # Text and None are values too, checked so that check() refuses them (they were counted as
  # unreadable, which switched off every field's checks in decode); abstract values
  # (ShapeDtypeStruct, a lowering's argument info) are not.
  def readable(leaf):
    if isinstance(leaf, jax.Array):
      return not isinstance(leaf, jax.core.Tracer) and leaf.is_fully_addressable
    return isinstance(leaf, (numbers.Number, np.ndarray, np.generic, str, bytes))
  return x is None or all(readable(leaf) for leaf in jax.tree.leaves(x))



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

  def check(self, name: str, value, batch_size: Optional[int] = None,
            vocab_size: Optional[int] = None) -> None:
    """ValueError unless value is valid: a host number, or a scalar or [batch_size] array.
    vocab_size: the model's V where known (options over token ids check them against it)."""
    del vocab_size
    if isinstance(value, numbers.Real):      # generate() checks per call: no numpy here
      if not self.valid(float(value)):
        raise ValueError(f"Sampling.{name} must be {self.rule}, got {value}")
      if abs(float(value)) > self._limit:
        raise ValueError(f"Sampling.{name} = {value} does not fit its {np.dtype(self.dtype)}")
      return
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
      raise ValueError(f"Sampling.{name} must be {self.rule}, got {value!r}")
    if arr.ndim > 1:
      raise ValueError(f"Sampling.{name} must be a scalar or a [batch] vector, got shape "
                       f"{arr.shape}")
    if batch_size is not None and arr.ndim == 1 and arr.shape[0] != batch_size:
      raise ValueError(f"Sampling.{name} has {arr.shape[0]} entries but the batch has "
                       f"{batch_size} rows; pass a scalar or one value per row")
    if not np.all(self.valid(arr.astype(np.float64))):
      raise ValueError(f"Sampling.{name} must be {self.rule}, got {arr.tolist()}")
    if np.any(np.abs(arr.astype(np.float64)) > self._limit):
      raise ValueError(f"Sampling.{name} = {arr.tolist()} does not fit its "
                       f"{np.dtype(self.dtype)}")

  @property
  def _limit(self) -> float:
    """The largest magnitude the option's dtype holds: a top_k of 2**31 overflowed int32, a
    temperature of 1e39 became inf in float32 (NaN is `valid`'s to refuse)."""
    info = np.iinfo if np.issubdtype(self.dtype, np.integer) else np.finfo
    return float(info(self.dtype).max)

  def rows(self, value, batch_size: int, xp=jnp):
    """value broadcast to the option's per-row array [batch_size] (xp: jnp, or np on the host;
    no checks: traced values pass through)."""
    return xp.broadcast_to(xp.asarray(value, self.dtype), (batch_size,))

  def scalar(self, value):
    """The host scalar of a scalar setting (hashable), or None for per-row arrays."""
    if not isinstance(value, numbers.Real):
      return None
    return self.parse(value)

  def is_concrete(self, value) -> bool:
    """Whether value can be read (checked) on the host here."""
    return _is_concrete(value)

  def maybe_on(self, value) -> bool:
    """False only when value is concretely the "off" value everywhere (static: decides at
    trace time whether the compiled program applies this option at all)."""
    if not self.is_concrete(value):
      return True
    return bool(np.any(np.asarray(value, np.float64) != self.off))


@flax.struct.dataclass
class LogitBias:
  """A sparse {token: bias} map per row in fixed shapes (what `Sampling.logit_bias` becomes
  inside jit). ids: int32 [B, M] (or [M] for every row); values: float32, the same shape.
  Entries are added to the logits (a repeated id adds up); padding entries have value 0."""
  ids: jax.Array
  values: jax.Array


def parse_logit_bias(text: str) -> dict:
  """The command line's form "ID:BIAS,ID:BIAS" -> {ID: BIAS}; "" -> None (off)."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    try:
      tok, bias = item.split(":")
      out[int(tok)] = float(bias)
    except ValueError:
      raise ValueError(f"logit bias entries are ID:BIAS (e.g. 50256:-100), got {item!r}")
  return out or None


def _is_real(x) -> bool:
  """A real number: a Python or numpy scalar, or a 0-d array of a numeric dtype (None, text and
  bytes are not, though float() reads "1.0")."""
  if isinstance(x, numbers.Real):
    return True
  kind = getattr(getattr(x, "dtype", None), "kind", None)
  return kind in ("b", "i", "u", "f") and np.ndim(x) == 0


def _is_pair(x) -> bool:
  return (isinstance(x, (tuple, list)) and len(x) == 2 and
          all(isinstance(v, (numbers.Real, np.generic)) or
              (hasattr(v, "shape") and np.ndim(v) == 0) for v in x))


BIAS_BUCKET = 8           # a map's entries are padded to a multiple of this (BiasOption.rows)


class BiasOption(Option):
  """Sampling.logit_bias, a sparse {token: bias} map: None (off); a dict {id: bias} for every
  row; a sequence of (id, bias) pairs (the same, hashable: what `scalar` returns); a sequence
  of B per-row maps (dicts or None); or a LogitBias of arrays (inside jit). Per-row it is a
  LogitBias [B, M], M the most entries of any row rounded up to a multiple of BIAS_BUCKET
  (padding: id 0, value 0), so that maps of 1-8 entries share one compiled decode (each
  count compiled anew)."""

  @property
  def parse(self):
    return parse_logit_bias

  @staticmethod
  def _maps(value):
    """A host value as (list of per-row maps, per_row: bool); None when it is a LogitBias."""
    if isinstance(value, LogitBias):
      return None
    if value is None:
      return [{}], False
    if isinstance(value, dict):
      return [value], False
    if isinstance(value, (list, tuple)):
      if value and all(v is None or isinstance(v, dict) for v in value):
        return [dict(v or {}) for v in value], True
      if all(_is_pair(v) for v in value):
        summed: dict = {}
        for k, b in value:                  # a repeated id adds up, as in a LogitBias
          summed[k] = summed[k] + b if k in summed else b
        return [summed], False
    raise ValueError(
        "Sampling.logit_bias must be None, a dict {token id: bias}, a list of (id, bias) pairs, "
        f"a list of one dict per row, or a sampling.LogitBias, got {type(value).__name__}")

  def check(self, name, value, batch_size=None, vocab_size=None) -> None:
    maps = self._maps(value)
    if maps is None:
      ids, values = np.asarray(value.ids), np.asarray(value.values)
      if ids.shape != values.shape or ids.ndim not in (1, 2):
        raise ValueError(f"Sampling.{name}: LogitBias ids and values must have one shape, [M] "
                         f"or [batch, M]; got {ids.shape} and {values.shape}")
      if batch_size is not None and ids.ndim == 2 and ids.shape[0] != batch_size:
        raise ValueError(f"Sampling.{name} has {ids.shape[0]} rows but the batch has "
                         f"{batch_size} rows")
      pairs = list(zip(ids.reshape(-1).tolist(), values.reshape(-1).tolist()))
    else:
      rows, per_row = maps
      if per_row and batch_size is not None and len(rows) != batch_size:
        raise ValueError(f"Sampling.{name} has {len(rows)} entries but the batch has "
                         f"{batch_size} rows; pass one map or one per row")
      pairs = [kv for row in rows for kv in row.items()]
    for tok, bias in pairs:
      if isinstance(tok, bool) or not isinstance(tok, (numbers.Integral, np.integer)) \
          and not (isinstance(tok, numbers.Real) and float(tok).is_integer()):
        raise ValueError(f"Sampling.{name}: token ids must be integers, got {tok!r}")
      if tok < 0 or (vocab_size is not None and tok >= vocab_size):
        allowed = ">= 0" if vocab_size is None else f"in [0, {vocab_size})"
        raise ValueError(f"Sampling.{name}: token id {tok} is outside the vocabulary: ids must "
                         f"be {allowed}")
      if not _is_real(bias) or math.isnan(float(bias)) or float(bias) == math.inf:
        raise ValueError(f"Sampling.{name}: the bias of token {tok} must be a finite number "
                         f"or -inf (a ban), got {bias!r}")

  def rows(self, value, batch_size, xp=jnp):
    maps = self._maps(value)
    if maps is None:
      ids, values = xp.asarray(value.ids, np.int32), xp.asarray(value.values, np.float32)
      m = ids.shape[-1]
      return LogitBias(ids=xp.broadcast_to(ids, (batch_size, m)),
                       values=xp.broadcast_to(values, (batch_size, m)))
    rows, per_row = maps
    m = -(-max(len(r) for r in rows) // BIAS_BUCKET) * BIAS_BUCKET
    ids = np.zeros((len(rows), m), np.int32)
    vals = [[0.0] * m for _ in rows]          # values may be traced (a dict passed to jit)
    for i, r in enumerate(rows):
      for j, (tok, bias) in enumerate(sorted(r.items(), key=lambda kv: int(kv[0]))):
        ids[i, j], vals[i][j] = int(tok), bias
    values = xp.asarray(vals, np.float32).reshape(len(rows), m)
    if not per_row:
      ids, values = np.broadcast_to(ids, (batch_size, m)), xp.broadcast_to(values, (batch_size, m))
    return LogitBias(ids=xp.asarray(ids), values=values)

  def scalar(self, value):
    """The (id, bias) pairs of a map shared by every row, sorted (hashable); None per row."""
    maps = self._maps(value) if not isinstance(value, LogitBias) else None
    if maps is None or maps[1]:
      return None
    try:
      return tuple(sorted((int(k), float(b)) for k, b in maps[0][0].items()))
    except TypeError:       # traced biases
      return None

  def is_concrete(self, value) -> bool:
    """No leaf is traced (nor spread over other processes): anything else is checked."""
    return not any(isinstance(x, jax.core.Tracer) or
                   (isinstance(x, jax.Array) and not x.is_fully_addressable)
                   for x in jax.tree.leaves(value))

  def maybe_on(self, value) -> bool:
    """On when the map has entries: its per-row width M is static either way."""
    if isinstance(value, LogitBias):
      return np.shape(value.ids)[-1] > 0
    return any(len(r) for r in self._maps(value)[0])


def bias_option(help: str = ""):
  """The Sampling field of logit_bias (a BiasOption)."""
  return flax.struct.field(default=None, metadata={"option": BiasOption(
      dtype=np.float32, default=None, off=None, valid=lambda x: True,
      rule="a sparse {token id: bias} map", help=help)})


def option(dtype, default, *, off, valid, rule: str, help: str = ""):
  """A Sampling field declared with its Option (dataclass metadata, read into OPTIONS)."""
  return flax.struct.field(default=default, metadata={"option": Option(
      dtype=dtype, default=default, off=off, valid=valid, rule=rule, help=help)})
