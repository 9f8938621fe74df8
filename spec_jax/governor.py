"""num_draft="auto": the speculation governor picks K (0 = a plain step) every round.

Cost model. A round with K drafts costs t(K) seconds for the whole batch (drafting, the verify
forward over K+1 tokens, acceptance, commit: tau / (K c_draft + c_verify(K+1)) of
../shared/DESIGN.md with the denominator measured as one number). t(K) is a cost table measured
once per (device kind, target, drafter, batch B, capacity bucket, greedy or not) by
`calibrate`, and cached as JSON under $XDG_CACHE_HOME/spec_jax/governor (default
~/.cache/spec_jax/governor). It times the very executable generate() then runs (compiled once,
shared): decode(num_draft="auto") with K forced through the cost vector, two lengths per K,
differenced so the prefill and per-call work cancel (measure_round_costs). A row b with per-token
acceptance alpha_b emits tau_b(K) = 1 + alpha_b + ... + alpha_b^K tokens in expectation (the
i.i.d. model). Every round the governor takes

    K* = argmax_K  sum_{b active} tau_b(K) / t(K)

(ties to the smaller K), i.e. the most expected tokens per second for the batch; K = 0 is plain
decoding (tau = 1 per row), so where drafting costs more than it brings (large B, poor drafts)
it decodes plainly. Per-row gating: a row whose smoothed alpha_b < gate_alpha gets draft
length 0 that round (its drafts are masked; it contributes tau = 1). Note that in this engine
every row pays the batch's [B, K+1] verify anyway, so gating saves no compute: it only stops
proposing drafts that are almost surely rejected (the default threshold is low).

Live acceptance. Per row, exponentially smoothed counts of accepted drafts a and judged drafts
j (the accepted ones plus the first failure: a rejection, or a missing draft when an n-gram
finds fewer than K), started at a prior worth `prior_weight` judged drafts at `prior_alpha`:

    A_b <- smoothing * A_b + a_b,  J_b <- smoothing * J_b + j_b,  alpha_b = A_b / J_b

updated only in rounds where row b drafted (a K = 0 round or a gated row teaches nothing, and
the estimate stays). The first `warmup_rounds` loop iterations draft (the best K >= 1), so the
choice rests on live evidence and not only on the prior. Consequence: once plain rounds win
for the whole batch, the estimates stop moving and the governor stays plain (no probing: a
probe would cost a drafting round, and a DraftModel's catch-up, every time).

Drafters across plain rounds: K = 0 rounds never call propose; drafters whose state follows
the target (Medusa, EAGLE, EAGLE-3, MTP) still commit the verified token there (a feature
head's layer runs over one pair: part of the measured t(0)); a DraftModel skips them and
catches up in one chunked forward per 16 missed tokens when drafting resumes (Drafter.catch_up,
called before the switch; that cost is not in the table, which times steady K).

Lossless: K and the gating of round r depend only on rounds < r, and each round is an exact
speculative round for any K, so the output distribution is the target's (tests/test_governor.py).

    gov = sj.Governor(max_draft=8, ks=(0, 1, 2, 4), smoothing=0.8)
    out = sj.generate(target, prompts, drafter=drafter, num_draft="auto", governor=gov)
    out.stats.k_histogram        # {K: loop iterations that ran with K drafts}
    table = sj.calibrate(target, drafter, batch=16)   # cached; generate() does this itself
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import os
import pathlib
import time
import weakref
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.engine import DecodeState, LoopEnv, chain_round

DEFAULT_KS = (0, 1, 2, 4, 6, 8)
COST_MODEL_VERSION = 2          # bump when what a timed round contains changes
DEFAULT_CAPACITY = 256
OPTIONS = {
    "max_draft": "largest K the governor may choose (integer >= 1; default 8)",
    "ks": "candidate K values (integers >= 0; default {0,1,2,4,6,8} up to max_draft and the "
          "drafter's max_draft)",
    "smoothing": "per-round decay of the acceptance counts, in [0, 1) (default 0.8)",
    "prior_alpha": "per-token acceptance assumed before evidence, in [0, 1] (default 0.6)",
    "prior_weight": "judged drafts the prior is worth, > 0 (default 2)",
    "warmup_rounds": "first loop iterations that must draft (integer >= 0; default 2)",
    "gate_alpha": "rows with smoothed alpha below this get draft length 0, in [0, 1] "
                  "(default 0.05; 0 = never)",
    "costs": "a cost table {K: seconds per round} to use instead of calibrating",
    "schedule": "a fixed sequence of K, cycled (tests): overrides the choice",
}


def _is_int(x) -> bool:
  return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def _is_real(x) -> bool:
  return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(x, bool)


class Governor:
  """The knobs of num_draft="auto" (see the module docstring and OPTIONS). Hashable: a static
  argument of the jitted decode. Unknown options or bad values raise ValueError."""

  def __init__(self, **options):
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
      raise ValueError(f"unknown governor option(s) {unknown}; allowed: {', '.join(OPTIONS)}")
    max_draft = options.get("max_draft", 8)
    if not _is_int(max_draft) or max_draft < 1:
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
    if not _is_int(warm) or warm < 0:
      raise ValueError(f"Governor warmup_rounds must be an integer >= 0, got {warm!r}")
    self.warmup_rounds = int(warm)
    costs = options.get("costs")
    if costs is not None:
      if isinstance(costs, CostTable):
        costs = costs.as_mapping()
      if not isinstance(costs, dict) or not costs:
        raise ValueError(f"Governor costs must be a non-empty mapping {{K: seconds per round}} "
                         f"or a CostTable, got {costs!r}")
      bad = {k: v for k, v in costs.items()
             if not _is_int(k) or k < 0 or not _is_real(v) or not v > 0 or not math.isfinite(v)}
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
    if not vals or any(not _is_int(k) or k < 0 for k in vals):
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
    ok = _is_real(v) and math.isfinite(float(v))
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
            self.prior_weight, self.warmup_rounds, self.gate_alpha, self.costs)

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
            "schedule": self.schedule}

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
    """float32 [len(candidates)] per-round costs for decode: round_costs (an array aligned with
    candidates(drafter), or a CostTable), else the `costs` knob, else ones when a schedule
    decides. ValueError for a missing or misaligned table."""
    ks = self.candidates(drafter)
    if isinstance(round_costs, CostTable):
      round_costs = round_costs.costs_for(ks)
    if round_costs is not None:
      shape = np.shape(round_costs)
      if shape != (len(ks),):
        raise ValueError(f"round_costs must have one entry per candidate K {ks}: shape "
                         f"({len(ks)},), got {shape}")
      return jnp.asarray(round_costs, jnp.float32)
    if self.costs is not None:
      table = dict(self.costs)
      missing = [k for k in ks if k not in table]
      if missing:
        raise ValueError(f"Governor costs has no entry for K {missing} (candidates {ks})")
      return jnp.asarray([table[k] for k in ks], jnp.float32)
    if self.schedule is not None:
      return jnp.ones((len(ks),), jnp.float32)
    raise ValueError("num_draft='auto' needs a cost table: pass round_costs="
                     "sj.calibrate(...).round_costs to decode (generate calibrates itself), or "
                     "Governor(costs={K: seconds}), or a Governor(schedule=...)")

  def needs_calibration(self) -> bool:
    return self.costs is None and self.schedule is None

  def init_state(self, drafter, batch: int) -> "GovernorState":
    """The governor's initial carry: the prior for every row, an empty histogram."""
    return GovernorState(
        accepted=jnp.full((batch,), self.prior_alpha * self.prior_weight, jnp.float32),
        judged=jnp.full((batch,), self.prior_weight, jnp.float32),
        k_hist=jnp.zeros((len(self.candidates(drafter)),), jnp.int32),
        choice=jnp.zeros((), jnp.int32))


@flax.struct.dataclass
class GovernorState:
  """The governor's part of the loop carry (B rows, N candidate K values).

  accepted, judged: float32 [B] smoothed counts of accepted and judged drafts per row (prior
    included); alpha = accepted / judged.
  k_hist: int32 [N] loop iterations that ran with each candidate K.
  choice: int32 scalar, the index (into the candidates) of the next round's K.
  """
  accepted: jax.Array
  judged: jax.Array
  k_hist: jax.Array
  choice: jax.Array


def resolve(governor, drafter) -> Governor:
  """The Governor for num_draft="auto" (None = defaults), checked against the drafter before
  anything compiles."""
  if drafter is None:
    raise ValueError("num_draft='auto' needs a drafter: the governor chooses how many of its "
                     "drafts to verify (pass drafter=..., or an integer num_draft without one)")
  from spec_jax.drafters.base import Drafter
  if not isinstance(drafter, Drafter):
    raise ValueError(f"drafter must be a spec_jax.drafters drafter, got "
                     f"{type(drafter).__name__}")
  if governor is None:
    governor = Governor()
  elif isinstance(governor, dict):
    governor = Governor(**governor)
  elif not isinstance(governor, Governor):
    raise ValueError(f"governor must be a spec_jax.Governor, a dict of its options or None, "
                     f"got {type(governor).__name__}")
  governor.candidates(drafter)                 # ValueError: K above the drafter's max_draft
  return governor


# ----------------------------------------------------------------------------- the choice

def row_alpha(gs: GovernorState):
  """float32 [B] smoothed per-token acceptance of each row."""
  return jnp.clip(gs.accepted / jnp.maximum(gs.judged, 1e-6), 0.0, 1.0)


def expected_tokens(alpha, k: int):
  """tau = 1 + alpha + ... + alpha^K (elementwise; K static)."""
  tau, power = jnp.ones_like(alpha), jnp.ones_like(alpha)
  for _ in range(k):
    power = power * alpha
    tau = tau + power
  return tau


def choose(gov: Governor, ks: tuple, gs: GovernorState, costs, active, iteration):
  """-> (index into ks of this round's K, draft_rows bool [B]): the K with the most expected
  tokens per second for the active rows (module docstring); during warm-up K = 0 is excluded
  when some K >= 1 could beat it at all (with every draft accepted, (K+1) / t(K) > 1 / t(0));
  a schedule overrides the choice."""
  alpha = row_alpha(gs)
  draft_rows = alpha >= gov.gate_alpha
  act = active.astype(jnp.float32)
  if gov.schedule is not None:
    order = jnp.asarray([ks.index(k) for k in gov.schedule], jnp.int32)
    return order[iteration % len(gov.schedule)], draft_rows
  scores = []
  for i, k in enumerate(ks):
    tau = jnp.where(draft_rows, expected_tokens(alpha, k), 1.0) if k else jnp.ones_like(alpha)
    scores.append(jnp.sum(act * tau) / costs[i])
  if 0 in ks and gov.warmup_rounds and any(k > 0 for k in ks):
    i0 = ks.index(0)
    could_win = jnp.any(jnp.asarray([(k + 1) * costs[i0] > costs[i]
                                     for i, k in enumerate(ks) if k > 0]))
    warm = (iteration < gov.warmup_rounds) & could_win
    scores[i0] = jnp.where(warm, -jnp.inf, scores[i0])
  return jnp.argmax(jnp.stack(scores)).astype(jnp.int32), draft_rows


def observe(gov: Governor, gs: GovernorState, before: DecodeState, after: DecodeState, k: int,
            draft_rows) -> GovernorState:
  """The acceptance counts after a round of K drafts (rows that drafted only)."""
  if k == 0:
    return gs
  seen = ~before.done
  if draft_rows is not None:
    seen = seen & draft_rows
  a = (after.accepted - before.accepted).astype(jnp.float32)
  j = a + (a < k).astype(jnp.float32)
  lam = gov.smoothing
  return gs.replace(accepted=jnp.where(seen, lam * gs.accepted + a, gs.accepted),
                    judged=jnp.where(seen, lam * gs.judged + j, gs.judged))


def governed_loop(env: LoopEnv, gov: Governor, costs, state: DecodeState,
                  until=None) -> DecodeState:
  """The loop of num_draft="auto" (what `decode` runs instead of its fixed-K while_loop).

  Every round runs the K the governor chose after the previous round (GovernorState.choice).
  The rounds of each candidate K form their own inner `lax.while_loop` (body: chain_round at
  that K, then the statistics and the next choice), which runs while the choice stays its K;
  an outer `lax.while_loop` visits the inner loops in turn (K >= 1 first, K = 0 last) until
  every row is done. Each round pays only for its K. (A `lax.switch` over per-K rounds in one
  loop would be the obvious form, but XLA:CPU then copies the KV caches through the
  conditional every round: +50% per round at B = 16 for stories260K. While loops keep their
  carry in place.) A drafter that skipped plain rounds catches up once per outer iteration,
  before the drafting loops (Drafter.catch_up; nothing to do when it is in sync).

  until: optional int, stop after this many rounds (tests)."""
  from spec_jax.drafters.base import Drafter
  ks = gov.candidates(env.drafter)
  gate = gov.gate_alpha > 0
  env = env._replace(rolled=True)        # one draft-step body per K: a smaller program
  lazy = type(env.drafter).catch_up is not Drafter.catch_up
  drafts = jnp.asarray([k > 0 for k in ks])

  def running(st):
    go = ~jnp.all(st.done)
    return go if until is None else go & (st.iterations < until)

  def body(i, k):
    def run(st):
      rows = (row_alpha(st.governor) >= gov.gate_alpha) if (gate and k) else None
      new = chain_round(env, st, k=k, draft_rows=rows)
      gs = observe(gov, st.governor, st, new, k, rows)
      gs = gs.replace(k_hist=gs.k_hist.at[i].add(1))
      choice, _ = choose(gov, ks, gs, costs, ~new.done, new.iterations)
      return new.replace(governor=gs.replace(choice=choice))
    return run

  def outer(st):
    if lazy:      # before a plain round the drafter is told lengths 0: nothing to do
      st = st.replace(drafter_state=env.drafter.catch_up(
          env.drafter_params, st.drafter_state, st.tokens,
          jnp.where(drafts[st.governor.choice], st.lengths, 0)))
    for i in sorted(range(len(ks)), key=lambda j: ks[j] == 0):
      st = jax.lax.while_loop(lambda s, i=i: running(s) & (s.governor.choice == i),
                              body(i, ks[i]), st)
    return st

  gs = state.governor
  choice, _ = choose(gov, ks, gs, costs, ~state.done, state.iterations)
  state = state.replace(governor=gs.replace(choice=choice))
  return jax.lax.while_loop(running, outer, state)


def k_rounds(gov: Governor, drafter, gs: GovernorState):
  """int32 [max(ks)+1]: loop iterations per K (index = K) from the governor's histogram."""
  ks = gov.candidates(drafter)
  return jnp.zeros((max(ks) + 1,), jnp.int32).at[jnp.asarray(ks)].set(gs.k_hist)


# ----------------------------------------------------------------------------- cost table

@dataclasses.dataclass(frozen=True)
class CostTable:
  """Measured seconds per round at each candidate K for one (device, target, drafter, B,
  capacity, greedy).

  ks: tuple of K; seconds: tuple, seconds per round (median over repeats); spread_pct: tuple,
  (max-min)/median of the repeats; key: what it was measured for (the fingerprint's fields);
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

  @property
  def round_costs(self) -> np.ndarray:
    """float32 [len(ks)] for decode(round_costs=...)."""
    return np.asarray(self.seconds, np.float32)

  def as_mapping(self) -> dict:
    return dict(zip(self.ks, self.seconds))

  def costs_for(self, ks) -> np.ndarray:
    table = self.as_mapping()
    missing = [k for k in ks if k not in table]
    if missing:
      raise ValueError(f"this cost table has no entry for K {missing} (it has {self.ks})")
    return np.asarray([table[k] for k in ks], np.float32)

  def relative(self) -> dict:
    """{K: t(K) / t(0)} (t(0) = a plain round), or seconds when 0 was not measured."""
    table = self.as_mapping()
    base = table.get(0)
    return {k: v / base if base else v for k, v in table.items()}

  def as_dict(self) -> dict:
    return {"ks": list(self.ks), "seconds": list(self.seconds),
            "spread_pct": list(self.spread_pct), "relative": {str(k): v for k, v in
                                                               self.relative().items()},
            "key": self.key, "fingerprint": self.fingerprint, "from_cache": self.from_cache,
            "measure_seconds": self.measure_seconds, "path": self.path}


def cache_dir() -> pathlib.Path:
  """$XDG_CACHE_HOME/spec_jax/governor, or ~/.cache/spec_jax/governor."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "spec_jax" / "governor"


_CHECKSUMS: dict = {}
_TABLES: dict = {}
_CHECKSUM_JIT = None
_HASH_ALL_BYTES = 1 << 26          # leaves up to 64 MiB on the host are hashed byte for byte


def _device_sums(leaves) -> np.ndarray:
  """Per-leaf (sum, position-weighted sum, sum of |x|) computed on the device (one jit)."""
  global _CHECKSUM_JIT
  if _CHECKSUM_JIT is None:
    def stats(xs):
      out = []
      for x in xs:
        x = jnp.ravel(x).astype(jnp.float32)
        w = (jnp.arange(x.shape[0], dtype=jnp.int32) % 1021 + 1).astype(jnp.float32)
        out.append(jnp.stack([jnp.sum(x), jnp.sum(x * w), jnp.sum(jnp.abs(x))]))
      return out
    _CHECKSUM_JIT = jax.jit(stats)
  return np.asarray(jnp.stack(_CHECKSUM_JIT(leaves)), np.float32)


def params_checksum(tree) -> str:
  """A short digest of a param pytree's structure and values. Leaves on the host (CPU) are
  hashed byte for byte up to 64 MiB, larger ones by a strided sample plus their sum; leaves on
  an accelerator by sums computed there (no copy to the host). Memoised per set of leaf
  objects."""
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]
  if not leaves:
    return "none"
  ids = tuple(id(x) for x in leaves)
  hit = _CHECKSUMS.get(ids)
  if hit is not None and all(r() is x for r, x in zip(hit[0], leaves)):
    return hit[1]
  h = hashlib.sha256()
  h.update(repr([(tuple(x.shape), str(x.dtype)) for x in leaves]).encode())
  h.update(repr(jax.tree.structure(tree)).encode())
  on_host = all(not isinstance(x, jax.Array) or
                all(d.platform == "cpu" for d in x.devices()) for x in leaves)
  if on_host:
    for x in leaves:
      a = np.asarray(x)
      if a.nbytes <= _HASH_ALL_BYTES:
        h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes())
      else:
        flat = a.reshape(-1)
        h.update(np.ascontiguousarray(flat[::max(1, flat.size // (1 << 20))]).tobytes())
        h.update(np.float64(flat.astype(np.float64).sum()).tobytes())
  else:
    h.update(_device_sums(leaves).tobytes())
  digest = h.hexdigest()[:32]
  try:
    _CHECKSUMS[ids] = ([weakref.ref(x) for x in leaves], digest)
  except TypeError:                             # leaves without weak references: no memo
    pass
  return digest


def fingerprint(target, drafter, batch: int, capacity: int, greedy: bool, ks) -> tuple:
  """-> (hex digest, key dict): what a cost table depends on — device kind, jax version, XLA
  flags, target config + weights checksum, drafter static key + params checksum, B, capacity
  bucket, greedy, the candidate K set and the cost-model version."""
  dev = jax.devices()[0]
  import jaxlib
  key = {
      "version": COST_MODEL_VERSION,
      "platform": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
      "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", ""),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "target_config": repr(target.config), "target_weights": params_checksum(target.params),
      "drafter": repr(drafter._static_key()), "drafter_params": params_checksum(drafter.params),
      "batch": int(batch), "capacity": int(capacity), "greedy": bool(greedy),
      "ks": [int(k) for k in ks]}
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
  return digest, key


def _text_like_prompts(batch: int, length: int, vocab: int) -> np.ndarray:
  """[B, length] int32 tokens repeating a random 24-token phrase (n-grams match)."""
  base = np.random.default_rng(0).integers(3, max(vocab, 4), size=(batch, 24))
  reps = -(-length // 24)
  return np.tile(base, (1, reps))[:, :length].astype(np.int32)


CALIBRATION_TOKENS = 96          # new tokens of the longer timed decode (the shorter: half)


def measure_round_costs(target, drafter, batch: int, capacity: int, greedy: bool, ks,
                        repeats: int = 3, *, governor: Governor, prompt_len: int = 16,
                        stop_count: int = 0, mesh=None) -> dict:
  """Seconds per loop iteration at each candidate K, timed on the compiled decode that
  generate(num_draft="auto") runs for these shapes (the same executable: calibrating compiles
  nothing extra). K is forced through the cost vector (cost 1 for it, 1e30 for the others).
  Per K, one call of n new tokens (text-like prompts of prompt_len tokens; stop tokens that
  never occur, so every row runs to its limit); the smallest K >= 1, k1, also runs n/2 tokens,
  and the difference of its two lengths gives the per-call part f (prefill, dispatch). Then
  t(K) = (min over repeats of the call's seconds - f) / its loop iterations; for K = 0 the
  governor's warm-up rounds, if it ran any (they are forced to k1), are taken out as well. All calls
  run round-robin (spec_jax.bench.timing.interleaved_rounds), `repeats` times; a shared machine
  only ever adds time, so the fastest call is the least disturbed one. (Differencing two
  lengths for every K was tried: with few rounds at large K, a loaded machine's noise swamped
  the difference.)
  -> {K: {'per_iter_s', 'spread_pct', 'samples'}}."""
  from spec_jax import engine, global_batch, sharding as sharding_lib
  from spec_jax.bench.timing import interleaved_rounds, summarize
  from spec_jax.sampling import Sampling
  kmax = max(ks)
  p = max(1, min(int(prompt_len), capacity - kmax - 4))
  n_long = max(2, min(capacity - p - kmax - 1, CALIBRATION_TOKENS))
  n_short = max(1, n_long // 2)
  prompts = _text_like_prompts(batch, p, target.config.vocab_size)
  lens = np.full((batch,), p, np.int32)
  sampling = Sampling(temperature=0.0 if greedy else 1.0).as_arrays(batch)
  stop = np.full((stop_count,), -1, np.int32)           # token ids are >= 0: never stops
  key = jax.random.key(0)

  positive = [i for i, k in enumerate(ks) if k > 0]
  i1 = positive[0] if positive else 0                  # k1: the smallest K >= 1

  def run(i, n):
    costs = np.full((len(ks),), 1e30, np.float32)
    costs[i1] = 1e29                                     # the warm-up's choice when K = 0
    costs[i] = 1.0
    compiled, args, kwargs = engine.compiled_decode_call(
        target, drafter, prompts, lens, key, max_new_tokens=n, sampling=sampling, stop=stop,
        capacity=capacity, greedy=greedy, mesh=mesh, num_draft="auto", governor=governor,
        round_costs=costs)
    t0 = time.perf_counter()
    packed = compiled(*args, **kwargs)
    jax.block_until_ready(packed)
    seconds = time.perf_counter() - t0
    res = compiled.unpack(global_batch.to_host(packed, sharding_lib.spans_processes(mesh)))
    return (seconds, int(res.iterations),
            int(np.asarray(res.k_rounds)[ks[i1]]) if i != i1 else 0)

  runs = {(i, n_long): (lambda i=i: run(i, n_long)) for i in range(len(ks))}
  runs[(i1, n_short)] = lambda: run(i1, n_short)
  for r in runs.values():                                # compile (once) and warm
    r()
  results = interleaved_rounds(runs, repeats)
  (ts, its, _), (tl, itl, _) = (min(results[(i1, n)]) for n in (n_short, n_long))
  per1 = max(tl - ts, 0.0) / max(itl - its, 1)
  fixed = min(max(ts - its * per1, 0.0), ts)            # the per-call part f
  per = {i: [max(t - fixed, 1e-9) / it for t, it, _ in results[(i, n_long)]] for i in positive}
  out = {}
  for i, k in enumerate(ks):
    if k == 0:          # minus the warm-up rounds at k1, if the governor ran any
      t1 = min(per[i1]) if positive else 0.0
      samples = [max(t - fixed - w * t1, 1e-9) / max(it - w, 1)
                 for t, it, w in results[(i, n_long)]]
    else:
      samples = per[i]
    out[k] = {"per_iter_s": min(samples), "spread_pct": summarize(samples)["spread_pct"],
              "samples": samples, "per_call_s": fixed}
  return out


def calibrate(target, drafter, batch: int, *, capacity: Optional[int] = None,
              greedy: bool = True, governor: Optional[Governor] = None, repeats: int = 3,
              cache: bool = True, refresh: bool = False, prompt_len: int = 16,
              stop_count: Optional[int] = None, mesh=None) -> CostTable:
  """The governor's cost table for (this device, target, drafter, batch, capacity bucket,
  greedy): seconds per round at each candidate K, timed once and cached as JSON under
  cache_dir() (written atomically; keyed by `fingerprint`); a second call reads it (or this
  process's memory) instead of measuring. refresh=True measures again.

  Args:
    target: a Model; drafter: a Drafter; batch: B.
    capacity: the KV-cache capacity S the generation runs with (generate() uses the prompt +
      max_new_tokens + K + 1 rounded up to 64; default 256).
    greedy: time the greedy round (temperature 0: argmax verify) or the sampling round.
    governor: its candidate K set (default Governor()).
    repeats: timed rounds per K (round-robin).
    prompt_len, stop_count, mesh: the padded prompt length, the number of stop tokens and the
      mesh of the generate() call to come, so that the timed executable is the one it runs
      (generate passes them; only the compile is shared, the table does not depend on them).
  """
  t0 = time.perf_counter()
  gov = resolve(governor, drafter)
  ks = gov.candidates(drafter)
  drafter.check_compatible(target)
  if not _is_int(batch) or batch < 1:
    raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
  capacity = DEFAULT_CAPACITY if capacity is None else capacity
  if not _is_int(capacity) or capacity < max(ks) + 4:
    raise ValueError(f"capacity must be an integer >= max K + 4 = {max(ks) + 4}, got "
                     f"{capacity!r}")
  if not _is_int(repeats) or repeats < 1:
    raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
  digest, key = fingerprint(target, drafter, batch, capacity, greedy, ks)
  path = cache_dir() / f"{digest}.json"
  if not refresh:
    table = _TABLES.get(digest)
    if table is None and cache and path.is_file():
      try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
          table = CostTable(ks=tuple(data["ks"]), seconds=tuple(data["seconds"]),
                            spread_pct=tuple(data["spread_pct"]), key=key, fingerprint=digest,
                            path=str(path))
      except (OSError, ValueError, KeyError, TypeError):
        table = None                            # unreadable: measure again
    if table is not None:
      _TABLES[digest] = table
      return dataclasses.replace(table, from_cache=True,
                                 measure_seconds=time.perf_counter() - t0)
  if stop_count is None:
    stop_count = len(target.config.eos_token_ids)
  timed = measure_round_costs(target, drafter, batch, capacity, greedy, ks, repeats,
                              governor=gov, prompt_len=prompt_len, stop_count=stop_count,
                              mesh=mesh)
  table = CostTable(ks=tuple(ks), seconds=tuple(timed[k]["per_iter_s"] for k in ks),
                    spread_pct=tuple(timed[k]["spread_pct"] for k in ks), key=key,
                    fingerprint=digest, path=str(path) if cache else None)
  table = dataclasses.replace(table, measure_seconds=time.perf_counter() - t0)
  if cache:
    from spec_jax.bench.results import atomic_write_json
    atomic_write_json(path, dict(table.as_dict(), created=time.time()))
  _TABLES[digest] = table
  return table


def round_costs_for(gov: Governor, target, drafter, batch: int, capacity: int, greedy: bool,
                    max_new_tokens: int, prompt_len: int = 16, stop_count: int = 0, mesh=None):
  """What generate() passes to decode: None when the governor has its own table or schedule;
  ones when the loop cannot run (max_new_tokens == 1: the prefill's token is the only one);
  else calibrate(...).round_costs (measured once on the executable generate runs, then
  cached)."""
  if not gov.needs_calibration():
    return None
  ks = gov.candidates(drafter)
  if max_new_tokens <= 1:
    return np.ones((len(ks),), np.float32)
  return calibrate(target, drafter, batch, capacity=capacity, greedy=greedy, governor=gov,
                   prompt_len=prompt_len, stop_count=stop_count, mesh=mesh).costs_for(ks)


def clear_memory() -> None:
  """Drops this process's cost tables, checksums and compiled timing loops (not the disk
  cache)."""
  _TABLES.clear()
  _CHECKSUMS.clear()
