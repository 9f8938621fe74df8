"""The governor's per-round choice of K and its live acceptance estimates (the package
docstring has the cost model)."""

from __future__ import annotations

import functools

import jax
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


def token_variance(alpha, k: int):
  """Variance of the tokens a round with K drafts emits (K static), per-position alpha
  [..., W]: T = 1 + (drafts accepted before the first failure), P(T > j) = S_j = a_0 ... a_{j-1}
  (S_0 = 1), so E[T] = sum_j S_j and E[T^2] = sum_j (2j + 1) S_j, j = 0..K."""
  alpha = jnp.asarray(alpha, jnp.float32)
  survive = jnp.ones(alpha.shape[:-1], jnp.float32)
  mean, second = survive, survive
  for j in range(1, k + 1):
    survive = survive * alpha[..., j - 1]
    mean = mean + survive
    second = second + (2 * j + 1) * survive
  return jnp.maximum(second - mean * mean, 0.0)


def pooled_alpha(gov: Governor, gs: GovernorState, rows):
  """float32 [B, W]: each row's per-position acceptance shrunk toward the batch's pooled rate
  (empirical Bayes): (A_bj + w P_j) / (J_bj + w), P_j = sum_b A_bj / sum_b J_bj over `rows`
  (bool [B]: the active rows that draft), w = gov.pool_weight. A row's own counts dominate
  once it has been judged more than w times at a position; two rounds of one row do not make
  it hopeless (or certain)."""
  a = jnp.where(rows[:, None], gs.accepted, 0.0)
  j = jnp.where(rows[:, None], gs.judged, 0.0)
  pool = jnp.sum(a, axis=0) / jnp.maximum(jnp.sum(j, axis=0), 1e-6)
  w = gov.pool_weight
  return jnp.clip((gs.accepted + w * pool) / jnp.maximum(gs.judged + w, 1e-6), 0.0, 1.0)


# Points of the grid the expected maximum is integrated on (between the smallest mean - 6
# standard deviations and the largest mean + 6).
_GRID = 128


def expected_max_rounds(mean, std, active, weights=None):
  """E[max_b N_b] over the active rows, N_b independent and >= 0: lo + the integral over
  [lo, hi] of P(max > n) = 1 - prod_b F_b(n), where P(max > n) ~ 1 below lo and ~ 0 above hi;
  midpoint rule on a grid.

  mean, std: float32 [B] (N_b ~ Normal(mean_b, std_b^2)) or [B, Q] with weights [B, Q] (rows
  summing to 1): N_b a mixture, F_b(n) = sum_q w_bq Phi((n - mean_bq) / std_bq) (a row whose
  acceptance is one of Q profiles, `profile_weights`); active: bool [B] (no active row: 0)."""
  mean, std = jnp.asarray(mean, jnp.float32), jnp.maximum(jnp.asarray(std, jnp.float32), 1e-3)
  if mean.ndim == 1:
    mean, std = mean[:, None], std[:, None]
  if weights is None:
    weights = jnp.ones(mean.shape, jnp.float32) / mean.shape[1]
  act = active[:, None]
  # below lo some row is surely unfinished (all its components are); above hi every row is done
  lo = jnp.maximum(jnp.max(jnp.where(active, jnp.min(mean - 6.0 * std, axis=1), 0.0)), 0.0)
  hi = jnp.max(jnp.where(act, mean + 6.0 * std, 0.0))
  n = lo + (hi - lo) * (jnp.arange(_GRID, dtype=jnp.float32) + 0.5) / _GRID      # midpoints
  z = (n[:, None, None] - mean[None]) / (std[None] * jnp.sqrt(2.0))               # [G, B, Q]
  cdf = jnp.sum(weights[None] * 0.5 * (1.0 + jax.lax.erf(z)), axis=2)            # [G, B]
  below = jnp.prod(jnp.where(active[None, :], cdf, 1.0), axis=1)                 # P(max <= n)
  return jnp.where(jnp.any(active), lo + (hi - lo) / _GRID * jnp.sum(1.0 - below), 0.0)


def profile_weights(gov: Governor, gs: GovernorState, eps: float = 0.01):
  """float32 [B, Q]: each row's posterior weight on the Q profiles of an acceptance prior with
  spread (GovernorState.profiles: the rows of earlier calls), a finite-mixture empirical
  Bayes: prior 1/Q each, times the likelihood of the row's own smoothed counts under profile
  q, prod_j p_qj^A_bj (1 - p_qj)^(J_bj - A_bj) (p clipped to [eps, 1 - eps]). Before any
  evidence every row is the population (uniform weights): at B = 32 a profile one earlier
  row in 32 had is likely in the batch. After a few rejections a row's weight moves to the
  poor profiles. Equal profiles (a pooled prior, the guess) give uniform weights."""
  mean, mass = jnp.mean(gs.profiles, axis=0), prior_mass(gov, gs)
  own_a = jnp.maximum(gs.accepted - mass * mean, 0.0)                           # [B, W]
  own_r = jnp.maximum(gs.judged - mass - own_a, 0.0)
  p = jnp.clip(gs.profiles, eps, 1.0 - eps)                                      # [Q, W]
  loglik = own_a @ jnp.log(p).T + own_r @ jnp.log1p(-p).T                        # [B, Q]
  return jax.nn.softmax(loglik, axis=1)


def prior_mass(gov: Governor, gs: GovernorState):
  """float32 [B, W]: the judged drafts of the prior still in each row's smoothed counts,
  prior_weight * smoothing ** (times judged): the row's own counts are accepted - mass *
  mean(profiles) and judged - mass."""
  return gov.prior_weight * gov.smoothing ** gs.seen_judged


def profile_alpha(gov: Governor, gs: GovernorState, est):
  """float32 [B, Q, W]: row b's estimate `est` [B, W] (its counts shrunk toward the pool:
  `pooled_alpha`) moved by the prior's share of its counts from the profiles' mean to profile
  q: est_b + prior_mass_b / J_b * (profile_q - mean). Before any evidence the components are
  the profiles themselves; the prior's share fades as the row's own evidence accrues
  (`prior_mass` decays, J grows)."""
  spread = gs.profiles - jnp.mean(gs.profiles, axis=0)                            # [Q, W]
  scale = prior_mass(gov, gs) / jnp.maximum(gs.judged, 1e-6)                      # [B, W]
  return jnp.clip(est[:, None, :] + scale[:, None, :] * spread[None], 0.0, 1.0)


def batch_seconds(gov: Governor, tau, cost, active, remaining, variance=None, weights=None):
  """Predicted seconds for the batch at one K (lower is better; the module docstring).

  tau: float32 [B] each row's expected tokens per round at this K; variance: float32 [B] the
  variance of a round's tokens (None: 0); cost: seconds per round; active: bool [B];
  remaining: float32 [B] tokens each row still needs. With a prior's profiles ("slowest"
  only): tau, variance [B, Q] per profile and weights [B, Q] (`profile_weights`).
  objective "slowest": the loop runs until its last row is done, so the cost of a round times
  the expected number of rounds the slowest row needs, E[max_b N_b]. Row b needs N_b rounds
  for R_b tokens at tau_b tokens a round, the rounds of a renewal process: approximately
  1 + Normal((R_b - 1) / tau_b, (R_b - 1) var_b / tau_b^3) (`expected_max_rounds`; within
  2 % of simulated batches for B = 1..32, K = 1..4, alpha 0.3..0.9, R = 30..63, and within
  half a round for R = 5..10). With many rows the maximum sits well above the mean even when
  every row has the same acceptance (16 rows, K = 2, alpha 0.7, 63 tokens: 29.3 rounds on
  average, 33.0 for the slowest; simulated 33.1). "mean": the batch's tokens per second
  inverted, cost / sum_b tau_b (the expected throughput of one round)."""
  if gov.objective == "slowest":
    if variance is None:                   # plain rounds: one token each, no spread
      return cost * jnp.max(jnp.where(active, remaining, 0.0))
    rest = jnp.maximum(remaining - 1.0, 0.0)   # the first round emits >= 1 token for sure
    if jnp.ndim(tau) == 2:
      rest = rest[:, None]
    mean = 1.0 + rest / tau
    std = jnp.sqrt(rest * variance / tau ** 3)
    return cost * expected_max_rounds(mean, std, active, weights)
  return cost / jnp.maximum(jnp.sum(jnp.where(active, tau, 0.0)), 1e-6)


def choose(gov: Governor, ks: tuple, gs: GovernorState, costs, active, iteration,
           remaining=None):
  """-> (index into ks of this round's K, draft_rows bool [B]): the K whose predicted time for
  the batch is least (`batch_seconds`; ties to the smaller K); during warm-up K = 0 is excluded
  when some K >= 1 could beat it at all (with every draft accepted, (K+1) / t(K) > 1 / t(0)),
  unless the state is informed (a prior learned from earlier calls: it is the evidence); at
  the first choice (iteration 0) every K >= 1 also pays the entry cost costs[len(ks)]
  (objective "slowest");
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
  costs = jnp.asarray(costs, jnp.float32)
  est = pooled_alpha(gov, gs, active & draft_rows) if gov.objective == "slowest" else alpha
  # The entry cost (costs[len(ks)], when given): the drafter's work on the prompt, paid once
  # before the first drafted round; only the first choice can still avoid it. Seconds: added
  # to the "slowest" objective's predicted seconds (the "mean" objective's rate has no place
  # for a one-time cost).
  entry = costs[len(ks)] if costs.shape[0] > len(ks) and gov.objective == "slowest" else 0.0
  entry = jnp.where(jnp.asarray(iteration) == 0, entry, 0.0)
  predict = functools.partial(_predicted_seconds, gov, ks, costs=costs, draft_rows=draft_rows,
                              active=active, remaining=remaining, entry=entry)
  if gov.objective == "slowest" and gs.profiles is not None:   # a prior with spread: mixtures
    # (only where the profiles differ: equal ones, a pooled prior or the guess, give the
    # single estimate's seconds at a twentieth of the cost, 0.03 against 0.6 ms at B = 32)
    seconds = jax.lax.cond(_has_spread(gs),
                           lambda: predict(profile_alpha(gov, gs, est), profile_weights(gov, gs)),
                           lambda: predict(est, None))
  else:
    seconds = predict(est, None)
  if 0 in ks and gov.warmup_rounds and any(k > 0 for k in ks):
    i0 = ks.index(0)
    could_win = jnp.any(jnp.asarray([(k + 1) * costs[i0] > costs[i]
                                     for i, k in enumerate(ks) if k > 0]))
    warm = (iteration < gov.warmup_rounds) & could_win
    if gs.informed is not None:              # a prior learned from earlier calls: no warm-up
      # (a prior with spread keeps it: the warm-up's evidence is what tells this batch's rows
      # from the population's poor ones; a bet on the population alone gave up K = 2's 1.28x
      # at B = 16 for plain decoding, docs/governor.md)
      warm = warm & ~(gs.informed & ~_has_spread(gs))
    seconds = seconds.at[i0].set(jnp.where(warm, jnp.inf, seconds[i0]))
  return jnp.argmin(seconds).astype(jnp.int32), draft_rows


def _has_spread(gs: GovernorState):
  """bool scalar: the prior's profiles differ (a prior with spread, not a pooled one)."""
  if gs.profiles is None:
    return jnp.zeros((), bool)
  return jnp.any(jnp.abs(gs.profiles - jnp.mean(gs.profiles, axis=0)) > 1e-6)


def _predicted_seconds(gov: Governor, ks: tuple, est, weights, *, costs, draft_rows, active,
                       remaining, entry):
  """float32 [len(ks)]: batch_seconds at each candidate K (plus the entry cost for K >= 1)
  from per-row estimates est [B, W], or per-profile ones [B, Q, W] with weights [B, Q]."""
  rows = draft_rows if weights is None else draft_rows[:, None]
  seconds = []
  for i, k in enumerate(ks):
    if k:
      tau = jnp.where(rows, expected_tokens(est, k), 1.0)
      var = jnp.where(rows, token_variance(est, k), 0.0)
      seconds.append(batch_seconds(gov, tau, costs[i], active, remaining, var, weights) + entry)
    else:
      seconds.append(batch_seconds(gov, jnp.ones(est.shape[:-1], jnp.float32), costs[i],
                                   active, remaining))
  return jnp.stack(seconds)


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
  seen = {}
  if gs.seen_judged is not None:
    seen = dict(seen_accepted=jnp.where(judged, gs.seen_accepted + hit, gs.seen_accepted),
                seen_judged=jnp.where(judged, gs.seen_judged + 1.0, gs.seen_judged))
  return gs.replace(accepted=jnp.where(judged, lam * gs.accepted + hit, gs.accepted),
                    judged=jnp.where(judged, lam * gs.judged + 1.0, gs.judged),
                    **seen)
