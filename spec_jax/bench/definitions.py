"""What every reported field means: stored in each result's JSON under "definitions"."""

SPEC_DEFINITIONS = {
    "tokens_per_s": "new tokens over all rows / wall seconds of one compiled generate() call "
                    "(prefill + decode loop, compile excluded); median, min, max over `n` repeats. "
                    "With batches_per_cell N > 1 one measurement is N consecutive generate() calls "
                    "on N batches of distinct prompts: their tokens / their seconds",
    "batches_per_cell": "batches of distinct prompts per measurement (--batches-per-cell); tau, "
                        "alpha and the rounds count every row of all of them",
    "speedup": "median tokens/s of this row / median tokens/s of plain decoding (K=0) of the same "
               "target, batch and temperature, measured in this same run on the same prompts; "
               "< 1 means speculation is SLOWER than plain decoding at that batch",
    "alpha": "acceptance_rate = accepted draft tokens / drafted tokens (SpecStats), averaged "
             "over repeats; null for plain decoding",
    "alpha_token": "accepted / (accepted + rounds that ended in a rejection), averaged over "
                   "repeats: the per-token acceptance a of tau = (1 - a^(K+1)) / (1 - a); "
                   "SpecStats' alpha also counts the drafts after a round's first rejection, "
                   "never judged, as not accepted. The engine counts the rejections "
                   "(SpecStats.rejected), so it is exact whatever the rounds' lengths (n-gram "
                   "rounds of fewer drafts, a last round cut by max_new_tokens); null for "
                   "plain decoding, trees and the governor",
    "capacity": "the KV-cache capacity every configuration of the cell (plain, every K, trees, "
                "the governor) ran at and the cost ratios were timed at: longest prompt + "
                "max_new_tokens + the largest K or tree extent + 1, rounded up to 64",
    "tau": "mean_accepted_length = tokens emitted per target forward, bonus included "
           "((accepted + rounds) / rounds); 1 for plain decoding",
    "t_target_1_ms": "time of one jitted target forward over 1 new token at batch B, cache fill F "
                     "(F = longest prompt + max_new_tokens // 2, capacity = the run's capacity), "
                     "inside a jitted fori_loop (cache carried in place, argmax fed back), by "
                     "differencing: (t(2n forwards) - t(n forwards)) / n, so per-call costs "
                     "(dispatch, work hoisted out of the loop) cancel as in the engine's "
                     "while_loop; median of cost_repeats pairs",
    "c_verify": "t(target forward over K+1 new tokens) / t(target forward over 1 new token), "
                "same batch, fill and capacity; all timers of a batch run round-robin and the "
                "ratio is the median over rounds of the per-round ratio; 1 for K=0",
    "c_draft": "drafting cost of one round / K, in units of t_target_1. DraftModel: t(draft-model "
               "forward over 1 token, same batch, fill, capacity) / t_target_1 (so K*c_draft is K "
               "draft forwards; the sampling of q and the 2-token first step are not included). "
               "NGram and heads: t(jitted propose() of K tokens + commit() of the round) / K / "
               "t_target_1 (commit is where EAGLE/MTP heads run their layer over the K+1 verified "
               "features; free for n-gram). 0 for K=0",
    "bound": "tau / (K * c_draft + c_verify): the analytic speedup with the measured tau and cost "
             "ratios and no other overhead (Leviathan et al. with c_verify = 1)",
    "efficiency": "speedup / bound: the fraction of the analytic speedup the engine realises",
    "c_verify_rounds_min_max": "the smallest and largest per-round ratio behind c_verify (its "
                               "noise); t_target_1_spread_pct: (max-min)/median of t_target_1",
    "c_draft_propose, bound_propose, t_propose_ms": "the drafter's WHOLE propose() of one round "
        "(DraftModel: 2-token first step, K-1 more steps, sampling of q at temperature 1; NGram: "
        "same as c_draft) / K / t_target_1, and the bound with it: what drafting really costs",
    "noise_pct": "(max - min) / median of all plain-decoding repeats of a cell, in percent: the "
                 "machine's noise during that cell",
    "K = auto": "the governor (generate(num_draft='auto'), spec_jax.governor): K chosen every "
                "round from the cost table and the live alpha; its row has k_histogram (loop "
                "iterations per K, last repeat), k_share (their fractions), governor_costs (the "
                "cost table: seconds per round per K, t(K)/t(0), whether it came from the cache "
                "and how long calibrate() took in the warm-up), best_fixed_K / "
                "best_fixed_speedup / share_of_best_fixed (its speedup / the best fixed K's of "
                "the same drafter in the same cell, hindsight); c_draft, c_verify, bound and "
                "efficiency are null (K varies)",
    "governor": "one entry per governor row: speedup, share of the best fixed K, K histogram and "
                "issue 9's goals (>= 0.97x plain at B >= 16; >= 0.95x the best fixed K at B = 1)",
}

PLAIN_DEFINITIONS = {
    "ours_tokens_per_s": "sj.generate(drafter=None, greedy, stop_tokens=[]): new tokens / seconds "
                         "(stats.seconds: prefill + decode, compile excluded); median/min/max",
    "hf_tokens_per_s": "transformers `generate` (PyTorch, do_sample=False, min_new_tokens = "
                       "max_new_tokens, EOS disabled, torch threads = hf_threads, the CPU core "
                       "count by default): new tokens / wall seconds of the call; median/min/max",
    "hf_tokens_per_s_by_threads": "the same at every --hf-threads count (on a shared, "
                                  "oversubscribed machine torch's OpenMP threads can collapse; "
                                  "1 thread is shown beside the core count)",
    "greedy_match": "both produced exactly the same greedy tokens on the timed prompts",
    "c": "verify cost ratio: t(forward over T new tokens at fill F) / t(forward over 1 token at "
         "fill F), batch 1, capacity F + 16; t = (t(2n) - t(n)) / n for a jitted fori_loop of n "
         "forwards (cache carried in place, argmax fed back); T = 1..9 timed round-robin, c = "
         "median over rounds of the per-round ratio",
    "c_call": "the same ratio from single jitted forward calls (params as arguments, cache "
              "donated, block_until_ready), round-robin: includes the per-call dispatch overhead "
              "and per-call work",
}

BREAKDOWN_DEFINITIONS = {
    "t_round_ms": "engine time per loop iteration, prefill excluded",
    "tau_loop": "tokens each row gains per loop iteration: iterations(plain) / iterations(spec) "
                "(every row decodes max_new_tokens; the loop runs until its slowest row is "
                "done, so at B > 1 this is below the pooled tau)",
    "speedup_loop": "tau_loop * t_round(plain) / t_round(spec) = the plain loop's time / the "
                    "speculative loop's: the decode-loop speedup, prefill excluded",
    "bound": "tau_loop / ((K t_draft_fwd + t_fwd_k1) / t_fwd_1): the analytic loop speedup",
    "efficiency_loop": "speedup_loop / bound = eff_spec_overhead_factor * "
                       "eff_plain_overhead_factor",
    "t_other_ms": "t_round - t_propose - t_verify_step - t_accept",
}
