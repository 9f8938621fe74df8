"""Governed (num_draft="auto"): every round the governor picks K among its candidates (0 = a
plain step) from a cost table and the live acceptance. The choice and its cost model are pure
functions of arrays in spec_jax.governor; this is the loop that runs them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding.rounds import chain_round
from spec_jax.decoding.state import DecodeState, LoopEnv
from spec_jax.decoding.strategies.base import Strategy
from spec_jax.drafters.base import Drafter
from spec_jax.governor import (PRIOR_ROWS, Governor, GovernorState, choose, observe,
                               pooled_acceptance, row_alpha)
from spec_jax.governor import row_acceptance as governor_row_acceptance


def governed_loop(env: LoopEnv, gov: Governor, costs, state: DecodeState,
                  until=None) -> DecodeState:
  """The loop of num_draft="auto" (Governed.run; a chain runs one fixed-K while_loop instead).

  costs: float32 [len(candidates)] seconds per round at each candidate K; state.strategy: the
  GovernorState.

  Every round runs the K the governor chose after the previous round (GovernorState.choice).
  The rounds of each candidate K form their own inner `lax.while_loop` (body: chain_round at
  that K, then the statistics and the next choice), which runs while the choice stays its K;
  an outer `lax.while_loop` visits the inner loops in turn (K >= 1 first, K = 0 last) until
  every row is done. Each round pays only for its K. (A `lax.switch` over per-K rounds in one
  loop would be the obvious form, but XLA:CPU then copies the KV caches through the
  conditional every round: +50% per round at B = 16 for stories260K. While loops keep their
  carry in place.)

  Per-row budgets: in a round of K drafts row b verifies min(K, remaining_b - 1) drafts (a
  draft past the row's token limit could never be emitted), or none when its first-draft
  acceptance is below gate_alpha. (The verify is [B, K+1] whatever the budgets: a budget below
  K saves no compute, it keeps the acceptance estimates honest.)

  Plain is final: once the governor picks K = 0 after its warm-up, every remaining round is a
  plain step (the estimates no longer move in plain rounds, so the choice would not change),
  and these steps skip the drafter's commit and the hidden states it reads: a plain round
  costs what plain decoding costs. With a `schedule` (tests) K = 0 rounds keep the drafter in
  sync instead, and drafting resumes when the schedule says; a drafter that skipped plain
  rounds catches up once per outer iteration, before the drafting loops (Drafter.catch_up;
  nothing to do when it is in sync).

  until: optional int, stop after this many rounds (tests)."""
  ks = gov.candidates(env.drafter)
  gate = gov.gate_alpha > 0
  final_plain = gov.schedule is None
  env = env._replace(rolled=True)        # one draft-step body per K: a smaller program
  plain_env = env._replace(layers=()) if final_plain else env
  lazy = type(env.drafter).catch_up is not Drafter.catch_up
  drafts = jnp.asarray([k > 0 for k in ks])

  def running(st):
    go = ~jnp.all(st.done)
    return go if until is None else go & (st.iterations < until)

  def remaining(st):
    return env.limit - st.lengths

  def body(i, k):
    def run(st):
      rows = None
      if k:
        rows = jnp.clip(remaining(st) - 1, 0, k).astype(jnp.int32)
        if gate:
          rows = jnp.where(row_alpha(st.strategy) >= gov.gate_alpha, rows, 0)
      if k or not final_plain:
        new = chain_round(env, st, k=k, draft_rows=rows)
      else:
        new = chain_round(plain_env, st, k=0, sync_drafter=False)
      gs = observe(gov, st.strategy, ~st.done, new.counts.accepted - st.counts.accepted, k,
                   rows)
      gs = gs.replace(k_hist=gs.k_hist.at[i].add(1))
      if k or not final_plain:
        choice, _ = choose(gov, ks, gs, costs, ~new.done, new.iterations, remaining(new))
        gs = gs.replace(choice=choice)
      return new.replace(strategy=gs)
    return run

  def outer(st):
    if lazy:      # before a plain round the drafter is told lengths 0: nothing to do
      st = st.replace(drafter_state=env.drafter.catch_up(
          env.drafter_params, st.drafter_state, st.tokens,
          jnp.where(drafts[st.strategy.choice], st.lengths, 0)))
    for i in sorted(range(len(ks)), key=lambda j: ks[j] == 0):
      st = jax.lax.while_loop(lambda s, i=i: running(s) & (s.strategy.choice == i),
                              body(i, ks[i]), st)
    return st

  gs = state.strategy
  choice, _ = choose(gov, ks, gs, costs, ~state.done, state.iterations, remaining(state))
  state = state.replace(strategy=gs.replace(choice=choice))
  return jax.lax.while_loop(running, outer, state)


def resolve_governor(governor, drafter) -> Governor:
  """The Governor for num_draft="auto" (None = defaults, a dict = its options), checked against
  the drafter before anything compiles."""
  if drafter is None:
    raise ValueError("num_draft='auto' needs a drafter: the governor chooses how many of its "
                     "drafts to verify (pass drafter=..., or an integer num_draft without one)")
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


@dataclasses.dataclass(frozen=True)
class Governed(Strategy):
  """num_draft="auto": every round the governor picks K among its candidates (0 = a plain
  step) from the cost table (LoopEnv.round_costs) and the live acceptance; the drafter may skip
  the plain rounds and catch up (lazy).

  governor: a sj.Governor, a dict of its options, or None (the defaults); candidates: the
  candidate K for the drafter, set by bind."""
  governor: Any = None
  candidates: tuple = ()
  lazy_drafter = True
  width = property(lambda self: max(self.candidates))
  label = property(lambda self: f"K=auto(<={self.width})")

  def bind(self, drafter, target) -> "Governed":
    gov = resolve_governor(self.governor, drafter)
    return Governed(gov, gov.candidates(drafter))

  def round_costs(self, drafter, round_costs):
    return self.governor.cost_array(drafter, round_costs)        # ValueError on a bad table

  def acceptance_prior(self, prior):
    """float32 [Q, W] (Q = governor PRIOR_ROWS, W = the largest candidate K): generate()'s
    acceptance_prior as decode takes it, or -1s for None, so that calls with and without a
    prior share one executable. The prior is either one sequence of per-position acceptances
    in [0, 1] (an earlier output's stats.position_acceptance, pooled over its rows: repeated
    Q times) or a sequence of such rows (stats.row_acceptance, the spread of the rows: sorted
    by their expected tokens and resampled to Q rows at evenly spaced quantiles, the best and
    the worst kept); a row shorter than W repeats its last entry, a longer one is cut.
    ValueError for anything else."""
    width, q = self.width, PRIOR_ROWS
    if prior is None:
      return np.full((q, width), -1.0, np.float32)
    try:
      values = np.asarray(prior, np.float64)
    except (TypeError, ValueError):
      values = None
    if (values is None or values.ndim not in (1, 2) or values.size == 0
        or not np.all(np.isfinite(values)) or np.any((values < 0) | (values > 1))):
      raise ValueError(f"acceptance_prior must be a non-empty sequence of per-position "
                       f"acceptances in [0, 1] (an earlier output's stats.position_acceptance)"
                       f" or a sequence of such rows (stats.row_acceptance), got {prior!r}")
    rows = values[None, :] if values.ndim == 1 else values
    rows = np.concatenate([rows, np.repeat(rows[:, -1:], max(width - rows.shape[1], 0), 1)],
                          axis=1)[:, :width]
    tau = np.sum(np.cumprod(rows, axis=1), axis=1)          # expected tokens at K = W, less 1
    rows = rows[np.argsort(tau, kind="stable")]
    pick = np.rint(np.linspace(0, rows.shape[0] - 1, q)).astype(int)
    return rows[pick].astype(np.float32)

  @property
  def calibration_ks(self):
    return self.candidates if self.governor.needs_calibration() else None

  def init(self, env, state) -> GovernorState:
    return self.governor.init_state(env.drafter, state.tokens.shape[0], env.acceptance_prior)

  def init_drafter(self, env, state, init):
    """Skips the drafter's prefill work (DFlash's context K/V over the prompt, an EAGLE head's
    layer over it) when the first round is plain and plain is final: the drafter never runs
    in this call (an acceptance_prior where drafting cannot pay). Its state is then zeros of
    the same shapes, never read. The first choice is made here as governed_loop makes it."""
    gov = self.governor
    if env.round_costs is None or gov.schedule is not None or 0 not in self.candidates:
      return init()
    gs = self.init(env, state)
    choice, _ = choose(gov, self.candidates, gs, env.round_costs, ~state.done,
                       state.iterations, env.limit - state.lengths)
    shapes = jax.eval_shape(init)
    return jax.lax.cond(choice == self.candidates.index(0),
                        lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
                        init)

  def position_acceptance(self, final):
    """The governor's estimate pooled over the rows (governor.pooled_acceptance)."""
    return pooled_acceptance(final.strategy)

  def row_acceptance(self, final):
    """float32 [B, W]: each row's acceptance over the call (governor.row_acceptance: its
    undecayed counts shrunk toward the pooled rate by the governor's pool_weight)."""
    return governor_row_acceptance(final.strategy, self.governor.pool_weight)

  def run(self, env, state):
    return governed_loop(env, self.governor, env.round_costs, state)

  def k_rounds(self, final):
    """int32 [max(candidates)+1]: loop iterations per K (index = K) from the governor's
    histogram."""
    return jnp.zeros((self.width + 1,), jnp.int32).at[jnp.asarray(self.candidates)].set(
        final.strategy.k_hist)

  def stats_fields(self, greedy: bool, drafter) -> dict:
    return {"num_draft": self.width, "auto": True, "strategy": self.label}
