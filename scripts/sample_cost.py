"""The cost of drawing one token per row from a [B, V] distribution: sampling.sample (two-level
inverse transform) against Gumbel-max (`jax.random.categorical`, what sampling.sample was), on
SmolLM2's vocabulary, jitted, medians of interleaved repeats (docs/sampling.md).

    python scripts/sample_cost.py --vocab 49152 --batch 1 8 128 --repeats 50
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


def gumbel_max(key, probabilities):
  return jax.random.categorical(key, jnp.log(jnp.maximum(probabilities, 0.0)), axis=-1)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--vocab", type=int, default=49152)
  p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 128])
  p.add_argument("--repeats", type=int, default=50)
  args = p.parse_args(argv)
  rows = []
  for b in args.batch:
    probs = jax.nn.softmax(2.0 * jax.random.normal(jax.random.key(0), (b, args.vocab)), -1)
    fns = {"two_level": jax.jit(sampling.sample), "gumbel_max": jax.jit(gumbel_max)}
    times = {name: [] for name in fns}
    for f in fns.values():
      f(jax.random.key(0), probs).block_until_ready()
    for i in range(args.repeats):
      for name, f in fns.items():
        t0 = time.perf_counter()
        f(jax.random.key(i), probs).block_until_ready()
        times[name].append(time.perf_counter() - t0)
    row = {"batch": b, "vocab": args.vocab}
    for name, t in times.items():
      row[f"{name}_ms"] = 1e3 * statistics.median(t)
    row["ratio"] = row["gumbel_max_ms"] / row["two_level_ms"]
    rows.append(row)
    print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
