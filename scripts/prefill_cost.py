"""What a call pays before its first round: prefill-only calls (max_new_tokens=1) of plain
decoding, of each drafter at K = 1 and of the governor started plain (an acceptance prior of
0: the drafter's prompt work skipped), side by side, medians of 7 round-robin repeats.

    python scripts/prefill_cost.py --batch 32 --pairs dflash:runs/dflash heads:runs/eagle3_fused

The target is widened stories260K in float32; prompts are TinyStories openings (8 words) in a
buffer padded to the cache capacity, as generate() pads them.
"""

from __future__ import annotations

import argparse
import statistics

import jax

import spec_jax as sj
from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.specs import load_model, make_drafter


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default="widened:../shared/models/stories260K")
  ap.add_argument("--pairs", nargs="+", required=True, help="drafter specs")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--repeats", type=int, default=7)
  args = ap.parse_args(argv)
  target = load_model(args.target, dtype=args.dtype)
  prompts, _ = prompt_token_lists(target, "tinystories", args.batch, 8, 128, 0)
  kw = dict(max_new_tokens=1, sampling=sj.Sampling(temperature=0.0), stop_tokens=[],
            key=jax.random.key(0))
  gov = sj.Governor(ks=(0, 1, 2, 4), costs={0: 1.0, 1: 1.1, 2: 1.2, 4: 1.4})
  runs = {"plain": lambda: sj.generate(target, prompts, **kw)}
  for spec in args.pairs:
    dr = make_drafter(spec, target)
    runs[f"{spec} auto, started plain"] = lambda dr=dr: sj.generate(
        target, prompts, drafter=dr, num_draft="auto", governor=gov, acceptance_prior=[0.0],
        **kw)
    runs[f"{spec} K=1"] = lambda dr=dr: sj.generate(target, prompts, drafter=dr, num_draft=1,
                                                    **kw)
  for run in runs.values():              # compile and warm
    run()
    run()
  seconds = {name: [] for name in runs}
  for _ in range(args.repeats):
    for name, run in runs.items():
      seconds[name].append(run().stats.seconds)
  for name, vals in seconds.items():
    print(f"{name:48s} median {1e3 * statistics.median(vals):8.1f} ms   "
          f"min {1e3 * min(vals):8.1f} ms")


if __name__ == "__main__":
  main()
