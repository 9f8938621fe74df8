"""Derived measures of speculative decoding: per-token alpha, the analytic speedup bound, the
cache capacity generate() picks. Pure arithmetic on SpecStats and cost ratios.
"""

from __future__ import annotations

from typing import Optional
from spec_jax.decoding.prompts import CAPACITY_BUCKET, round_up


def alpha_per_verified_token(stats) -> Optional[float]:
  """accepted / (accepted + rejections): the per-token acceptance of the i.i.d. model
  tau = (1 - a^(K+1)) / (1 - a), over the drafts that were judged (each round's accepted drafts
  and its first rejection; a Bernoulli estimate, which a round cut before its rejection or an
  n-gram round of fewer drafts leaves unbiased). SpecStats.acceptance_rate divides by every
  drafted token, including the drafts after a round's first rejection that were never judged,
  so it equals (tau - 1) / K and falls with K.

  The rejections are counted by the engine (SpecStats.rejected). Statistics without that count
  fall back on rounds x (1 - accepted_at[K-1]), exact only when every round drafted all K
  tokens; None when they did not (a cut last round, an n-gram miss). None for trees and when
  nothing was judged."""
  k, rounds = stats.num_draft, stats.rounds
  if not isinstance(k, int) or k == 0 or rounds == 0 or getattr(stats, "tree", None):
    return None
  rejections = getattr(stats, "rejected", None)
  if rejections is None:
    if stats.drafted != rounds * k:
      return None
    rejections = rounds * (1.0 - stats.accepted_at[k - 1])
  judged = stats.accepted + rejections
  return stats.accepted / judged if judged else None


def bound_of(tau: float, k: int, c_draft: float, c_verify: float) -> float:
  """tau / (K c_draft + c_verify): the speedup with the measured tau and cost ratios and no
  other overhead (Leviathan et al. with c_verify = 1)."""
  return tau / (k * c_draft + c_verify)


def engine_capacity(longest: int, max_new: int, k: int) -> int:
  """A tight KV-cache capacity for these prompts and K (rounded up to a multiple of 64): what
  the benchmarks time at (generate() itself picks a power-of-two bucket by default)."""
  return round_up(longest + max_new + k + 1, CAPACITY_BUCKET)


def first_difference(a_rows, b_rows):
  """The first place two batches of token lists differ -> (row, position) with the smallest
  position over rows (ties: the first row), or None when they are equal. A row that is a
  strict prefix of the other differs at the shorter one's length."""
  if len(a_rows) != len(b_rows):
    raise ValueError(f"cannot compare {len(a_rows)} rows with {len(b_rows)}")
  best = None
  for b, (x, y) in enumerate(zip(a_rows, b_rows)):
    x, y = list(x), list(y)
    pos = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
    if pos is None and len(x) != len(y):
      pos = min(len(x), len(y))
    if pos is not None and (best is None or pos < best[1]):
      best = (b, pos)
  return best


def common_prefix_fraction(a_rows, b_rows) -> float:
  """The mean over rows of (tokens before the rows' first difference) / (the longer row's
  length): 1.0 for equal batches; how far greedy outputs agree before a near-tie parts them."""
  if len(a_rows) != len(b_rows) or not a_rows:
    raise ValueError(f"cannot compare {len(a_rows)} rows with {len(b_rows)}")
  fractions = []
  for x, y in zip(a_rows, b_rows):
    x, y = list(x), list(y)
    n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    longest = max(len(x), len(y))
    fractions.append(n / longest if longest else 1.0)
  return sum(fractions) / len(fractions)
