"""The governor's per-round choice of K and its live acceptance estimates (the package
docstring has the cost model)."""

from __future__ import annotations

import jax.numpy as jnp

from spec_jax.governor.options import Governor, GovernorState


def position_alpha(gs: GovernorState):
  """float32 [B, W]: each row's smoothed acceptance of draft position j given that positions
  < j were accepted (W = the largest candidate K)."""
  return jnp.clip(gs.accepted / jnp.maximum(gs.judged, 1e-6), 0.0, 1.0)


def row_alpha(gs: GovernorState):
  """float32 [B]: each row's smoothed acceptance of its first draft (what gating reads)."""
  return position_alpha(gs)[:, 0]


def expected_tokens(alpha, k: int):
  """Expected tokens a round with K drafts emits (K static).

  alpha: [..., W] per-position conditional acceptance (W >= K): tau = 1 + a_0 + a_0 a_1 + ...
  + a_0 ... a_{K-1} (the survival of each draft, plus the corrected or bonus token); or a
  scalar / [...] array of one per-token rate (the i.i.d. model): 1 + a + ... + a^K."""
  alpha = jnp.asarray(alpha, jnp.float32)
  per_position = alpha.ndim >= 2
  tau = jnp.ones(alpha.shape[:-1] if per_position else alpha.shape, jnp.float32)
  survive = jnp.ones_like(tau)
  for j in range(k):
    survive = survive * (alpha[..., j] if per_position else alpha)
    tau = tau + survive
  return tau


def batch_seconds(gov: Governor, tau, cost, active, remaining):
  """Predicted seconds for the batch at one K (lower is better; the module docstring).

  tau: float32 [B] each row's expected tokens per round at this K; cost: seconds per round;
  active: bool [B]; remaining: float32 [B] tokens each row still needs.
  objective "slowest": the rounds the slowest active row needs, max_b remaining_b / tau_b,
  times the round's cost (the loop runs until its last row is done); "mean": the batch's
  tokens per second inverted, cost / sum_b tau_b (the expected throughput of one round)."""
  if gov.objective == "slowest":
    rounds = jnp.max(jnp.where(active, remaining / tau, 0.0))
    return cost * rounds
  return cost / jnp.maximum(jnp.sum(jnp.where(active, tau, 0.0)), 1e-6)


def choose(gov: Governor, ks: tuple, gs: GovernorState, costs, active, iteration,
           remaining=None):
  """-> (index into ks of this round's K, draft_rows bool [B]): the K whose predicted time for
  the batch is least (`batch_seconds`; ties to the smaller K); during warm-up K = 0 is excluded
  when some K >= 1 could beat it at all (with every draft accepted, (K+1) / t(K) > 1 / t(0));
  a schedule overrides the choice. remaining: int32 [B] tokens each row may still emit (None:
  the same for every row)."""
  alpha = position_alpha(gs)
  draft_rows = alpha[:, 0] >= gov.gate_alpha
  if remaining is None:
    remaining = jnp.ones(active.shape, jnp.float32)
  remaining = jnp.maximum(jnp.asarray(remaining, jnp.float32), 1.0)
  if gov.schedule is not None:
    order = jnp.asarray([ks.index(k) for k in gov.schedule], jnp.int32)
    return order[iteration % len(gov.schedule)], draft_rows
  seconds = []
  for i, k in enumerate(ks):
    tau = jnp.where(draft_rows, expected_tokens(alpha, k), 1.0) if k else jnp.ones(
        active.shape, jnp.float32)
    seconds.append(batch_seconds(gov, tau, costs[i], active, remaining))
  if 0 in ks and gov.warmup_rounds and any(k > 0 for k in ks):
    i0 = ks.index(0)
    could_win = jnp.any(jnp.asarray([(k + 1) * costs[i0] > costs[i]
                                     for i, k in enumerate(ks) if k > 0]))
    warm = (iteration < gov.warmup_rounds) & could_win
    seconds[i0] = jnp.where(warm, jnp.inf, seconds[i0])
  return jnp.argmin(jnp.stack(seconds)).astype(jnp.int32), draft_rows


def observe(gov: Governor, gs: GovernorState, active, accepted, k: int,
            draft_rows) -> GovernorState:
  """The per-position acceptance counts after a round of K drafts (rows that drafted only).

  Draft position j of row b was judged when every earlier draft was accepted (j <= a_b, j <
  K): accepted if j < a_b, else the first failure (a rejection, or a missing draft when an
  n-gram finds fewer than K). Only judged positions decay and count:
  A_bj <- smoothing * A_bj + accepted_bj, J_bj <- smoothing * J_bj + 1.

  active: bool [B] the rows running at the round's start; accepted: int32 [B] the drafts each
  row accepted in the round; draft_rows: bool [B] the rows allowed to draft (or int32 [B]
  each row's budget), or None (all)."""
  if k == 0:
    return gs
  w = gs.accepted.shape[1]
  budget = jnp.full(active.shape, k, jnp.int32)
  if draft_rows is not None:
    budget = (jnp.where(draft_rows, k, 0) if draft_rows.dtype == jnp.bool_
              else jnp.minimum(draft_rows, k)).astype(jnp.int32)
  budget = jnp.where(active, budget, 0)
  a = accepted.astype(jnp.int32)[:, None]
  pos = jnp.arange(w, dtype=jnp.int32)[None, :]
  judged = (pos <= a) & (pos < budget[:, None])
  hit = (pos < a).astype(jnp.float32)
  lam = gov.smoothing
  return gs.replace(accepted=jnp.where(judged, lam * gs.accepted + hit, gs.accepted),
                    judged=jnp.where(judged, lam * gs.judged + 1.0, gs.judged))
