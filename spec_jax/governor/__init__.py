"""num_draft="auto": the speculation governor picks K (0 = a plain step) every round.

Modules: options (Governor, its knobs), costs (CostTable), choice (the per-round choice and
the live acceptance): pure functions of arrays. The loop that runs them is the Governed round
strategy (spec_jax.decoding.strategies.governed); measuring a cost table is
spec_jax.decoding.calibration's job (it times compiled decodes, on the host side).

Cost model. A round with K drafts costs t(K) seconds for the whole batch (drafting, the verify
forward over K+1 tokens, acceptance, commit: tau / (K c_draft + c_verify(K+1)) of
../shared/DESIGN.md with the denominator measured as one number). t(K) is a cost table measured
once per (device kind, target, drafter, batch B, capacity bucket, greedy or not) by
`sj.calibrate` (spec_jax.decoding.calibration), and cached as JSON under $XDG_CACHE_HOME/spec_jax/governor
(default ~/.cache/spec_jax/governor). It times the very executable generate() then runs (compiled once,
shared): decode(num_draft="auto") with K forced through the cost vector, two lengths per K,
differenced so the prefill and per-call work cancel (measure_round_costs); t(0) is the plain
step the loop really runs (below: plain is final). Row b's draft position j is accepted, given
the positions before it were, with probability alpha_bj (estimated live, below), so a round of
K drafts emits tau_b(K) = 1 + a_b0 + a_b0 a_b1 + ... + a_b0 ... a_b(K-1) tokens in expectation
(per-position survival: a drafter's acceptance falls along the chain). Row b still needs R_b
tokens (its token limit minus its length). Every round the governor takes

    K* = argmin_K  t(K) * E[max_{b active} N_b(K)]              (objective "slowest")

(ties to the smaller K; the default, since the loop runs until its slowest row is done;
at the first choice of a call every K >= 1 also pays the entry cost e, below),
or, with objective="mean", the most expected tokens per second for the batch in one round,

    K* = argmax_K  sum_{b active} tau_b(K) / t(K).

"slowest" takes the expected rounds the slowest row needs at K, times what a round costs. Row b needs N_b(K)
rounds for its R_b tokens, the count of a renewal process whose rounds emit tau_b(K) tokens
on average with variance v_b(K) (E[T^2] = sum_j (2j + 1) S_j over the survivals S_j):
approximately 1 + Normal((R_b - 1) / tau_b, (R_b - 1) v_b / tau_b^3), and the expected maximum
of these independent normals is integrated numerically (choice.expected_max_rounds; within 2 %
of simulated batches). Two effects the mean misses: with many rows the slowest sits well
above the mean even when all rows draft alike (16 rows, K = 2, alpha 0.7, 63 tokens: 29.3
rounds on average, 33.0 for the slowest), and a row that cannot gain (gated, or poorly
drafted) with as many tokens left as the others makes drafting a loss for the batch. The
per-row estimates it reads are shrunk toward the drafting rows' pooled rate, worth
`pool_weight` judged drafts (empirical Bayes: after two warm-up rounds one row's two
rejections do not make the batch go plain; with unshrunk estimates, measured at B = 16, one
of 16 rows always looked hopeless and the batch decoded plainly where K = 2 was 1.25x:
docs/governor.md). At B = 1 both objectives agree up to the renewal correction. Measured
side by side (widened stories260K, float32, AVX2 CPU, three drafters), "slowest" was ahead of
"mean" at B = 4 and B = 16 and level at B = 1 (docs/governor.md): the default. K = 0 is plain
decoding (tau = 1 per row), so where drafting costs more than it brings (large B, poor
drafts) it decodes plainly. Per-row budgets: row b drafts min(K, R_b - 1) (a draft past its
limit could never be emitted), or none when its first-draft alpha_b0 < gate_alpha. The verify
is [B, K+1] whatever the budgets (fixed shapes): a budget below K saves no compute; the width
K is the batch's choice.

The entry cost. A call that drafts at all pays once for the drafter's work on the prompt
(DFlash's context K/V, an EAGLE head's layer over the prompt, a draft model's prefill) and a
call that decodes plainly from its first round does not (Strategy.init_drafter skips it when
plain is final). `sj.calibrate` measures it as the difference of the per-call parts of K = k1
and of K = 0 started plain (CostTable.entry_seconds, the last entry of round_costs), and the
first choice adds it to every K >= 1. At B = 32 on widened stories260K it is ~0.24 s for an
EAGLE-3 head and ~0.20 s for DFlash (prefill-only calls timed side by side), against ~0.2 s a
plain round: under 2 % of a 64-token call, so a noisy one-repeat table may well measure 0.

A prior can lock a small batch into plain decoding: with no warm-up and plain final, an
EAGLE-3 prior pooled over eight earlier prompts (0.59 at the first position, where the prompt
at hand drafts at ~0.85) made a B = 1 call decode plainly throughout (0.73 of the best fixed
K). One request is one draw from the prompts' spread, and the warm-up is what measures it; at
large batches the slowest of many rows bounds the loop and the pooled prior is the better
guide (docs/governor.md). Hence opt-in: pass a prior for large batches.

Live acceptance. Per row and draft position, exponentially smoothed counts of accepted drafts
A and judged drafts J (position j is judged when the positions before it were accepted: it is
an accepted draft or the first failure, a rejection or a missing draft when an n-gram finds
fewer than K), started at a prior worth `prior_weight` judged drafts at `prior_alpha`:

    A_bj <- smoothing * A_bj + accepted_bj,  J_bj <- smoothing * J_bj + 1   (judged only)

so alpha_bj = A_bj / J_bj. A K = 0 round or a gated row teaches nothing. The first
`warmup_rounds` loop iterations draft (the best K >= 1), so the choice rests on live evidence
and not only on the prior.

Acceptance learned across calls. A decode returns its pooled per-position estimate
(DecodeResult.position_acceptance, sum_b A_bj / sum_b J_bj); passed to the next call as
`acceptance_prior` it replaces the guess (prior_alpha) at every row, with the same weight, and
the warm-up is skipped: the first round is chosen from what earlier calls of the pair saw, as
vLLM's and SGLang's adaptive speculation carry an online acceptance estimate across requests.
Where drafting cannot pay at that acceptance (a large batch, a dear drafter) the call decodes
plainly from its first round instead of paying two drafted warm-up rounds; the prior is an
input like the key, so a call stays a pure function of its arguments.

A prior with spread. A pooled rate hides the row that bounds a large batch: on the widened
target one prompt in 32 never drafts well with EAGLE-3 (alpha_0 0.016), the pooled rate is
0.73, and at B = 32 the loop runs as long as that row (docs/governor.md). Passed the rows of
earlier calls instead (DecodeResult.row_acceptance, resampled to PRIOR_ROWS profiles), the
"slowest" objective treats each row as a finite mixture over the profiles (empirical Bayes
with the earlier rows as the population): prior weight 1/Q each, reweighted by the likelihood
of the row's own counts (choice.profile_weights), and E[max_b N_b] integrates the mixtures'
CDFs. So before any evidence a B = 32 batch expects a row as poor as the poorest earlier ones
with the probability they had (one in 32 earlier rows: in 64 % of batches of 32), while one
row (B = 1) is one draw; and a row's few rejections move its weight to the poor profiles,
faster than its smoothed rate falls to the gate. The rows handed over are each row's
whole-call counts shrunk toward the call's pooled rate by pool_weight judged drafts
(governor.row_acceptance): raw estimates carry their counting noise, and a mixture over
them expected poor rows that were not there (plain at B = 16 where K = 2 gained 1.28x). A
prior with spread keeps the drafted warm-up: without evidence the mixture is a bet on the
population, and plain is final.

Plain is final. Once the governor picks K = 0 after the warm-up, every remaining round is a
plain step: the estimates stop moving in plain rounds, so the choice would not change (no
probing: a probe would cost a drafting round). These steps skip the drafter's commit and the
hidden states it reads, so a plain round costs what plain decoding costs (with the drafter kept
in sync, an EAGLE head's layer ran in every plain round and made t(0) dearer than plain).

Drafters across plain rounds, with a `schedule` (tests: K = 0 rounds between drafting ones):
K = 0 rounds never call propose; drafters whose state follows the target (Medusa, EAGLE,
EAGLE-3, MTP) still commit the verified token there; a DraftModel skips them and catches up in
one chunked forward per 16 missed tokens when drafting resumes (Drafter.catch_up).

Lossless: K, the gating and the budgets of round r depend only on rounds < r, and each round is an exact
speculative round for any K, so the output distribution is the target's (tests/test_governor.py).

    gov = sj.Governor(max_draft=8, ks=(0, 1, 2, 4), smoothing=0.8)
    out = sj.generate(target, prompts, drafter=drafter, num_draft="auto", governor=gov)
    out.stats.k_histogram        # {K: loop iterations that ran with K drafts}
    table = sj.calibrate(target, drafter, batch=16)   # cached; generate() does this itself
"""

from spec_jax.governor.choice import (batch_seconds, choose, expected_tokens, observe,
                                     position_alpha, profile_weights, row_alpha)
from spec_jax.governor.costs import CostTable
from spec_jax.governor.options import (DEFAULT_KS, OPTIONS, PRIOR_ROWS, Governor,
                                      GovernorState, pooled_acceptance, row_acceptance)

__all__ = ["Governor", "GovernorState", "CostTable", "DEFAULT_KS", "OPTIONS", "choose",
           "observe", "row_alpha", "position_alpha", "expected_tokens", "batch_seconds",
           "pooled_acceptance", "profile_weights", "PRIOR_ROWS", "row_acceptance"]
