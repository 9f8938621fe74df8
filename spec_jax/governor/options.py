"""The Governor: the knobs of num_draft="auto", checked (ValueError on bad ones), hashable."""

from __future__ import annotations

import math
import numbers

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.governor.costs import CostTable

DEFAULT_KS = (0, 1, 2, 4, 6, 8)
OPTIONS = {
    "max_draft": "largest K the governor may choose (integer >= 1; default 8)",
    "ks": "candidate K values (integers >= 0; default {0,1,2,4,6,8} up to max_draft and the "
          "drafter's max_draft)",
    "smoothing": "per-round decay of the acceptance counts, in [0, 1) (default 0.8)",
    "prior_alpha": "per-token acceptance assumed before evidence, in [0, 1] (default 0.6; "
                   "decode's acceptance_prior, learned from earlier calls, replaces it)",
    "prior_weight": "judged drafts the prior is worth, > 0 (default 2)",
    "warmup_rounds": "first loop iterations that must draft (integer >= 0; default 2; none "
                     "when decode is given an acceptance_prior)",
    "gate_alpha": "rows with smoothed alpha below this get draft length 0, in [0, 1] "
                  "(default 0.05; 0 = never)",
    "costs": "a cost table {K: seconds per round} to use instead of calibrating",
    "schedule": "a fixed sequence of K, cycled (tests): overrides the choice",
    "objective": "what K optimises: 'slowest' (default: the expected rounds the slowest row "
                 "still needs times the round's cost; the loop runs until its last row is "
                 "done) or 'mean' (the batch's expected tokens per second of one round)",
    "pool_weight": "judged drafts the batch's pooled acceptance is worth in each row's "
                   "estimate under objective 'slowest', >= 0 (default 4; 0 = rows alone)",
}
OBJECTIVES = ("slowest", "mean")
# Rows of an acceptance prior with spread (generate's acceptance_prior of shape [M, W], an
# earlier output's stats.row_acceptance): resampled to this many, so that every prior (and
# none) is the same argument shape, i.e. one executable.
PRIOR_ROWS = 32
# Judged drafts a pooled rate is worth in a row's estimate (Governor's pool_weight default).
DEFAULT_POOL_WEIGHT = 4.0


def is_int(x) -> bool:
  return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def is_real(x) -> bool:
  return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(x, bool)


class Governor:
  """The knobs of num_draft="auto" (see the module docstring and OPTIONS). Hashable: a static
  argument of the jitted decode. Unknown options or bad values raise ValueError."""

  def __init__(self, **options):
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
      raise ValueError(f"unknown governor option(s) {unknown}; allowed: {', '.join(OPTIONS)}")
    max_draft = options.get("max_draft", 8)
    if not is_int(max_draft) or max_draft < 1:
      raise ValueError(f"Governor max_draft must be an integer >= 1, got {max_draft!r}")
    self.max_draft = int(max_draft)
    self.ks = self._k_tuple(options.get("ks"), "ks", sort=True)
    self.schedule = self._k_tuple(options.get("schedule"), "schedule", sort=False)
    if self.ks is not None and self.schedule is not None:
      missing = sorted(set(self.schedule) - set(self.ks))
      if missing:
        raise ValueError(f"Governor schedule uses K {missing}, which are not in ks {self.ks}")
    self.smoothing = self._real(options, "smoothing", 0.8, 0.0, 1.0, hi_open=True)
    self.prior_alpha = self._real(options, "prior_alpha", 0.6, 0.0, 1.0)
    self.prior_weight = self._real(options, "prior_weight", 2.0, 0.0, math.inf, lo_open=True)
    self.gate_alpha = self._real(options, "gate_alpha", 0.05, 0.0, 1.0)
    warm = options.get("warmup_rounds", 2)
    if not is_int(warm) or warm < 0:
      raise ValueError(f"Governor warmup_rounds must be an integer >= 0, got {warm!r}")
    self.warmup_rounds = int(warm)
    objective = options.get("objective", "slowest")
    if objective not in OBJECTIVES:
      raise ValueError(f"Governor objective must be one of {OBJECTIVES}, got {objective!r}")
    self.objective = objective
    self.pool_weight = self._real(options, "pool_weight", DEFAULT_POOL_WEIGHT, 0.0,
                                  math.inf)
    costs = options.get("costs")
    if costs is not None:
      if isinstance(costs, CostTable):
        costs = costs.as_mapping()
      if not isinstance(costs, dict) or not costs:
        raise ValueError(f"Governor costs must be a non-empty mapping {{K: seconds per round}} "
                         f"or a CostTable, got {costs!r}")
      bad = {k: v for k, v in costs.items()
             if not is_int(k) or k < 0 or not is_real(v) or not v > 0 or not math.isfinite(v)}
      if bad:
        raise ValueError(f"Governor costs must map integer K >= 0 to positive seconds; bad "
                         f"entries: {bad}")
      costs = tuple(sorted((int(k), float(v)) for k, v in costs.items()))
    self.costs = costs

  def _k_tuple(self, value, name, sort):
    if value is None:
      return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
      raise ValueError(f"Governor {name} must be a sequence of integers K >= 0, got {value!r}")
    vals = list(value)
    if not vals or any(not is_int(k) or k < 0 for k in vals):
      raise ValueError(f"Governor {name} must be a non-empty sequence of integers K >= 0, got "
                       f"{value!r}")
    big = sorted({int(k) for k in vals if k > self.max_draft})
    if big:
      raise ValueError(f"Governor {name} has K {big} above max_draft={self.max_draft}")
    vals = [int(k) for k in vals]
    return tuple(sorted(set(vals))) if sort else tuple(vals)

  @staticmethod
  def _real(options, name, default, lo, hi, lo_open=False, hi_open=False):
    v = options.get(name, default)
    ok = is_real(v) and math.isfinite(float(v))
    if ok:
      v = float(v)
      ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
      rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
      raise ValueError(f"Governor {name} must be a number in {rng}, got {options.get(name)!r}")
    return v

  # ----------------------------------------------------------------------- identity

  def _key(self):
    return (self.max_draft, self.ks, self.schedule, self.smoothing, self.prior_alpha,
            self.prior_weight, self.warmup_rounds, self.gate_alpha, self.costs, self.objective,
            self.pool_weight)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, Governor) and self._key() == other._key()

  def options(self) -> dict:
    """The knobs as a plain dict (for JSON)."""
    return {"max_draft": self.max_draft, "ks": self.ks, "smoothing": self.smoothing,
            "prior_alpha": self.prior_alpha, "prior_weight": self.prior_weight,
            "warmup_rounds": self.warmup_rounds, "gate_alpha": self.gate_alpha,
            "costs": None if self.costs is None else dict(self.costs),
            "schedule": self.schedule, "objective": self.objective,
            "pool_weight": self.pool_weight}

  def __repr__(self):
    return "Governor(" + ", ".join(f"{k}={v!r}" for k, v in self.options().items()) + ")"

  # ----------------------------------------------------------------------- candidates, costs

  def candidates(self, drafter) -> tuple:
    """The sorted candidate K set for `drafter` (ValueError when it exceeds the drafter's
    max_draft). Default: {0,1,2,4,6,8} up to min(max_draft, drafter.max_draft), plus that cap
    when it is not in the set (Medusa with 3 heads: {0, 1, 2, 3}), plus the schedule's K."""
    dmax = getattr(drafter, "max_draft", None)
    if self.ks is not None:
      big = [k for k in self.ks if dmax is not None and k > dmax]
      if big:
        raise ValueError(f"Governor ks {self.ks} exceed this drafter's max_draft={dmax} "
                         f"(it proposes at most {dmax} tokens per round)")
      return self.ks
    cap = self.max_draft if dmax is None else min(self.max_draft, dmax)
    ks = {k for k in DEFAULT_KS if k <= cap} | {cap}
    if self.schedule is not None:
      big = sorted({k for k in self.schedule if k > cap})
      if big:
        raise ValueError(f"Governor schedule has K {big} above this drafter's max_draft={dmax}")
      ks |= set(self.schedule)
    return tuple(sorted(ks))

  def cost_array(self, drafter, round_costs=None):
    """float32 [len(candidates) + 1] for decode: the per-round costs at each candidate K, then
    the entry cost (what the first drafted round pays once more: the drafter's work on the
    prompt, skipped by a call that decodes plainly from its first round; 0 when not known).
    From round_costs (an array aligned with candidates(drafter), optionally followed by the
    entry cost, or a CostTable), else the `costs` knob, else ones when a schedule decides.
    ValueError for a missing or misaligned table."""
    ks = self.candidates(drafter)
    if isinstance(round_costs, CostTable):
      round_costs = round_costs.costs_for(ks)
    if round_costs is not None:
      shape = np.shape(round_costs)
      if shape not in ((len(ks),), (len(ks) + 1,)):
        raise ValueError(f"round_costs must have one entry per candidate K {ks}: shape "
                         f"({len(ks)},), or ({len(ks) + 1},) with the entry cost last; got "
                         f"{shape}")
      costs = jnp.asarray(round_costs, jnp.float32)
      return costs if shape[0] > len(ks) else jnp.append(costs, 0.0)
    if self.costs is not None:
      table = dict(self.costs)
      missing = [k for k in ks if k not in table]
      if missing:
        raise ValueError(f"Governor costs has no entry for K {missing} (candidates {ks})")
      return jnp.asarray([table[k] for k in ks] + [0.0], jnp.float32)
    if self.schedule is not None:
      return jnp.append(jnp.ones((len(ks),), jnp.float32), 0.0)
    raise ValueError("num_draft='auto' needs a cost table: pass round_costs="
                     "sj.calibrate(...).round_costs to decode (generate calibrates itself), or "
                     "Governor(costs={K: seconds}), or a Governor(schedule=...)")

  def needs_calibration(self) -> bool:
    return self.costs is None and self.schedule is None

  def init_state(self, drafter, batch: int, prior=None) -> "GovernorState":
    """The governor's initial carry: the prior at every row and draft position, an empty
    histogram.

    prior: None (the guess: prior_alpha at every position, and the warm-up rounds draft), or
    float32 [W] per-position acceptance learned from earlier calls of the same pair
    (DecodeResult.position_acceptance; W = the largest candidate K), or float32 [Q, W] the
    rows of earlier calls (DecodeResult.row_acceptance, resampled to Q = PRIOR_ROWS rows by
    Governed.acceptance_prior): the spread of per-row acceptance, which the slowest-row
    objective reads as a mixture (`choice.profile_weights`). Each row starts at the rows'
    mean, worth prior_weight judged drafts at each position. Where every entry is >= 0 the
    state is `informed`: the first rounds are chosen from it, with no warm-up (a pooled
    prior; one with spread keeps the drafted warm-up, whose evidence weighs the mixture). A
    traced array: one executable either way (entries < 0 mean "no prior")."""
    width = (batch, max(1, max(self.candidates(drafter))))
    alpha = jnp.full(width, self.prior_alpha, jnp.float32)
    informed = jnp.zeros((), bool)
    profiles = None
    if prior is not None:
      prior = jnp.asarray(prior, jnp.float32)
      if prior.ndim == 1:
        prior = prior[None, :]
      if prior.ndim != 2 or prior.shape[1:] != width[1:]:
        raise ValueError(f"acceptance_prior must hold one acceptance per draft position: shape "
                         f"{width[1:]} or (rows, {width[1]}), got {prior.shape}")
      informed = jnp.all(prior >= 0.0)
      profiles = jnp.where(informed, jnp.clip(prior, 0.0, 1.0), self.prior_alpha)
      alpha = jnp.broadcast_to(jnp.mean(profiles, axis=0)[None, :], width)
    return GovernorState(
        accepted=alpha * self.prior_weight,
        judged=jnp.full(width, self.prior_weight, jnp.float32),
        k_hist=jnp.zeros((len(self.candidates(drafter)),), jnp.int32),
        choice=jnp.zeros((), jnp.int32),
        informed=informed,
        profiles=profiles,
        seen_accepted=jnp.zeros(width, jnp.float32),
        seen_judged=jnp.zeros(width, jnp.float32))


@flax.struct.dataclass
class GovernorState:
  """The governor's part of the loop carry (B rows, N candidate K values).

  accepted, judged: float32 [B, W] smoothed counts of accepted and judged drafts per row and
    draft position (W = the largest candidate K; prior included); alpha = accepted / judged,
    the acceptance of position j given the positions before it were accepted.
  k_hist: int32 [N] loop iterations that ran with each candidate K.
  choice: int32 scalar, the index (into the candidates) of the next round's K.
  informed: bool scalar, the prior was learned from earlier calls (no warm-up rounds).
  profiles: float32 [Q, W] the per-row acceptance of earlier calls' rows (the prior's spread;
    Q equal rows when the prior is pooled or the guess), or None (no spread: the estimates
    alone).
  seen_accepted, seen_judged: float32 [B, W] the same counts over the whole call, undecayed
    and without the prior, or None: each row's acceptance over the call (row_acceptance), the
    spread a later call's prior carries (the smoothed estimates, worth about 1 / (1 -
    smoothing) judged drafts, would overstate it with their own noise); seen_judged also
    says how much of the prior is left in the smoothed counts (choice.prior_mass).
  """
  accepted: jax.Array
  judged: jax.Array
  k_hist: jax.Array
  choice: jax.Array
  informed: jax.Array = None
  profiles: jax.Array = None
  seen_accepted: jax.Array = None
  seen_judged: jax.Array = None


def row_acceptance(gs: GovernorState, pool_weight: float = DEFAULT_POOL_WEIGHT):
  """float32 [B, W]: each row's acceptance of draft position j over the whole call, its
  undecayed counts (prior excluded) shrunk toward the call's pooled rate P_j worth
  `pool_weight` judged drafts: (A_bj + w P_j) / (J_bj + w), the empirical-Bayes posterior mean.
  A row judged twice says little (0 / 2 is not hopeless), one judged thirty times says what
  it is: without the shrinkage the rows' spread would be their counting noise. What
  DecodeResult.row_acceptance hands a later call."""
  if gs.seen_judged is None:
    return jnp.clip(gs.accepted / jnp.maximum(gs.judged, 1e-6), 0.0, 1.0)
  return shrunk_rates(gs.seen_accepted, gs.seen_judged, pooled_acceptance(gs), pool_weight)


def shrunk_rates(accepted, judged, pool, weight: float = DEFAULT_POOL_WEIGHT):
  """float32 [B, W]: per-row rates (A_bj + w P_j) / (J_bj + w) from counts accepted, judged
  [B, W] and a pooled rate pool [W] worth w judged drafts (P_j where J_bj + w = 0): the
  empirical-Bayes posterior mean that the rows of an acceptance prior are
  (governor.row_acceptance, Strategy.row_acceptance)."""
  accepted, judged = jnp.asarray(accepted, jnp.float32), jnp.asarray(judged, jnp.float32)
  pool = jnp.broadcast_to(jnp.asarray(pool, jnp.float32), accepted.shape)
  mass = judged + weight
  return jnp.where(mass > 0, (accepted + weight * pool) / jnp.maximum(mass, 1e-6), pool)


def pooled_acceptance(gs: GovernorState):
  """float32 [W]: the per-position acceptance pooled over the rows, sum_b A_bj / sum_b J_bj
  (the smoothed counts, prior included: a position never judged keeps its prior). What a call
  hands the next one as its acceptance_prior."""
  return jnp.clip(jnp.sum(gs.accepted, axis=0) / jnp.maximum(jnp.sum(gs.judged, axis=0), 1e-6),
                  0.0, 1.0)
