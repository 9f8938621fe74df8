"""CostTable: measured seconds per round at each candidate K (spec_jax.decoding.calibration makes them)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class CostTable:
  """Measured seconds per round at each candidate K for one (device, target, drafter, B,
  capacity, greedy).

  ks: tuple of K; seconds: tuple, seconds per round (median over repeats); spread_pct: tuple,
  (max-min)/median of the repeats; entry_seconds: what a call pays once before its first
  drafted round and a call that decodes plainly from its first round does not (the drafter's
  work on the prompt: an EAGLE head's layer, DFlash's context K/V; the target's captured
  layers), per call; key: what it was measured for (the fingerprint's fields);
  fingerprint: hex digest of key; from_cache: read from disk (or memory) instead of measured;
  measure_seconds: wall time of this calibrate() call; path: the JSON file (None if not
  cached)."""
  ks: tuple
  seconds: tuple
  spread_pct: tuple
  key: dict
  fingerprint: str
  from_cache: bool = False
  measure_seconds: float = 0.0
  path: Optional[str] = None
  entry_seconds: float = 0.0

  @property
  def round_costs(self) -> np.ndarray:
    """float32 [len(ks) + 1] for decode(round_costs=...): the seconds per round, then the
    entry cost."""
    return np.asarray(tuple(self.seconds) + (self.entry_seconds,), np.float32)

  def as_mapping(self) -> dict:
    return dict(zip(self.ks, self.seconds))

  def costs_for(self, ks) -> np.ndarray:
    """float32 [len(ks) + 1]: the seconds per round at each K of ks, then the entry cost."""
    table = self.as_mapping()
    missing = [k for k in ks if k not in table]
    if missing:
      raise ValueError(f"this cost table has no entry for K {missing} (it has {self.ks})")
    return np.asarray([table[k] for k in ks] + [self.entry_seconds], np.float32)

  def relative(self) -> dict:
    """{K: t(K) / t(0)} (t(0) = a plain round), or seconds when 0 was not measured."""
    table = self.as_mapping()
    base = table.get(0)
    return {k: v / base if base else v for k, v in table.items()}

  def as_dict(self) -> dict:
    return {"ks": list(self.ks), "seconds": list(self.seconds),
            "spread_pct": list(self.spread_pct), "entry_seconds": self.entry_seconds,
            "relative": {str(k): v for k, v in
                                                               self.relative().items()},
            "key": self.key, "fingerprint": self.fingerprint, "from_cache": self.from_cache,
            "measure_seconds": self.measure_seconds, "path": self.path}
