"""The cost of the top-k / top-p filter on [N, V] logits: sampling's bisected thresholds (32
halvings each, a comparison and a sum over V per step) against the descending sort it replaced
(the reference in tests/test_sampling.py), jitted on this host, medians of interleaved repeats
(docs/sampling.md). Shapes: a verify's N = B (K + 1) rows over SmolLM2's and Llama-3's
vocabularies.

    python scripts/filter_cost.py --shapes 5x49152 40x49152 56x128256 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from spec_jax import sampling  # noqa: E402
from tests.test_sampling import _sorted_top_k_top_p  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", nargs="+", default=["5x49152", "40x49152", "56x128256"])
  p.add_argument("--top-k", type=int, default=50)
  p.add_argument("--top-p", type=float, default=0.9)
  p.add_argument("--repeats", type=int, default=15)
  args = p.parse_args(argv)
  for shape in args.shapes:
    n, v = (int(x) for x in shape.split("x"))
    logits = 3.0 * jax.random.normal(jax.random.key(0), (n, v))
    settings = {"top_p": (jnp.zeros((n, 1), jnp.int32), jnp.full((n, 1), args.top_p)),
                "top_k+top_p": (jnp.full((n, 1), args.top_k, jnp.int32),
                                jnp.full((n, 1), args.top_p))}
    for what, (top_k, top_p) in settings.items():
      fns = {"bisect": jax.jit(sampling._top_k_top_p), "sort": jax.jit(_sorted_top_k_top_p)}
      outs = {name: f(logits, top_k, top_p).block_until_ready() for name, f in fns.items()}
      same = bool(jnp.array_equal(outs["bisect"], outs["sort"]))
      times = {name: [] for name in fns}
      for _ in range(args.repeats):
        for name, f in fns.items():
          t0 = time.perf_counter()
          f(logits, top_k, top_p).block_until_ready()
          times[name].append(time.perf_counter() - t0)
      row = {"rows": n, "vocab": v, "filters": what, "same_output": same}
      for name, t in times.items():
        row[f"{name}_ms"] = round(1e3 * statistics.median(t), 3)
      row["sort_over_bisect"] = round(row["sort_ms"] / row["bisect_ms"], 2)
      print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
