"""The spec suite: plain decoding (K=0) and every drafter of every (target, drafter) pair, at
several K, batch sizes and temperatures, on the same prompts, in one run: tokens/s, speedup
over plain decoding in that run, alpha, tau, the cost ratios c_draft and c_verify, the
analytic bound and the efficiency (see spec_jax.bench.definitions.SPEC_DEFINITIONS).

A cell is (target, batch, temperature): its configurations run round-robin, plain decoding at
the start and the end of every round; the cost ratios of a batch are timed once, round-robin.
With 'auto' among the K values the governor (num_draft="auto") is one more configuration per
drafter, beside plain and every fixed K: its row carries the K histogram, the cost table it
used (calibrated during its warm-up call, outside the timing) and its share of the best fixed
K's speedup in the same cell.
"""

from __future__ import annotations

import statistics
import time

from spec_jax.bench.definitions import SPEC_DEFINITIONS
from spec_jax.bench.metrics import alpha_per_verified_token, bound_of, engine_capacity
from spec_jax.bench.results import log
from spec_jax.bench.specs import draft_model_of, drafter_label, model_label
from spec_jax.bench.suites.targets import (DTYPE_TAGS, cell_config, cell_sampling,
                                           draft_scale, grid_of, prepare_target,
                                           release_compiled, run_batches, tree_configs,
                                           tree_drafters, tree_text)
from spec_jax.bench.timers import time_forward, time_propose, time_propose_tree
from spec_jax.timing import interleaved_rounds, ratio_of, summarize, time_interleaved
from spec_jax import governor as governor_lib
from spec_jax.decoding import calibration


def time_costs(setup, batch: int, ks, capacity: int, repeats: int, trees=()) -> tuple:
  """The cost timers of one batch, all round-robin -> (t1, tv, td): t1 the target forward over
  1 token, tv[k] over K+1 tokens (timer dicts of timing.time_interleaved), td[drafter][k] =
  {'per_round_s', 'c_draft', 'propose_s', 'c_propose'}. For a TreeSpec t in `trees`, tv[t] is
  the forward over N+1 tokens (the tree verify; the mask does not change its cost) and
  td[drafter][t] the drafter's propose_tree() + commit_tree() per round / D."""
  target, fill = setup.model, setup.fill
  calls = {"t1": time_forward(target, batch, 1, fill, capacity, call_only=True)}
  for k in ks:
    calls[("verify", k)] = time_forward(target, batch, k + 1, fill, capacity, call_only=True)
  for t in trees:
    calls[("verify", t)] = time_forward(target, batch, t.num_nodes + 1, fill, capacity,
                                        call_only=True)
    for dspec in tree_drafters(setup, t):
      calls[("propose", dspec, t)] = time_propose_tree(
          setup.drafters[dspec], target, batch, t, fill, capacity,
          temperature=1.0 if draft_model_of(setup.drafters[dspec]) is not None else 0.0,
          call_only=True)
  for dspec, dr in setup.drafters.items():
    if draft_model_of(dr) is not None:
      calls[("draft_fwd", dspec)] = time_forward(draft_model_of(dr), batch, 1, fill, capacity,
                                                 call_only=True)
    for k in ks:
      # The whole propose() of a round (draft model: 2-token first step, K-1 more, the
      # sampling of q at temperature 1; n-gram: the search).
      calls[("propose", dspec, k)] = time_propose(
          dr, target, batch, k, fill, capacity,
          temperature=1.0 if draft_model_of(dr) is not None else 0.0, call_only=True)
  timed = time_interleaved(calls, repeats)
  t1 = timed["t1"]
  tv = {k: timed[("verify", k)] for k in list(ks) + list(trees)}
  td = {}
  for dspec, dr in setup.drafters.items():
    td[dspec] = {}
    for k in ks:
      prop = timed[("propose", dspec, k)]
      per_draft = timed[("draft_fwd", dspec)] if draft_model_of(dr) is not None else None
      td[dspec][k] = {
          "per_round_s": k * per_draft["per_iter_s"] if per_draft else prop["per_iter_s"],
          "c_draft": ratio_of(per_draft, t1) if per_draft else ratio_of(prop, t1, k),
          "propose_s": prop["per_iter_s"], "c_propose": ratio_of(prop, t1, k)}
    for t in trees:
      if ("propose", dspec, t) in timed:
        prop = timed[("propose", dspec, t)]
        td[dspec][t] = {"per_round_s": prop["per_iter_s"], "c_draft": ratio_of(prop, t1, t.depth),
                        "propose_s": prop["per_iter_s"],
                        "c_propose": ratio_of(prop, t1, t.depth)}
  return t1, tv, td


def governor_row(meta: dict, dspec: str, stats: list, tokens_per_s: list, base: dict,
                 t1: dict, table=None, kmax: int = 0) -> dict:
  """The governor's row (K = 'auto'): the fields of spec_row that apply, plus k_histogram
  ({K: loop iterations}, from the last repeat), rounds_by_k_share and the cost table."""
  import numpy as np
  tps = summarize(tokens_per_s)
  last = stats[-1]
  hist = {int(k): int(n) for k, n in sorted((last.k_histogram or {}).items())}
  total = sum(hist.values())
  lb, max_new = meta["prompt_tokens_longest"], meta["max_new_tokens"]
  return {
      "target": meta["target"], "target_spec": meta["target_spec"],
      "target_params": meta["target_params"],
      "drafter": drafter_label(dspec), "drafter_spec": dspec, "K": "auto",
      "batch": meta["batch"], "temperature": meta["temperature"], "max_new_tokens": max_new,
      "draft_temperature_scale": meta.get("draft_temperature_scale", 1.0),
      "new_tokens_per_run": meta["batch"] * max_new * meta.get("batches_per_cell", 1),
      "batches_per_cell": meta.get("batches_per_cell", 1), "prompt_tokens_longest": lb,
      "capacity": meta["cost_capacity"],
      "tokens_per_s": tps, "seconds_median": statistics.median(s.seconds for s in stats),
      "speedup": tps["median"] / base["median"],
      "alpha": float(np.mean([s.acceptance_rate for s in stats])),
      "alpha_token": None,
      "tau": float(np.mean([s.mean_accepted_length for s in stats])),
      "alpha_per_repeat": [s.acceptance_rate for s in stats],
      "accepted_at": list(last.accepted_at), "rounds": last.rounds,
      "iterations": last.iterations,
      "k_histogram": hist,
      "k_share": {k: n / total for k, n in hist.items()} if total else {},
      "c_draft": None, "c_verify": None, "bound": None, "efficiency": None,
      "t_target_1_ms": 1e3 * t1["per_iter_s"], "t_verify_ms": None, "t_draft_round_ms": None,
      "governor_costs": table.as_dict() if table is not None else None,
      "cost_fill": meta["cost_fill"], "cost_capacity": meta["cost_capacity"],
      "noise_pct": base["spread_pct"],
  }


def spec_row(meta: dict, dspec: str, k: int, stats: list, tokens_per_s: list, base: dict,
             t1: dict, tv: dict = None, td: dict = None) -> dict:
  """One row of the table from one configuration's repeats.

  meta: the row's target/batch/temperature/length fields; stats: its SpecStats per repeat;
  base: summarize() of plain decoding's tokens/s in the same cell; t1: the 1-token target
  timer; tv: the (K+1)-token timer and td: the drafter's costs at this K (both None for K=0).
  k may be an sj.TreeSpec: a tree row, K = its depth, "tree" = "D,k,N[,sampled]", c_verify
  over N+1 tokens, c_draft = (propose_tree + commit_tree) / D, bound = tau / (D c_draft +
  c_verify).
  """
  import numpy as np
  tree = None
  if not isinstance(k, int):
    tree, k = k, k.depth
  tps = summarize(tokens_per_s)
  tau = float(np.mean([s.mean_accepted_length for s in stats]))
  alphas = [s.acceptance_rate for s in stats]
  tok_alphas = [alpha_per_verified_token(s) for s in stats]
  alpha_token = (None if k == 0 or tree is not None or any(a is None for a in tok_alphas)
                 else float(np.mean(tok_alphas)))
  if k == 0:
    c_draft, c_verify, alpha, cv_rounds = 0.0, 1.0, None, None
    t_draft = t_propose = c_propose = 0.0
  else:
    c_verify = ratio_of(tv, t1)          # median over rounds of per-round ratios
    cv_rounds = [a / b for a, b in zip(tv["samples"], t1["samples"])]
    t_draft, c_draft = td["per_round_s"], td["c_draft"]
    t_propose, c_propose = td["propose_s"], td["c_propose"]
    alpha = float(np.mean(alphas))
  bound = bound_of(tau, k, c_draft, c_verify)
  speedup = tps["median"] / base["median"]     # 1.0 for plain (K = 0) in the cell's dtype
  last = stats[-1]
  lb, max_new = meta["prompt_tokens_longest"], meta["max_new_tokens"]
  return {
      "target": meta["target"], "target_spec": meta["target_spec"],
      "target_params": meta["target_params"],
      "drafter": drafter_label(dspec), "drafter_spec": dspec, "K": k,
      "tree": None if tree is None else tree_text(tree, (stats[-1].tree or (None,) * 4)[3]),
      "batch": meta["batch"], "temperature": meta["temperature"], "max_new_tokens": max_new,
      "draft_temperature_scale": meta.get("draft_temperature_scale", 1.0),
      "new_tokens_per_run": meta["batch"] * max_new * meta.get("batches_per_cell", 1),
      "batches_per_cell": meta.get("batches_per_cell", 1), "prompt_tokens_longest": lb,
      "capacity": meta["cost_capacity"],           # every configuration of the cell ran at it
      "tokens_per_s": tps, "seconds_median": statistics.median(s.seconds for s in stats),
      "speedup": speedup, "alpha": alpha, "tau": tau,
      "alpha_per_repeat": alphas if k else None,
      "alpha_token": alpha_token,
      "accepted_at": list(last.accepted_at), "rounds": last.rounds,
      "iterations": last.iterations,
      "c_draft": c_draft, "c_verify": c_verify, "bound": bound,
      "efficiency": speedup / bound,
      "c_verify_rounds_min_max": [min(cv_rounds), max(cv_rounds)] if k else None,
      "t_target_1_spread_pct": t1["spread_pct"],
      "c_draft_propose": c_propose,
      "bound_propose": bound_of(tau, k, c_propose, c_verify),
      "t_propose_ms": 1e3 * t_propose,
      "t_target_1_ms": 1e3 * t1["per_iter_s"],
      "t_verify_ms": 1e3 * (tv["per_iter_s"] if k else t1["per_iter_s"]),
      "t_draft_round_ms": 1e3 * t_draft,
      "cost_fill": meta["cost_fill"], "cost_capacity": meta["cost_capacity"],
      "noise_pct": base["spread_pct"],
  }


def config_label(k) -> str:
  """'K=4' for a chain ('K=auto' for the governor), 'tree=D,k,N' for a TreeSpec."""
  return f"K={k}" if isinstance(k, (int, str)) else f"tree={tree_text(k)}"


def measure_cell(setup, batch: int, temp: float, configs: list, costs: tuple, cost_capacity: int,
                 opts) -> tuple:
  """Warm-up, then `repeats` interleaved rounds of every configuration of one cell ->
  (baseline dict, rows)."""
  n = opts.batches_per_cell
  batches = [setup.ids[i * batch:(i + 1) * batch] for i in range(n)]
  cell = f"{setup.label} B={batch} T={temp:g}" + (f" ({n} batches per measurement)" if n > 1
                                                   else "")
  sampling = cell_sampling(temp, opts)
  log(f"[bench] {cell}: warm-up (compiles {len(configs)} configurations)")
  runs, tables = {}, {}
  for dspec, k in configs:
    if k == "auto":
      tables[dspec] = governor_table(setup, dspec, batch, temp, cost_capacity)
      table = tables[dspec][0]
      if table is not None:
        rel = ", ".join(f"{kk}: {v:.2f}" for kk, v in table.relative().items())
        log(f"[bench]   governor cost table for {drafter_label(dspec)} "
            f"({'from cache' if table.from_cache else 'measured'} in "
            f"{table.measure_seconds:.1f} s): t(K)/t(0) = {{{rel}}}")
    t0 = time.perf_counter()
    model = model_of(setup, dspec)
    run_k = cell_config(k, temp, setup.drafters.get(dspec), opts)
    run_batches(model, batches, setup.drafters.get(dspec), run_k, setup.max_new, sampling,
                opts.seed, cost_capacity)
    log(f"[bench]   warm {drafter_label(dspec)} {config_label(k)}: "
        f"{time.perf_counter() - t0:.1f} s")
    runs[(dspec, k)] = (lambda d=dspec, k=run_k, m=model: run_batches(
        m, batches, setup.drafters.get(d), k, setup.max_new, sampling, opts.seed,
        cost_capacity))

  def on_round(rep, res):
    plain = [s.tokens_per_second for s in res[configs[0]]]
    log(f"[bench] {cell}: round {rep + 1}/{opts.repeats}: plain "
        f"{plain[-2]:.0f}/{plain[-1]:.0f} tok/s; " + ", ".join(
            f"{drafter_label(c[0])} {config_label(c[1])} {res[c][-1].tokens_per_second:.0f}"
            for c in configs[1:]))
  results = interleaved_rounds(runs, opts.repeats, baseline=configs[0], on_round=on_round)
  base = summarize([s.tokens_per_second for s in results[configs[0]]])
  baseline = {"target": setup.label, "batch": batch, "temperature": temp,
              "tokens_per_s": base, "noise_pct": base["spread_pct"]}
  t1, tv, td = costs
  meta = {"target": setup.label, "target_spec": setup.spec,
          "target_params": setup.model.config.num_params, "batch": batch, "temperature": temp,
          "max_new_tokens": setup.max_new, "batches_per_cell": n,
          "draft_temperature_scale": draft_scale(opts),
          "prompt_tokens_longest": max(len(r) for b in batches for r in b),
          "cost_fill": setup.fill, "cost_capacity": cost_capacity}
  plains = {setup.model.config.dtype: base}
  for dt in setup.plain_models:
    plains[dt] = summarize([s.tokens_per_second for s in results[(PLAIN_IN + dt, 0)]])
  fastest = max(plains, key=lambda d: plains[d]["median"])
  baseline["plain_by_dtype"] = plains
  baseline["fastest_plain_dtype"] = fastest
  rows = []
  for dspec, k in configs:
    stats = results[(dspec, k)]
    tps = [s.tokens_per_second for s in stats]
    if k == "auto":
      table, kmax = tables[dspec]
      rows.append(governor_row(meta, dspec, stats, tps, base, t1, table, kmax))
    else:
      rows.append(spec_row(meta, dspec, k, stats, tps, base, t1, tv.get(k) if k else None,
                           td[dspec][k] if k else None))
    rows[-1]["dtype"] = model_of(setup, dspec).config.dtype
    rows[-1]["speedup_vs_fastest_plain"] = (statistics.median(tps) /
                                            plains[fastest]["median"])
    rows[-1]["fastest_plain_dtype"] = fastest
  add_governor_shares(rows)
  return baseline, rows


PLAIN_IN = "none@"         # the drafter spec of plain decoding in another dtype (plain_models)


def model_of(setup, dspec: str):
  """The target a configuration runs: setup.model, or setup.plain_models[dtype] for
  'none@DTYPE'."""
  if dspec.startswith(PLAIN_IN):
    return setup.plain_models[dspec[len(PLAIN_IN):]]
  return setup.model


def governor_kmax(setup, dspec: str) -> int:
  """The largest K the default governor may pick for this drafter."""
  return max(governor_lib.Governor().candidates(setup.drafters.get(dspec)))


def governor_table(setup, dspec: str, batch: int, temp: float, capacity: int) -> tuple:
  """The cost table generate(num_draft='auto') uses in this cell, and the largest candidate
  K -> (CostTable or None, K max). Measured here once (or read from this process's memory or
  the disk cache) at the cell's capacity, which generate() is given, so that its own
  calibration finds it instead of measuring a second table."""
  drafter = setup.drafters.get(dspec)
  gov = governor_lib.Governor()
  kmax = governor_kmax(setup, dspec)
  try:
    table = calibration.calibrate(setup.model, drafter, batch, capacity=capacity,
                                   greedy=temp == 0, governor=gov)
  except ValueError:
    table = None
  return table, kmax


def add_governor_shares(rows: list) -> None:
  """Each governor row of a cell gets best_fixed_K, best_fixed_speedup and share_of_best_fixed
  (its speedup / the best fixed K's speedup of the same drafter in the same cell)."""
  for r in rows:
    if r["K"] != "auto":
      continue
    fixed = [x for x in rows if x["drafter_spec"] == r["drafter_spec"] and
             isinstance(x["K"], int) and x["K"] > 0 and not x.get("tree")]
    if not fixed:
      r.update(best_fixed_K=None, best_fixed_speedup=None, share_of_best_fixed=None)
      continue
    best = max(fixed, key=lambda x: x["speedup"])
    r.update(best_fixed_K=best["K"], best_fixed_speedup=best["speedup"],
             share_of_best_fixed=r["speedup"] / best["speedup"])


def run_spec_suite(opts, checkpoint=None, previous=None) -> dict:
  """The spec suite. checkpoint(partial_result) is called after every finished cell (target,
  batch, temperature); cells found in `previous` (a partial result of the same options, see
  --resume) are taken from it instead of being measured again."""
  grid = grid_of(opts)
  rows, baselines, notes, done = [], [], [], set()
  if previous:
    rows = list(previous.get("rows", []))
    baselines = list(previous.get("baselines", []))
    notes = list(previous.get("notes", []))
    done = {(b["target"], b["batch"], b["temperature"]) for b in baselines}
    log(f"[bench] resuming: {len(done)} cells taken from the previous partial run")

  def partial():
    return {"suite": "spec", "rows": rows, "baselines": baselines,
            "verdicts": make_verdicts(rows, baselines),
            "governor": governor_verdicts(rows), "notes": notes,
            "definitions": SPEC_DEFINITIONS}

  for (target_spec, drafter_specs), dtype in [(p, d) for p in grid.by_target.items()
                                              for d in grid.dtypes]:
    label = model_label(target_spec) + ("" if dtype is None else " " + DTYPE_TAGS[dtype])
    if all((label, b, t) in done for b in grid.batches for t in grid.temps):
      continue
    log(f"[bench] loading target {target_spec}" + (f" in {dtype}" if dtype else ""))
    setup = prepare_target(target_spec, drafter_specs, opts, grid.ks,
                           max(grid.batches) * opts.batches_per_cell, dtype=dtype,
                           plain_dtypes=grid.plain_dtypes)
    if setup.note and not any(n.startswith(label + ": max_new_tokens") for n in notes):
      notes.append(setup.note)
      log("[bench] note: " + setup.note)
    # One KV capacity for every configuration of the cell, and the cost ratios timed at it
    # (generate's default bucket grows with K: plain ran at 512 beside K=2 at 1024).
    cost_capacity = engine_capacity(setup.longest, setup.max_new, max(
        [0] + list(grid.ks) + [t.cache_extent for t in grid.trees]
        + ([governor_kmax(setup, d) for d in drafter_specs] if grid.auto else [])))
    configs = [("none", 0)] + [(PLAIN_IN + dt, 0) for dt in setup.plain_models]
    configs += [(d, k) for d in drafter_specs for k in grid.ks]
    trees, tree_note = tree_configs(setup, grid.trees, label)
    configs += trees
    if tree_note and tree_note not in notes:
      notes.append(tree_note)
      log("[bench] note: " + tree_note)
    if grid.auto:
      configs += [(d, "auto") for d in drafter_specs]
    for batch in grid.batches:
      if all((label, batch, t) in done for t in grid.temps):
        continue
      log(f"[bench] {label} B={batch}: timing cost ratios "
          f"(fill {setup.fill}, capacity {cost_capacity})")
      costs = time_costs(setup, batch, grid.ks, cost_capacity, opts.cost_repeats, grid.trees)
      for temp in grid.temps:
        if (label, batch, temp) in done:
          continue
        baseline, cell_rows = measure_cell(setup, batch, temp, configs, costs, cost_capacity,
                                           opts)
        baselines.append(baseline)
        rows.extend(cell_rows)
        if checkpoint is not None:
          checkpoint(partial())
        # Every cell compiles its own executables (B and T are static): drop them, or a long run
        # with the governor's per-K loops exhausts the process's memory maps (LLVM "Cannot
        # allocate memory" after ~13 cells of `--pairs default -K 2 4 auto -B 1 16 32`).
        release_compiled()
  return partial()


def vs_fastest_plain(row) -> float:
  """A row's speedup over the fastest plain decoding of its cell (any dtype timed), what every
  verdict judges; a result written before that field existed: over plain in its own dtype."""
  s = row.get("speedup_vs_fastest_plain")
  return row["speedup"] if s is None else s


def make_verdicts(rows, baselines) -> list:
  """Per (target, drafter, temperature): the best K at every batch and how it compares with
  the fastest plain decoding there (`vs_fastest_plain`). 'within noise' when |speedup - 1| is
  under half the plain baseline's spread (max-min)/median in that cell."""
  noise = {(b["target"], b["batch"], b["temperature"]): b["noise_pct"] for b in baselines}
  groups: dict = {}
  for r in rows:
    if r["K"] == 0 or r["K"] == "auto":
      continue
    groups.setdefault((r["target"], r["drafter"], r["temperature"]), {}).setdefault(
        r["batch"], []).append(r)
  out = []
  for (target, drafter, temp), per_batch in groups.items():
    parts = []
    for batch in sorted(per_batch):
      best = max(per_batch[batch], key=vs_fastest_plain)
      nz = noise.get((target, batch, temp), 0.0)
      s = vs_fastest_plain(best)
      within = abs(s - 1.0) * 100 <= nz / 2
      judgement = ("beats plain" if s > 1 else "LOSES to plain") + (", within noise" if within
                                                                    else "")
      parts.append({"batch": batch, "best_K": best["K"] if not best.get("tree") else
                    f"tree {best['tree']}", "speedup": s, "beats_plain": s > 1.0,
                    "clear": not within, "noise_pct": nz, "judgement": judgement})
    out.append({"target": target, "drafter": drafter, "temperature": temp, "per_batch": parts,
                "beats_plain_at_batches": [p["batch"] for p in parts if p["beats_plain"]],
                "clearly_beats_plain_at_batches": [p["batch"] for p in parts
                                                   if p["beats_plain"] and p["clear"]]})
  return out


GOVERNOR_GOALS = {"vs_plain_at_batch_16_plus": 0.97, "share_of_best_fixed_at_batch_1": 0.95}


def governor_verdicts(rows) -> list:
  """Per governor row: its speedup over plain, its share of the best fixed K, its K histogram
  and whether it meets issue 9's goals (>= 0.97x plain at B >= 16; >= 0.95x the best fixed K
  at B = 1; a mixed batch: >= 0.97x plain and >= the best fixed K)."""
  out = []
  for r in rows:
    if r["K"] != "auto":
      continue
    goals = {}
    if r["batch"] >= 16:
      goals["vs_plain>=0.97"] = (vs_fastest_plain(r) >=
                                 GOVERNOR_GOALS["vs_plain_at_batch_16_plus"])
    if r["batch"] == 1 and r.get("share_of_best_fixed") is not None:
      goals["share_of_best_fixed>=0.95"] = (r["share_of_best_fixed"] >=
                                            GOVERNOR_GOALS["share_of_best_fixed_at_batch_1"])
    out.append({"target": r["target"], "drafter": r["drafter"], "temperature": r["temperature"],
                "batch": r["batch"], "speedup": r["speedup"],
                "speedup_vs_fastest_plain": vs_fastest_plain(r),
                "best_fixed_K": r.get("best_fixed_K"),
                "best_fixed_speedup": r.get("best_fixed_speedup"),
                "share_of_best_fixed": r.get("share_of_best_fixed"),
                "k_histogram": r["k_histogram"], "goals": goals, "noise_pct": r["noise_pct"]})
  return out
