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

from spec_jax.governor.choice import choose, expected_tokens, observe, row_alpha
from spec_jax.governor.costs import CostTable
from spec_jax.governor.options import DEFAULT_KS, OPTIONS, Governor, GovernorState

__all__ = ["Governor", "GovernorState", "CostTable", "DEFAULT_KS", "OPTIONS", "choose",
           "observe", "row_alpha", "expected_tokens"]
