"""XLA:CPU's dot for the rows of decode and verify: 48 weights of 768 x 2048 (the widened
model's projections, 151 MB in bf16) read by T = 1..17 rows, per dtype, weight orientation and
accumulation — the microbenchmark behind the bf16 regime (docs/speed.md).

    python scripts/bf16_dots.py [--repeats 9] [--rows 1 2 3 5 9 17] [--json out.json]

Every configuration is one jit over the 48 weights (x [T, in] against each weight, the results
summed so none is dead code), all configurations round-robin; the table gives the median ms per
call and the spread. `--fresh-process` times every configuration's first call in a fresh
interpreter too (the one-row bf16 path was once seen at 10x its usual time on a first run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

N_WEIGHTS, D_IN, D_OUT = 48, 768, 2048
CONFIGS = {
    # name: (weight dtype, weights stored [out, in], preferred element type)
    "f32 [out,in]": ("float32", True, None),
    "f32 [in,out]": ("float32", False, None),
    "bf16 [out,in] -> bf16": ("bfloat16", True, None),
    "bf16 [out,in] -> f32 acc": ("bfloat16", True, "float32"),
    "bf16 [in,out] -> f32 acc": ("bfloat16", False, "float32"),
}


def make_call(name: str, t: int):
  dtype, out_in, preferred = CONFIGS[name]
  rng = np.random.default_rng(0)
  shape = (D_OUT, D_IN) if out_in else (D_IN, D_OUT)
  ws = [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)
        for _ in range(N_WEIGHTS)]
  x = jnp.asarray(rng.standard_normal((t, D_IN), np.float32), dtype)
  contract = 1 if out_in else 0
  pref = None if preferred is None else jnp.dtype(preferred)

  @jax.jit
  def run(x, ws):
    total = jnp.zeros((t, D_OUT), jnp.float32)
    for w in ws:
      y = jax.lax.dot_general(x, w, (((1,), (contract,)), ((), ())), preferred_element_type=pref)
      total = total + y.astype(jnp.float32)
    return total

  jax.block_until_ready(run(x, ws))

  def call():
    t0 = time.perf_counter()
    jax.block_until_ready(run(x, ws))
    return time.perf_counter() - t0
  return call


def first_call_in_a_fresh_process(name: str, t: int) -> float:
  code = (f"import sys, time; sys.path.insert(0, {repr(sys.path[0])}); import bf16_dots as b; "
          f"c = b.make_call({name!r}, {t}); print(c())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=sys.path[0], timeout=600)
  return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 5, 9, 17])
  ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
  ap.add_argument("--repeats", type=int, default=9)
  ap.add_argument("--fresh-process", action="store_true")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  calls = {(c, t): make_call(c, t) for c in args.configs for t in args.rows}
  results = {k: [] for k in calls}
  for _ in range(args.repeats):
    for k, call in calls.items():
      results[k].append(call())
  ms = {k: 1e3 * statistics.median(v) for k, v in results.items()}
  spread = {k: 100 * (max(v) - min(v)) / statistics.median(v) for k, v in results.items()}
  print(f"{N_WEIGHTS} weights {D_IN}x{D_OUT}, median of {args.repeats} round-robin calls, ms "
        "(spread %)")
  print("| weights, layout, dot | " + " | ".join(f"T={t}" for t in args.rows) + " |")
  print("|---|" + "---|" * len(args.rows))
  for c in args.configs:
    print(f"| {c} | " + " | ".join(f"{ms[(c, t)]:.1f} ({spread[(c, t)]:.0f})" for t in args.rows)
          + " |")
  fresh = {}
  if args.fresh_process:
    for c in args.configs:
      fresh[c] = first_call_in_a_fresh_process(c, 1) * 1e3
      print(f"first warm call in a fresh process, {c}, T=1: {fresh[c]:.1f} ms")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"ms": {f"{c}|{t}": v for (c, t), v in ms.items()},
                 "spread_pct": {f"{c}|{t}": v for (c, t), v in spread.items()},
                 "fresh_first_call_ms": fresh}, f, indent=1)


if __name__ == "__main__":
  main()
