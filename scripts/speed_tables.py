"""The README's speed table and plot from spec-suite JSON files (python -m spec_jax.bench --out).

    python scripts/speed_tables.py RUN.json [RUN.json ...] [--plot docs/speedup_vs_batch.png]

Per batch size and temperature, every drafter's best row (fixed K or tree, by its speedup over
the fastest plain decoding of any dtype timed in the same cell), with tau, c_verify, the bound
tau / (K c_draft + c_verify) and the efficiency (speedup / bound); the governor's `auto` row
beside it where one was run. The plot: greedy speedup vs batch size per drafter (best fixed K; the governor was not
run at every batch size, so it is in the table only),
plain decoding at 1.0x. A cell measured again in a later file replaces the earlier one.
Rows are read as the bench wrote them: nothing is recomputed but the
choice of the best row.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from spec_jax.bench.tables import fmt, table


def drafter_name(spec: str) -> str:
  return {"ngram": "n-gram", "draft:../shared/models/salty279K": "salty279K draft model",
          "heads:runs/eagle3_fused": "EAGLE-3 heads (fused)",
          "dflash:runs/dflash": "DFlash (block 8)"}.get(spec, spec)


def load_rows(paths):
  """Every speculative row of the files; a (batch, temperature, drafter) cell measured in a
  later file replaces that cell of an earlier one (a rerun)."""
  cells = {}
  for path in paths:
    with open(path) as f:
      res = json.load(f)
    mine = defaultdict(list)
    for r in res["rows"]:
      if r["K"] != 0 or r.get("tree"):
        mine[(r["batch"], r["temperature"], r["drafter_spec"])].append(dict(r, source=path))
    cells.update(mine)
  return [r for rs in cells.values() for r in rs]


def label(r) -> str:
  if r.get("tree"):
    return f"tree {r['tree']}"
  return f"K={r['K']}"


def best_rows(rows):
  """(batch, temperature, drafter spec) -> (best fixed row, auto row or None)."""
  cells = defaultdict(list)
  for r in rows:
    cells[(r["batch"], r["temperature"], r["drafter_spec"])].append(r)
  out = {}
  for key, rs in sorted(cells.items()):
    fixed = [r for r in rs if r["K"] != "auto"]
    auto = [r for r in rs if r["K"] == "auto"]
    best = max(fixed, key=lambda r: r["speedup_vs_fastest_plain"]) if fixed else None
    out[key] = (best, auto[0] if auto else None)
  return out


def markdown(best) -> str:
  head = ["B", "T", "drafter", "best", "tok/s", "vs fastest plain", "vs bf16 plain", "tau",
          "c_verify", "bound", "efficiency", "auto", "noise %"]
  body = []
  for (b, t, spec), (r, auto) in best.items():
    if r is None:
      continue
    body.append([b, fmt(t, 0), drafter_name(spec), label(r), fmt(r["tokens_per_s"]["median"], 1),
                 f"{r['speedup_vs_fastest_plain']:.2f}x" + (" LOSS" if r["speedup_vs_fastest_plain"] < 1
                                                            else ""),
                 f"{r['speedup']:.2f}x", fmt(r["tau"]), fmt(r["c_verify"]), fmt(r["bound"]),
                 fmt(r["efficiency"]),
                 "-" if auto is None else f"{auto['speedup_vs_fastest_plain']:.2f}x",
                 fmt(r["noise_pct"], 0)])
  return table(head, body, markdown=True)


def plot(best, path) -> None:
  from spec_jax.bench import plots
  series = defaultdict(list)
  for (b, t, spec), (r, auto) in best.items():
    if t == 0 and r is not None and not r.get("tree"):
      series[f"{drafter_name(spec)}, best K"].append((b, r["speedup_vs_fastest_plain"]))
  series = {k: v for k, v in series.items() if len(v) > 1}
  plots.speedup_vs_batch(series, "widened stories260K (78M, bf16 weights) on a 2-core CPU, greedy:"
                         " speedup over the fastest plain decoding", path)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("runs", nargs="+")
  ap.add_argument("--plot", default=None)
  a = ap.parse_args(argv)
  best = best_rows(load_rows(a.runs))
  print(markdown(best))
  if a.plot:
    plot(best, a.plot)
    print(f"wrote {a.plot}")


if __name__ == "__main__":
  main()
