"""num_draft="auto" (the governor) against plain decoding and fixed K, side by side.

For each batch size: plain decoding, every drafter at each fixed K and the governor
(calibrated first, outside the timing, as generate() does), all round-robin in one process
(spec_jax.timing.interleaved_rounds; plain brackets every round). Prints tok/s medians, each
configuration's speedup over plain (median of per-round ratios), the governor's share of the
best fixed K, its K histogram and its cost table; writes the numbers as JSON.

    python scripts/auto_vs_plain.py --batch 16 32 -K 2 --dtype float32 --max-new-tokens 64 \\
        --pairs draft:../shared/models/salty279K heads:runs/eagle3_fused dflash:runs/dflash

The target is widened stories260K (configs/bench_widened.yaml's); prompts are TinyStories
openings (8 words). Noise: the spread of plain's bracketing calls, in percent of its median.

--learn-prior adds a column per governor: the same governor started from the acceptance it
learned in untimed calls of B rows on max(B, 8) other prompts (the next openings, disjoint from
the timed ones; the calls' estimates averaged), passed as generate(acceptance_prior=...) to
every timed call, as a server would pool it over earlier requests (spec_jax.governor: no
drafted warm-up rounds then). --prior says which: `pooled` (the calls' stats.position_acceptance
averaged) or `rows` (every learning row's stats.row_acceptance: the spread, which the slowest-row
objective reads as a mixture); one column each. --learn-rows sets how many other prompts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

import spec_jax as sj
from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.specs import load_model, make_drafter
from spec_jax.decoding import calibration
from spec_jax.decoding.prompts import default_capacity
from spec_jax.files import atomic_write_json
from spec_jax.timing import interleaved_rounds


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default="widened:../shared/models/stories260K")
  ap.add_argument("--pairs", nargs="+", required=True, help="drafter specs")
  ap.add_argument("--batch", type=int, nargs="+", default=[16])
  ap.add_argument("-K", type=int, nargs="*", default=[2])
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--ks", type=int, nargs="*", default=None,
                  help="the governor's candidate K (default: its own)")
  ap.add_argument("--cost-repeats", type=int, default=3,
                  help="timed rounds per K of the governor's cost table (sj.calibrate)")
  ap.add_argument("--objectives", nargs="+", default=["slowest"], choices=["mean", "slowest"],
                  help="one governor column per objective (the cost table is shared)")
  ap.add_argument("--learn-prior", action="store_true",
                  help="add a column per governor started from an acceptance learned on other "
                       "prompts (generate's acceptance_prior)")
  ap.add_argument("--prior", nargs="+", default=["pooled"], choices=["pooled", "rows"],
                  help="with --learn-prior: the pooled estimate and/or the rows' spread, a "
                       "column each")
  ap.add_argument("--learn-rows", type=int, default=None,
                  help="with --learn-prior: other prompts the prior is learned on (rounded up "
                       "to whole batches; default max(B, 8))")
  ap.add_argument("--out", default="auto_vs_plain.json")
  args = ap.parse_args(argv)

  target = load_model(args.target, dtype=args.dtype)
  drafters = {d: make_drafter(d, target) for d in args.pairs}
  gov_opts = {} if args.ks is None else {"ks": tuple(args.ks)}
  sampling = sj.Sampling(temperature=args.temperature)
  report = {"target": args.target, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "repeats": args.repeats, "cells": []}
  for b in args.batch:
    n_learn = -(-(args.learn_rows or max(b, 8)) // b) * b
    both, _ = prompt_token_lists(target, "tinystories", b + n_learn, 8, 128, 0)
    prompts, other_prompts = both[:b], both[b:]    # timed; where a prior is learned
    kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, stop_tokens=[],
              key=jax.random.key(0))
    runs = {}
    runs["plain"] = lambda: sj.generate(target, prompts, **kw)
    for d, dr in drafters.items():
      for k in args.K:
        runs[(d, k)] = lambda dr=dr, k=k: sj.generate(target, prompts, drafter=dr,
                                                      num_draft=k, **kw)
      t0 = time.perf_counter()              # the table generate() reads (same capacity)
      gov = sj.Governor(**gov_opts)
      capacity = default_capacity(target, prompts, args.max_new_tokens,
                                  max(gov.candidates(dr)))
      calibration.calibrate(target, dr, b, capacity=capacity, greedy=args.temperature == 0,
                            governor=gov, repeats=args.cost_repeats)
      print(f"[B={b}] {d}: cost table in {time.perf_counter() - t0:.0f} s", flush=True)
      for obj in args.objectives:
        t0 = time.perf_counter()
        gov = sj.Governor(objective=obj, **gov_opts)
        sj.generate(target, prompts, drafter=dr, num_draft="auto", governor=gov, **kw)
        runs[(d, "auto-" + obj)] = lambda dr=dr, gov=gov: sj.generate(
            target, prompts, drafter=dr, num_draft="auto", governor=gov, **kw)
        print(f"[B={b}] {d}: governor ({obj}) calibrated and warm in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        if args.learn_prior:
          stats = [sj.generate(target, other_prompts[i:i + b], drafter=dr, num_draft="auto",
                               governor=gov, **kw).stats
                   for i in range(0, len(other_prompts), b)]
          learned = {
              "pooled": [sum(col) / len(col)
                         for col in zip(*(st.position_acceptance for st in stats))],
              "rows": [list(r) for st in stats for r in st.row_acceptance]}
          for kind in args.prior:
            report.setdefault("learned_priors", {})[f"B={b} {d} {obj} {kind}"] = learned[kind]
            shown = (learned[kind] if kind == "pooled" else
                     f"{len(learned[kind])} rows, first-position alpha min "
                     f"{min(r[0] for r in learned[kind]):.3f}")
            print(f"[B={b}] {d}: acceptance ({kind}) learned on {len(other_prompts)} other "
                  f"prompts: {shown}", flush=True)
            suffix = "+prior" if kind == "pooled" else "+rows"
            runs[(d, "auto-" + obj + suffix)] = lambda dr=dr, gov=gov, p=learned[kind]: \
                sj.generate(target, prompts, drafter=dr, num_draft="auto", governor=gov,
                            acceptance_prior=p, **kw)
    for name, run in runs.items():                      # compile and warm
      t0 = time.perf_counter()
      run()
      print(f"[B={b}] warm {name}: {time.perf_counter() - t0:.1f} s", flush=True)

    def timed(run):
      def go():
        t0 = time.perf_counter()
        out = run()
        return time.perf_counter() - t0, out
      return go

    res = interleaved_rounds({n: timed(r) for n, r in runs.items()}, args.repeats,
                             baseline="plain")
    atomic_write_json(args.out + f".raw_B{b}.json",
                      {str(n): [s for s, _ in v] for n, v in res.items()})
    plain_s = [s for s, _ in res["plain"]]
    tokens = b * args.max_new_tokens
    cell = {"batch": b, "plain_tok_s": tokens / statistics.median(plain_s),
            "noise_pct": 100 * (max(plain_s) - min(plain_s)) / statistics.median(plain_s),
            "rows": []}
    # Per round r the configuration's call sits between plain's calls 2r and 2r+1.
    for name, vals in res.items():
      if name == "plain":
        continue
      ratios = [0.5 * (plain_s[2 * r] + plain_s[2 * r + 1]) / s for r, (s, _) in enumerate(vals)]
      last = vals[-1][1]
      cell["rows"].append({
          "drafter": name[0], "K": name[1], "tok_s": tokens / statistics.median(
              [s for s, _ in vals]),
          "speedup": statistics.median(ratios), "tau": last.stats.mean_accepted_length,
          "iterations": last.stats.iterations,
          "k_histogram": {str(k): n for k, n in (last.stats.k_histogram or {}).items()}})
    is_auto = lambda r: str(r["K"]).startswith("auto")
    for d in drafters:
      fixed = [r for r in cell["rows"] if r["drafter"] == d and not is_auto(r)]
      best = max(fixed, key=lambda r: r["speedup"]) if fixed else None
      for auto in [r for r in cell["rows"] if r["drafter"] == d and is_auto(r)]:
        auto["best_fixed"] = None if best is None else best["K"]
        auto["share_of_best_fixed"] = None if best is None else (
            auto["speedup"] / best["speedup"])
        auto["share_of_best_fixed_or_plain"] = None if best is None else (
            auto["speedup"] / max(best["speedup"], 1.0))
    report["cells"].append(cell)
    print(f"\nB={b}: plain {cell['plain_tok_s']:.1f} tok/s, noise {cell['noise_pct']:.0f} %")
    for r in cell["rows"]:
      extra = ""
      if is_auto(r) and r["best_fixed"] is not None:
        extra = (f"  share of best K {r['share_of_best_fixed']:.2f}, of best K or plain "
                 f"{r['share_of_best_fixed_or_plain']:.2f}")
      if is_auto(r):
        extra += f"  K rounds {r['k_histogram']}"
      print(f"  {r['drafter']:<40} K={r['K']!s:<12} {r['tok_s']:8.1f} tok/s  "
            f"{r['speedup']:.2f}x  tau {r['tau']:.2f}  iters {r['iterations']}{extra}",
            flush=True)
    report["cost_tables"] = [t.as_dict() for t in calibration._TABLES.values()]
    atomic_write_json(args.out, report)


if __name__ == "__main__":
  main()
