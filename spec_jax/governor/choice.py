"""The governor's per-round choice of K and its live acceptance estimates (the package
docstring has the cost model)."""

from __future__ import annotations

import jax.numpy as jnp

from spec_jax.governor.options import Governor, GovernorState


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


def observe(gov: Governor, gs: GovernorState, active, accepted, k: int,
            draft_rows) -> GovernorState:
  """The acceptance counts after a round of K drafts (rows that drafted only).

  active: bool [B] the rows running at the round's start; accepted: int32 [B] the drafts each
  row accepted in the round; draft_rows: bool [B] the rows allowed to draft, or None (all)."""
  if k == 0:
    return gs
  seen = active
  if draft_rows is not None:
    seen = seen & draft_rows
  a = accepted.astype(jnp.float32)
  j = a + (a < k).astype(jnp.float32)
  lam = gov.smoothing
  return gs.replace(accepted=jnp.where(seen, lam * gs.accepted + a, gs.accepted),
                    judged=jnp.where(seen, lam * gs.judged + j, gs.judged))
