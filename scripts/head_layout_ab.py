"""A feature head's CPU execution layout against its canonical one, interleaved in one process:
plain decoding, the head with FeatureHead.prepare (layer fused and [out, in], like the
target's) and the same head with its weights as stored ([in, out]), round-robin, each
repeat four B = 1 generate() calls (64 new tokens) on the widened stories260K target in bf16.
Reports the medians and the paired per-repeat ratios (this VM's noise is 10-30 %).

    python scripts/head_layout_ab.py --drafter heads:runs/eagle3_fused -K 4 --repeats 11
"""

from __future__ import annotations

import argparse
import copy
import sys

import numpy as np


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--drafter", default="heads:runs/eagle3_fused")
  ap.add_argument("-K", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=11)
  ap.add_argument("--temperature", type=float, default=0.0)
  args = ap.parse_args(argv)
  import jax
  sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
  import spec_jax as sj
  from spec_jax.bench.prompts import prompt_token_lists
  from spec_jax.bench.specs import load_model, make_drafter
  from spec_jax.drafters.feature_head import FeatureHead

  target = load_model("widened:../shared/models/stories260K", dtype="bfloat16")
  head = make_drafter(args.drafter, target)
  if not isinstance(head, FeatureHead):
    raise SystemExit(f"{args.drafter} is not a feature head (EAGLE, EAGLE-3, MTP)")
  # The same head with the base class's prepare (weights as stored); another class, so another
  # compiled program.
  stored = type("Stored" + type(head).__name__, (type(head),), {"prepare": lambda s, p: p})
  as_stored = copy.copy(head)
  object.__setattr__(as_stored, "__class__", stored)
  prompts, _ = prompt_token_lists(target, "tinystories", 4, 8, 64, 0)
  variants = {"plain": None, "execution layout": head, "as stored": as_stored}

  def call(d, i):
    return sj.generate(target, [prompts[i]], drafter=d, num_draft=args.K if d else 4,
                       max_new_tokens=64, capacity=128, stop_tokens=[],
                       sampling=sj.Sampling(temperature=args.temperature), key=jax.random.key(i))

  first = {n: [call(d, i) for i in range(4)] for n, d in variants.items()}
  if args.temperature == 0:
    same = all(np.array_equal(a.tokens, b.tokens) for n in ("execution layout", "as stored")
               for a, b in zip(first[n], first["plain"]))
    print("greedy output equals plain greedy:", same)
  seconds = {n: [] for n in variants}
  for _ in range(args.repeats):
    for n, d in variants.items():
      seconds[n].append(sum(call(d, i).stats.seconds for i in range(4)))
  s = {n: np.asarray(v) for n, v in seconds.items()}
  for n, v in s.items():
    spread = (v.max() - v.min()) / np.median(v) * 100
    print(f"{n:17s} median {np.median(v) * 1e3:7.0f} ms  spread {spread:4.0f} %"
          + ("" if n == "plain" else f"  speedup {np.median(s['plain'] / v):.3f} (paired median)"))
  print(f"execution layout / as stored, paired median time ratio: "
        f"{np.median(s['execution layout'] / s['as stored']):.3f}")


if __name__ == "__main__":
  main()
