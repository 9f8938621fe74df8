"""The cost of one target forward over T = 1..17 rows, per dtype and weight orientation, in the
whole model (not a matmul microbenchmark): what decides the CPU execution layout
(spec_jax.models.llama.layout.cpu_orientation) and what c_verify can be.

    python scripts/step_layouts.py [--model widened:../shared/models/stories260K] [--repeats 7]

For every (dtype, orientation) the target's params are prepared once in that layout; every
(dtype, orientation, T) forward runs `--steps` times in one jitted fori_loop at a cache fill of
`--fill` (the KV written in place, as in decode), all configurations round-robin, `--repeats`
rounds; the table gives the median ms per forward and, per dtype, c(T) = t(T) / the fastest
one-row forward of that dtype over all orientations. Each orientation's memory: [out, in] or
[in, out] hold one copy of the projections, "both" two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from spec_jax.bench.specs import load_model            # noqa: E402
from spec_jax.models.llama import layout              # noqa: E402
from spec_jax.models.cache import KVCache             # noqa: E402
from spec_jax.models.transformer import forward        # noqa: E402
from spec_jax.timing import interleaved_rounds         # noqa: E402


def prepared(params, orientation: str):
  transpose = {"out_in": True, "in_out": False, "both": "both"}[orientation]

  def prep(p):
    out = dict(p)
    out["layers"] = layout.fuse_layers(p["layers"], transpose=transpose,
                                       chunks=layout.cpu_weight_chunks())
    if transpose and "lm_head" in out:
      out["lm_head_t"] = jnp.swapaxes(out["lm_head"], 0, 1)
      if transpose is True:
        del out["lm_head"]
    return layout.unstack_layers(out)
  return jax.block_until_ready(jax.jit(prep)(params))


def loop_fn(config):
  def run(params, tokens, cache, offsets, n):
    def body(_, carry):
      toks, c = carry
      out = forward(params, config, toks, c, offsets)
      return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache
    return jax.lax.fori_loop(0, n, body, (tokens, cache))
  return jax.jit(run, donate_argnums=(2,))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="widened:../shared/models/stories260K")
  ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                  help="bfloat16, float32, or bf16-weights (bf16 weights, float32 activations "
                  "and KV cache: config.dtype float32 with bf16 params)")
  ap.add_argument("--orientations", nargs="+", default=list(layout.ORIENTATIONS))
  ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 5, 9, 17])
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--fill", type=int, default=64)
  ap.add_argument("--capacity", type=int, default=128)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)

  base = load_model(args.model)
  runs, meta = {}, {}
  for dtype in args.dtypes:
    act = "float32" if dtype == "bf16-weights" else dtype
    wdt = "bfloat16" if dtype == "bf16-weights" else dtype
    config = base.config.replace(dtype=act)
    params = jax.tree.map(lambda x: x.astype(wdt), base.params)
    fn = loop_fn(config)
    for orient in args.orientations:
      p = prepared(params, orient)
      nbytes = sum(x.nbytes for x in jax.tree.leaves(p))
      meta[(dtype, orient)] = nbytes
      for t in args.rows:
        toks = jnp.ones((args.batch, t), jnp.int32)
        offsets = jnp.full((args.batch,), args.fill, jnp.int32)

        def call(p=p, toks=toks, offsets=offsets, fn=fn, config=config):
          cache = KVCache.zeros(config, args.batch, args.capacity)
          jax.block_until_ready(cache)
          t0 = time.perf_counter()
          jax.block_until_ready(fn(p, toks, cache, offsets, args.steps))
          return (time.perf_counter() - t0) / args.steps
        call()                                          # compile + warm
        runs[(dtype, orient, t)] = call
      print(f"[layouts] {dtype} {orient}: compiled ({nbytes / 1e6:.0f} MB of params)",
            file=sys.stderr, flush=True)
  results = interleaved_rounds(runs, args.repeats)
  ms = {k: 1e3 * statistics.median(v) for k, v in results.items()}
  spread = {k: (max(v) - min(v)) / statistics.median(v) * 100 for k, v in results.items()}
  print(f"model {args.model}, B={args.batch}, fill {args.fill}, capacity {args.capacity}, "
        f"{args.steps} forwards per call, median of {args.repeats} round-robin rounds")
  head = "| dtype | orientation | MB | " + " | ".join(f"T={t}" for t in args.rows) + " |"
  print(head)
  print("|" + "---|" * (3 + len(args.rows)))
  for dtype in args.dtypes:
    best1 = min(ms[(dtype, o, 1)] for o in args.orientations if (dtype, o, 1) in ms)
    for orient in args.orientations:
      cells = [f"{ms[(dtype, orient, t)]:.2f} ({ms[(dtype, orient, t)] / best1:.2f})"
               for t in args.rows]
      print(f"| {dtype} | {orient} | {meta[(dtype, orient)] / 1e6:.0f} | " + " | ".join(cells)
            + " |")
  print("cells: ms per forward (c(T) against the dtype's fastest one-row forward); spread "
        f"(max-min)/median: {min(spread.values()):.0f}-{max(spread.values()):.0f} %")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "ms": {"|".join(map(str, k)): v for k, v in ms.items()},
                 "spread_pct": {"|".join(map(str, k)): v for k, v in spread.items()}}, f,
                indent=1)


if __name__ == "__main__":
  main()
