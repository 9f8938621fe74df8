"""Overhead of sj.generate over a bare jitted sj.decode call (issue 16's goal: <= 5 %).

    python scripts/generate_overhead.py [--model ../shared/models/stories260K] [--repeats 21] [--block 1]

Both run the same compiled loop: stories260K, batch 1, 128 new tokens, plain decoding and
salty279K with K = 4, greedy. generate() is timed as its caller sees it (wall clock of the
whole call: prompt preparation, the cached AOT executable, the host copy of the result,
detokenising); decode is one call of the user's own jax.jit plus block_until_ready. The two
alternate (call by call, or in blocks of --block calls each), medians over all calls; the
spread (max - min) / median of each is printed.
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp

import spec_jax as sj
from spec_jax.decoding.prompts import prepare_batch


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="../shared/models/stories260K")
  ap.add_argument("--draft", default="../shared/models/salty279K")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=21)
  ap.add_argument("--block", type=int, default=1,
                  help="calls of each in a row (1: the two alternate call by call; B > 1: B "
                       "decode calls, then B generate calls, as a loop over either makes them)")
  args = ap.parse_args()
  target = sj.load(args.model)
  draft = sj.drafters.DraftModel(sj.load(args.draft))
  prompts = ["Once upon a time"]
  greedy = sj.Sampling(0.0)
  for drafter, k in ((None, 0), (draft, 4)):
    ids = [target.tokenizer.encode(p) for p in prompts]
    toks, lens, capacity = prepare_batch(target, ids, args.max_new_tokens, k)
    toks, lens = jnp.asarray(toks), jnp.asarray(lens)
    run = jax.jit(functools.partial(
        sj.decode, config=target.config, drafter=drafter, num_draft=max(k, 1),
        max_new_tokens=args.max_new_tokens, capacity=capacity, sampling=greedy.as_arrays(1),
        stop_tokens=(), greedy=True))
    dparams = None if drafter is None else drafter.params
    key = jax.random.key(0)
    call_decode = lambda: jax.block_until_ready(
        run(target.params, toks, lens, key, drafter_params=dparams).lengths)
    call_generate = lambda: sj.generate(target, prompts, drafter=drafter, num_draft=max(k, 1),
                                        max_new_tokens=args.max_new_tokens, sampling=greedy,
                                        stop_tokens=[])
    call_decode(), call_generate()                       # compile both
    times = {"decode": [], "generate": [], "host": []}
    for _ in range(args.repeats):
      for name, fn in (("decode", call_decode), ("generate", call_generate)):
        for _ in range(args.block):
          start = time.perf_counter()
          out = fn()
          times[name].append(time.perf_counter() - start)
          if name == "generate":   # its own work around the compiled call: prompts, results, text
            times["host"].append(times["generate"][-1] - out.stats.seconds)
    med = {n: statistics.median(v) for n, v in times.items()}
    spread = {n: (max(v) - min(v)) / med[n] for n, v in times.items()}
    # Paired call by call (neighbouring calls share the machine's state), then the median.
    paired = statistics.median(g / d - 1 for g, d in zip(times["generate"], times["decode"]))
    label = "plain" if drafter is None else f"salty279K K={k}"
    print(f"{label}: decode {med['decode'] * 1e3:.2f} ms (spread {spread['decode']:.0%}), "
          f"generate {med['generate'] * 1e3:.2f} ms (spread {spread['generate']:.0%}) -> "
          f"overhead {med['generate'] / med['decode'] - 1:+.1%} (paired median {paired:+.1%}); "
          f"host work in generate {med['host'] * 1e3:.2f} ms = "
          f"{med['host'] / med['decode']:.1%} of decode", flush=True)


if __name__ == "__main__":
  main()
