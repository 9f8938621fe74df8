"""Statistical checks for losslessness tests (numpy and the standard library only).

Speculative decoding must leave the target's distribution unchanged, so its tests draw many
samples and compare the observed counts with the expected distribution (goodness of fit) or
with counts drawn without speculation (homogeneity). Both are Pearson chi-square tests:

    counts = counts_of(samples, num_bins)
    assert_same_distribution(counts, probs)          # samples ~ probs ?
    assert_same_samples(counts_a, counts_b)          # two samples from one distribution ?

Bins whose expected count is below `min_expected` (5, the usual rule of thumb for the
chi-square approximation) are pooled into one bin before the statistic is formed. A bin with
expected probability exactly 0 but a positive count is an impossible outcome: the statistic is
then +inf. The p-value comes from the exact chi-square survival function (regularized upper
incomplete gamma function, computed here without scipy); `wilson_hilferty_critical` is the
closed-form approximation of the critical value, `chi2_critical` the exact one.

With alpha = 1e-3 a correct sampler fails a single check one time in a thousand (with fixed
seeds: never, once it has passed); a wrong one fails when its distribution differs by more than
about sqrt(dof * 20 / n) in relative terms, so use 1e5 samples or more for small vocabularies.
"""

from __future__ import annotations

import math
import statistics

import numpy as np


def counts_of(samples, num_bins: int) -> np.ndarray:
  """Histogram of integer samples in [0, num_bins): int64 [num_bins]. Raises on out-of-range."""
  samples = np.asarray(samples).reshape(-1)
  if samples.size and (samples.min() < 0 or samples.max() >= num_bins):
    raise ValueError(f"samples must lie in [0, {num_bins}), got values from {samples.min()} "
                     f"to {samples.max()}")
  return np.bincount(samples.astype(np.int64), minlength=num_bins)


def _pool_small(expected: np.ndarray, observed: list[np.ndarray], min_expected: float):
  """Merges bins with expected count < min_expected into one bin (and, if that pooled bin is
  still too small, with the smallest remaining bins). expected [k]; observed: arrays [k]."""
  order = np.argsort(expected, kind="stable")
  small = expected < min_expected
  if not small.any():
    return expected, observed
  pooled = list(np.flatnonzero(small))
  rest = [i for i in order if not small[i]]
  while expected[pooled].sum() < min_expected and rest:
    pooled.append(rest.pop(0))
  keep = np.array(sorted(rest), dtype=np.int64)
  new_expected = np.append(expected[keep], expected[pooled].sum())
  new_observed = [np.append(o[keep], o[pooled].sum()) for o in observed]
  return new_expected, new_observed


def chi_square(counts, expected_probs, min_expected: float = 5.0) -> tuple[float, int]:
  """Pearson's goodness-of-fit statistic of counts against a distribution.

  Args:
    counts: observed counts, any shape (flattened; e.g. a joint [V, V] table).
    expected_probs: same number of entries, non-negative, summing to 1 (within 1e-3; it is
      renormalised).
    min_expected: bins with expected count n * p below this are pooled into one bin.

  Returns:
    (stat, dof): the statistic sum (O - E)^2 / E over the pooled bins and its degrees of
    freedom (pooled bins - 1). stat is +inf when a bin of probability 0 has a count; dof is 0
    when everything pools into one bin (too few samples to test anything).
  """
  observed = np.asarray(counts, dtype=np.float64).reshape(-1)
  probs = np.asarray(expected_probs, dtype=np.float64).reshape(-1)
  if observed.shape != probs.shape:
    raise ValueError(f"counts has {observed.size} bins but expected_probs has {probs.size}")
  if np.any(observed < 0) or np.any(probs < 0) or not np.all(np.isfinite(probs)):
    raise ValueError("counts and expected_probs must be non-negative and finite")
  total_p = probs.sum()
  if abs(total_p - 1.0) > 1e-3:
    raise ValueError(f"expected_probs must sum to 1, got {total_p}")
  probs = probs / total_p
  n = observed.sum()
  if n == 0:
    raise ValueError("no samples")
  impossible = probs == 0
  if np.any(observed[impossible] > 0):
    return math.inf, max(int((~impossible).sum()) - 1, 1)
  expected = n * probs[~impossible]
  expected, (observed,) = _pool_small(expected, [observed[~impossible]], min_expected)
  dof = expected.size - 1
  if dof < 1:
    return 0.0, 0
  stat = float(np.sum((observed - expected) ** 2 / expected))
  return stat, dof


def chi_square_two_sample(counts_a, counts_b, min_expected: float = 5.0) -> tuple[float, int]:
  """Pearson's homogeneity statistic for two histograms over the same bins (2 x k table).

  Expected counts come from the pooled proportions; bins whose smaller expected count is below
  min_expected are pooled, bins empty in both samples are dropped. Returns (stat, dof) with
  dof = pooled bins - 1.
  """
  a = np.asarray(counts_a, dtype=np.float64).reshape(-1)
  b = np.asarray(counts_b, dtype=np.float64).reshape(-1)
  if a.shape != b.shape:
    raise ValueError(f"the histograms have {a.size} and {b.size} bins")
  if a.sum() == 0 or b.sum() == 0:
    raise ValueError("both samples need at least one count")
  used = (a + b) > 0
  a, b = a[used], b[used]
  frac_a = a.sum() / (a.sum() + b.sum())
  smaller_expected = (a + b) * min(frac_a, 1 - frac_a)
  smaller_expected, (a, b) = _pool_small(smaller_expected, [a, b], min_expected)
  dof = a.size - 1
  if dof < 1:
    return 0.0, 0
  total = a + b
  ea, eb = total * frac_a, total * (1 - frac_a)
  stat = float(np.sum((a - ea) ** 2 / ea) + np.sum((b - eb) ** 2 / eb))
  return stat, dof


def chi2_sf(stat: float, dof: int) -> float:
  """P(X >= stat) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2,
  stat/2), by its series (x < a + 1) or continued fraction (Numerical Recipes, 6.2)."""
  if dof < 1:
    raise ValueError(f"dof must be >= 1, got {dof}")
  if math.isinf(stat):
    return 0.0
  if stat <= 0:
    return 1.0
  a, x = dof / 2.0, stat / 2.0
  log_prefactor = a * math.log(x) - x - math.lgamma(a)
  if x < a + 1:  # lower series: P(a, x) = e^-x x^a / Gamma(a+1) * sum x^n / ((a+1)...(a+n))
    term = total = 1.0 / a
    ap = a
    for _ in range(10_000):
      ap += 1
      term *= x / ap
      total += term
      if abs(term) < abs(total) * 1e-15:
        break
    return max(0.0, 1.0 - total * math.exp(log_prefactor))
  tiny = 1e-300  # modified Lentz for Q(a, x) = e^-x x^a / Gamma(a) * 1/(x+1-a- 1(1-a)/(x+3-a- ...
  b = x + 1 - a
  c = 1 / tiny
  d = 1 / b
  h = d
  for i in range(1, 10_000):
    an = -i * (i - a)
    b += 2
    d = an * d + b
    d = tiny if abs(d) < tiny else d
    c = b + an / c
    c = tiny if abs(c) < tiny else c
    d = 1 / d
    delta = d * c
    h *= delta
    if abs(delta - 1) < 1e-15:
      break
  return min(1.0, math.exp(log_prefactor) * h)


def wilson_hilferty_critical(dof: int, alpha: float) -> float:
  """Approximate upper-alpha quantile of chi-square(dof) (Wilson & Hilferty 1931):
  dof * (1 - 2/(9 dof) + z sqrt(2/(9 dof)))^3, z the standard normal (1 - alpha) quantile.
  Slightly high (conservative): at alpha = 1e-3 by 3% for dof 1, 2% for dof 3, < 0.5% for
  dof >= 24."""
  z = statistics.NormalDist().inv_cdf(1.0 - alpha)
  c = 2.0 / (9.0 * dof)
  return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_critical(dof: int, alpha: float) -> float:
  """Exact upper-alpha quantile of chi-square(dof): the x with chi2_sf(x, dof) = alpha."""
  lo, hi = 0.0, 2.0 * wilson_hilferty_critical(dof, alpha) + 10.0
  while chi2_sf(hi, dof) > alpha:
    hi *= 2
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if chi2_sf(mid, dof) > alpha:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


def _report(stat, dof, alpha, what):
  if dof < 1:
    raise ValueError(f"{what}: every bin pooled into one (too few samples); nothing to test")
  p_value = chi2_sf(stat, dof)
  critical = chi2_critical(dof, alpha)
  return p_value, critical


def assert_same_distribution(counts, probs, alpha: float = 1e-3, min_expected: float = 5.0,
                             label: str = "samples"):
  """Asserts that counts are consistent with draws from probs (chi-square p-value >= alpha).

  Returns (stat, dof, p_value). Raises AssertionError with the statistic, the critical value
  and the most deviant bins otherwise.
  """
  stat, dof = chi_square(counts, probs, min_expected)
  p_value, critical = _report(stat, dof, alpha, label)
  if p_value < alpha:
    observed = np.asarray(counts, dtype=np.float64).reshape(-1)
    expected = observed.sum() * np.asarray(probs, dtype=np.float64).reshape(-1)
    worst = np.argsort(-np.abs(observed - expected))[:5]
    bins = ", ".join(f"bin {i}: observed {observed[i]:.0f} expected {expected[i]:.1f}"
                     for i in worst)
    raise AssertionError(
        f"{label} do not follow the expected distribution: chi-square {stat:.2f} > critical "
        f"{critical:.2f} (dof {dof}, alpha {alpha}, p-value {p_value:.3g}, n "
        f"{observed.sum():.0f}); {bins}")
  return stat, dof, p_value


def assert_same_samples(counts_a, counts_b, alpha: float = 1e-3, min_expected: float = 5.0,
                        label: str = "samples"):
  """Asserts that two histograms are consistent with one distribution (homogeneity test).

  Returns (stat, dof, p_value); raises AssertionError when the p-value is below alpha.
  """
  stat, dof = chi_square_two_sample(counts_a, counts_b, min_expected)
  p_value, critical = _report(stat, dof, alpha, label)
  if p_value < alpha:
    raise AssertionError(
        f"{label}: the two samples differ: chi-square {stat:.2f} > critical {critical:.2f} "
        f"(dof {dof}, alpha {alpha}, p-value {p_value:.3g})")
  return stat, dof, p_value
