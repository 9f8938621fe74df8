"""A draft model's chain on this CPU: its draft steps unrolled against rolled as a
`lax.fori_loop` (what a decode lowered for TPU or CPU runs: DraftModel.rolls_steps_on,
decoding.loop.rolls_draft_steps).

    python scripts/rolled_draft_steps.py [--repeats 9] [-K 4] [--max-new-tokens 64]

Widened stories260K in bfloat16 with salty279K, B = 1, greedy and T = 1. The two programs
(`rolls_steps_on=("cpu",)` and `()`, two executables) alternate, the unrolled one bracketing
each rolled call (spec_jax.timing.interleaved_rounds); printed: medians, the median of the
paired ratios rolled / mean(bracketing unrolled), the unrolled calls' spread, and whether both
drew the same tokens (they must).
"""

import argparse
import statistics
import time

import jax

import spec_jax as sj
from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.specs import load_model, make_drafter
from spec_jax.decoding import loop
from spec_jax.timing import interleaved_rounds


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default="widened:../shared/models/stories260K")
  ap.add_argument("--draft", default="draft:../shared/models/salty279K")
  ap.add_argument("-K", type=int, default=4)
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=9)
  args = ap.parse_args()

  target = load_model(args.target, dtype="bfloat16")
  drafter = make_drafter(args.draft, target)
  rolled_drafter = drafter.replace(rolls_steps_on=("cpu",))
  unrolled_drafter = drafter.replace(rolls_steps_on=())
  assert loop.rolls_draft_steps(rolled_drafter) and not loop.rolls_draft_steps(unrolled_drafter)
  prompts, _ = prompt_token_lists(target, "tinystories", 1, 8, 128, 0)
  for temperature in (0.0, 1.0):
    def call(drafter):
      def go():
        t0 = time.perf_counter()
        out = sj.generate(target, prompts, drafter=drafter, num_draft=args.K,
                          max_new_tokens=args.max_new_tokens, stop_tokens=[],
                          sampling=sj.Sampling(temperature), key=jax.random.key(0))
        return time.perf_counter() - t0, out.tokens
      return go

    runs = {"unrolled": call(unrolled_drafter), "rolled": call(rolled_drafter)}
    for run in runs.values():                      # compile, then one warm call
      run(), run()
    got = interleaved_rounds(runs, args.repeats, baseline="unrolled")
    u = [s for s, _ in got["unrolled"]]
    r = [s for s, _ in got["rolled"]]
    ratios = [r[i] / ((u[2 * i] + u[2 * i + 1]) / 2) for i in range(args.repeats)]
    same = got["unrolled"][0][1] == got["rolled"][0][1]
    print(f"T = {temperature}: unrolled {statistics.median(u) * 1e3:.1f} ms, rolled "
          f"{statistics.median(r) * 1e3:.1f} ms (medians); rolled / unrolled "
          f"{statistics.median(ratios):.3f} (paired, {min(ratios):.3f}-{max(ratios):.3f}); "
          f"unrolled spread {(max(u) - min(u)) / statistics.median(u):.0%}; "
          f"same tokens: {same}", flush=True)


if __name__ == "__main__":
  main()
