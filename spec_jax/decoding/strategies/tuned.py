"""TunedDraftTemperature(K): a chain of K drafts whose rows each choose their drafts'
temperature online, from the distributions their earlier rounds drafted and verified.

Speculative sampling is exact for any draft distribution q fixed before the draft is drawn
(Leviathan et al. 2023, Theorem 1), so q may be chosen from anything the past rounds saw: the
output keeps the target's distribution. What the choice moves is the acceptance, per position

    beta(q) = sum_x min(p(x), q(x))          (Leviathan et al. 2023, section 3: the acceptance rate)

and a draft model broader than its target at T = 1 accepts more when sharpened
(docs/speed.md: salty279K drafting for stories260K, beta 0.649 at scale 1, 0.666 at 0.8).
The best scale depends on the pair, the temperature and the text, so this strategy measures
it as it decodes. Every round drafts at scale c (relative to the row's own
Sampling.draft_temperature_scale); at each drafted position it scores every candidate scale
c' against the target's p there without drawing anything more: q drew at temperature T c, so
q_c' ∝ exp(logits / (T c')) = q^(c / c') renormalised (exact without top-k / top-p; with
them, q's support is the one drawn at c, an approximation that only moves which scale wins).
Each row keeps the sum of beta per scale over its scored positions and drafts the next round
at its argmax (ties: the scale nearest 1, the row's own setting).

Greedy rows (temperature 0) and drafters that report no q (deterministic drafts) learn
nothing and draft as a Chain(K) would.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.decoding.rounds import Verified, chain_round
from spec_jax.decoding.strategies.chain import Chain

DEFAULT_SCALES = (0.6, 0.7, 0.8, 0.9, 1.0)


def acceptance_at_scales(verified: Verified, exponents) -> jax.Array:
  """beta per verify position and candidate scale: float32 [B, K, S], with exponents float32
  [B, S] = c / c' (the drawn scale over each candidate), q_c' = q^(c/c') renormalised over
  q's support."""
  q = verified.draft_probs.astype(jnp.float32)                         # [B, K, V]
  k = q.shape[1]
  p = verified.target_probs[:, :k].astype(jnp.float32)                 # [B, K, V]
  support = q > 0
  log_q = jnp.log(jnp.where(support, q, 1.0))
  log_q = log_q - jnp.max(jnp.where(support, log_q, -jnp.inf), axis=-1, keepdims=True)
  betas = []
  for s in range(exponents.shape[1]):            # S is small: one [B, K, V] pass each
    w = jnp.where(support, jnp.exp(exponents[:, None, s, None] * log_q), 0.0)
    q_s = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-30)
    betas.append(jnp.sum(jnp.minimum(p, q_s), axis=-1))
  return jnp.stack(betas, axis=-1)


def scored_positions(verified: Verified, sampled_rows) -> jax.Array:
  """bool [B, K]: the positions a round scores: every drafted one (j < the row's draft
  length) in rows that were running and sample (sampled_rows bool [B]). Positions after a
  rejection count too: their context holds a draft the target did not keep, but p and q
  there are still the target's and the drafter's distributions after one same context. They
  give ~1.7x the evidence of the accepted prefix alone (K = 4, tau 2.5), which matters at
  B = 1, where a row learns from its own ~60 positions (salty279K for the widened
  stories260K, T = 1, 48 decodes of 64 tokens: tau 2.60 against 2.54 with the accepted
  prefix alone, 2.44 at scale 1 and 2.59 at the best fixed scale, 0.8)."""
  k = verified.draft_probs.shape[1]
  j = jnp.arange(k)[None, :]
  return (j < verified.draft_lengths[:, None]) & (verified.active & sampled_rows)[:, None]


@dataclasses.dataclass(frozen=True)
class TunedDraftTemperature(Chain):
  """A chain of K drafts; each row drafts at the scale of `scales` (times its own
  Sampling.draft_temperature_scale) whose summed acceptance over its drafted positions is
  highest so far (see the module's docstring). State: float32 [B, S], those sums."""
  k: int = 4
  scales: tuple = DEFAULT_SCALES
  label = property(lambda self: f"K={self.k},tuned-draft-T")

  def __post_init__(self):
    super().__post_init__()
    scales = tuple(self.scales) if isinstance(self.scales, (tuple, list)) else None
    if (not scales or not all(isinstance(s, numbers.Real) and not isinstance(s, bool)
                              and 0 < s < np.inf for s in scales)
        or len(set(scales)) != len(scales)):
      raise ValueError(f"TunedDraftTemperature: scales must be distinct finite numbers > 0 "
                       f"(multiples of the row's draft temperature), got {self.scales!r}")
    object.__setattr__(self, "scales", tuple(float(s) for s in scales))

  def bind(self, drafter, target) -> "TunedDraftTemperature":
    if drafter is None or self.k == 0:
      raise ValueError("TunedDraftTemperature tunes a drafter's temperature: it needs a "
                       "drafter and K >= 1 (Chain(0) decodes plainly)")
    return super().bind(drafter, target)

  @property
  def start(self) -> int:
    """The index of the scale every row starts at (the nearest to 1)."""
    return int(np.argmin(np.abs(np.log(np.asarray(self.scales)))))

  def init(self, env, state):
    return jnp.zeros((state.lengths.shape[0], len(self.scales)), jnp.float32)

  def choice(self, sums) -> jax.Array:
    """int32 [B]: each row's scale index (the largest sum; ties go to `start`)."""
    tie_break = jnp.zeros(len(self.scales), jnp.float32).at[self.start].set(1e-6)
    return jnp.argmax(sums + tie_break, axis=-1).astype(jnp.int32)

  def round(self, env, state):
    scales = jnp.asarray(self.scales, jnp.float32)
    chosen = scales[self.choice(state.strategy)]                         # [B]
    sampling = env.sampling.replace(
        draft_temperature_scale=env.sampling.draft_temperature_scale * chosen)
    sampled_rows = env.sampling.temperature > 0

    def observe(new, verified: Verified):
      beta = acceptance_at_scales(verified, chosen[:, None] / scales[None, :])   # [B, K, S]
      scored = scored_positions(verified, sampled_rows)
      return new.replace(strategy=state.strategy + jnp.sum(
          jnp.where(scored[..., None], beta, 0.0), axis=1))

    return chain_round(env._replace(sampling=sampling), state, k=self.k, observe=observe)
