"""The breakdown suite: where a speculative round's time goes, per (target, drafter, K, batch,
temperature).

t_round = (seconds of generate(max_new) - seconds of generate(max_new=1), same compiled
executable) / loop iterations: the engine's real per-round time, prefill excluded. It is set
against the pieces timed alone in jitted fori_loops at the run's batch, fill and capacity:
propose (the whole draft of one round), verify_step (target forward over K+1 + probs),
accept_step (rejection sampling) and the bare target forwards over 1 and K+1 tokens. `other`
= t_round - propose - verify_step - accept: commit, drafter.commit, loop bookkeeping and
whatever the fusion of the whole loop body costs or saves.
"""

from __future__ import annotations

import statistics

from spec_jax.bench.definitions import BREAKDOWN_DEFINITIONS
from spec_jax.bench.metrics import engine_capacity
from spec_jax.bench.results import log
from spec_jax.bench.specs import draft_model_of, drafter_label
from spec_jax.bench.suites.targets import grid_of, prepare_target
from spec_jax.bench.timers import time_accept, time_forward, time_propose, time_verify_step
from spec_jax.timing import interleaved_rounds
import spec_jax as sj


def engine_round(setup, prompts, dspec: str, k: int, temp: float, seed: int, reps: int,
                 cap: int) -> tuple:
  """The engine's time per loop iteration -> (t_round, t_prefill, iterations, stats):
  generate(max_new) and generate(max_new=1) interleaved, medians differenced, at KV capacity
  `cap` (the cell's, one for plain and every K)."""
  import jax
  dr = setup.drafters.get(dspec)
  kw = dict(drafter=dr, num_draft=k if dr is not None else 4,
            sampling=sj.Sampling(temperature=temp), key=jax.random.key(seed),
            stop_tokens=[], capacity=cap)
  full = lambda: sj.generate(setup.model, prompts, max_new_tokens=setup.max_new, **kw).stats
  pre = lambda: sj.generate(setup.model, prompts, max_new_tokens=1, **kw).stats
  full()                                                          # warm-up
  pre()
  res = interleaved_rounds({"full": full, "pre": pre}, reps)
  last = res["full"][-1]
  t_pre = statistics.median(s.seconds for s in res["pre"])
  t_round = (statistics.median(s.seconds for s in res["full"]) - t_pre) / last.iterations
  return t_round, t_pre, last.iterations, last


def breakdown_row(meta: dict, k: int, tau: float, t: dict, plain_round: float,
                  tau_loop: float = None) -> dict:
  """One row from the measured times in seconds: t = {'round', 'prefill', 'fwd_1', 'fwd_k1',
  'propose', 'draft_fwd', 'verify_step', 'accept'}; plain_round = plain decoding's t_round in
  the same cell; tau_loop = plain's loop iterations / this one's (None: tau, as at B = 1).
  speedup_loop = tau_loop * plain_round / round; bound = tau_loop / ((K draft_fwd + fwd_k1) /
  fwd_1); other = round - propose - verify_step - accept. The pooled tau overstated both at
  B > 1, where the loop runs until the slowest row is done (1.33x at B = 4, K = 4 on the
  story models)."""
  ms = {f"t_{name}_ms": 1e3 * v for name, v in t.items()}
  row = dict(meta, K=k, tau=tau, **ms)
  row["t_other_ms"] = 1e3 * (t["round"] - t["propose"] - t["verify_step"] - t["accept"])
  # t_round is a difference of two medians: where the whole call is within the noise of the
  # 1-token call it can come out <= 0 (a -0.28 ms round, a -1.8x speedup were printed).
  unresolved = t["round"] <= 0 or (k > 0 and plain_round <= 0)
  if unresolved:
    row.update(t_round_ms=None, t_other_ms=None, unresolved=(
        "the round time (full call - 1-token call, per iteration) came out <= 0: the calls' "
        "difference is within their noise; rerun with more --repeats or --max-new-tokens"))
  if k == 0:
    return row
  # Counts, not times: known however noisy the round's time came out.
  row["tau_loop"] = tau_loop = tau if tau_loop is None else tau_loop
  if unresolved:
    return row
  speed_loop = tau_loop * plain_round / t["round"]
  bound = tau_loop / ((k * t["draft_fwd"] + t["fwd_k1"]) / t["fwd_1"])
  row.update({
      "plain_round_ms": 1e3 * plain_round, "speedup_loop": speed_loop, "bound": bound,
      "efficiency_loop": speed_loop / bound,
      # efficiency = [(K t_draft + t_verify) / t_round] * [t_plain_round / t_fwd_1]
      "eff_spec_overhead_factor": (k * t["draft_fwd"] + t["fwd_k1"]) / t["round"],
      "eff_plain_overhead_factor": plain_round / t["fwd_1"]})
  return row


def run_breakdown_suite(opts) -> dict:
  """The breakdown suite (see the module docstring)."""
  grid = grid_of(opts)
  rows = []
  reps, cost_reps = max(opts.repeats, 3), opts.cost_repeats
  for target_spec, drafter_specs in grid.by_target.items():
    setup = prepare_target(target_spec, drafter_specs, opts, grid.ks, max(grid.batches))
    target, fill, vocab = setup.model, setup.fill, setup.model.config.vocab_size
    for batch in grid.batches:
      prompts = setup.ids[:batch]
      # One capacity for the cell: plain and every K read caches of the same length.
      cell_cap = engine_capacity(max(len(r) for r in prompts), setup.max_new,
                                 max([0] + list(grid.ks)))
      for temp in grid.temps:
        cell = f"{setup.label} B={batch} T={temp:g}"
        meta = lambda dspec, iters: {
            "target": setup.label, "drafter": drafter_label(dspec), "batch": batch,
            "temperature": temp, "max_new_tokens": setup.max_new, "capacity": cell_cap,
            "fill": fill, "iterations": iters}
        log(f"[bench] breakdown {cell}: plain")
        plain_round, plain_pre, plain_iters, _ = engine_round(
            setup, prompts, "none", 0, temp, opts.seed, reps, cell_cap)
        t1 = time_forward(target, batch, 1, fill, cell_cap, cost_reps)["per_iter_s"]
        rows.append(breakdown_row(meta("none", plain_iters), 0, 1.0, {
            "round": plain_round, "prefill": plain_pre, "fwd_1": t1, "fwd_k1": t1,
            "propose": 0.0, "draft_fwd": 0.0,
            "verify_step": time_verify_step(target, batch, 1, fill, cell_cap, cost_reps,
                                            temp)["per_iter_s"],
            "accept": time_accept(batch, 0, vocab, False, temp, cost_reps)["per_iter_s"]},
            plain_round))
        for dspec, dr in setup.drafters.items():
          for k in grid.ks:
            log(f"[bench] breakdown {cell}: {drafter_label(dspec)} K={k}")
            t_round, t_pre, iters, stats = engine_round(setup, prompts, dspec, k, temp,
                                                        opts.seed, reps, cell_cap)
            pr = time_propose(dr, target, batch, k, fill, cell_cap, cost_reps,
                              temp)["per_iter_s"]
            dm = draft_model_of(dr)
            stochastic_q = dm is not None and not getattr(dr, "greedy_drafts", False)
            t = {"round": t_round, "prefill": t_pre,
                 "fwd_1": time_forward(target, batch, 1, fill, cell_cap,
                                       cost_reps)["per_iter_s"],
                 "fwd_k1": time_forward(target, batch, k + 1, fill, cell_cap,
                                        cost_reps)["per_iter_s"],
                 "propose": pr,
                 "draft_fwd": (time_forward(dm, batch, 1, fill, cell_cap,
                                            cost_reps)["per_iter_s"] if dm is not None
                               else pr / k),
                 "verify_step": time_verify_step(target, batch, k + 1, fill, cell_cap,
                                                 cost_reps, temp)["per_iter_s"],
                 "accept": time_accept(batch, k, vocab, stochastic_q, temp,
                                       cost_reps)["per_iter_s"]}
            row = breakdown_row(meta(dspec, iters), k, stats.mean_accepted_length, t,
                                plain_round, tau_loop=plain_iters / iters if iters else None)
            row["alpha"] = stats.acceptance_rate
            rows.append(row)
  return {"suite": "breakdown", "rows": rows, "notes": [],
          "definitions": BREAKDOWN_DEFINITIONS}
