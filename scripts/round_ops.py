"""Where a decode's time goes, op by op: one jax.profiler trace of four B = 1 generate() calls
(64 new tokens, greedy unless --temperature) on the widened stories260K target in bf16, every
XLA:CPU op's time summed by (HLO op, output shape), read from the after-optimizations HLO
(metadata op_name) of the decode program.

    python scripts/round_ops.py --drafter heads:runs/eagle3_fused -K 4

A dot's output shape names it: f32[5, 4096] is the K = 4 verify's gate|up, f32[2, 2048] a
one-row head step's gate (one-row bf16 products run as two rows: models.matmul). Times under
the profiler are inflated; read the ratios, and time speed with spec_jax.bench.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--drafter", default="none")
  ap.add_argument("-K", type=int, default=4)
  ap.add_argument("--temperature", type=float, default=0.0)
  ap.add_argument("--top", type=int, default=30)
  args = ap.parse_args(argv)
  work = tempfile.mkdtemp(prefix="round_ops_")
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={work}/hlo"
  import jax                                                     # after XLA_FLAGS
  sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
  import spec_jax as sj
  from spec_jax.bench.prompts import prompt_token_lists
  from spec_jax.bench.specs import load_model, make_drafter

  target = load_model("widened:../shared/models/stories260K", dtype="bfloat16")
  drafter = make_drafter(args.drafter, target)
  prompts, _ = prompt_token_lists(target, "tinystories", 4, 8, 64, 0)

  def run(i):
    return sj.generate(target, [prompts[i]], drafter=drafter, num_draft=args.K if drafter else 4,
                       max_new_tokens=64, capacity=128, stop_tokens=[],
                       sampling=sj.Sampling(temperature=args.temperature), key=jax.random.key(i))

  for i in range(4):
    run(i)                                                       # compile, warm
  with jax.profiler.trace(f"{work}/trace", create_perfetto_trace=True):
    outs = [run(i) for i in range(4)]
  rounds = sum(int(o.stats.iterations) for o in outs)
  events = json.load(gzip.open(glob.glob(f"{work}/trace/**/*.trace.json.gz", recursive=True)[0]))
  names = {}
  for path in glob.glob(f"{work}/hlo/*after_optimizations.txt"):
    for line in open(path):
      m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]+)\"", line)
      if m:
        op = m.group(3).split("/")[-1]
        names.setdefault(m.group(1), f"{op} {m.group(2).split('{')[0]}")
  total, count = collections.Counter(), collections.Counter()
  for e in events["traceEvents"]:
    if e.get("ph") != "X" or e["name"].startswith(("ThunkExecutor", "$", "SlinkyThreadPool")):
      continue
    key = names.get(e["name"], "(no metadata)")
    total[key] += e["dur"]
    count[key] += 1
  print(f"{args.drafter} K={args.K}: {rounds} loop iterations over 4 calls; op time "
        f"{sum(total.values()) / 1e3:.0f} ms = {sum(total.values()) / 1e3 / rounds:.2f} ms per "
        f"iteration (prefill included)")
  print("| op, output shape | ms per iteration | calls per iteration | us per call |")
  print("|---|---|---|---|")
  for key, t in total.most_common(args.top):
    print(f"| {key} | {t / 1e3 / rounds:.3f} | {count[key] / rounds:.2f} | {t / count[key]:.0f} |")


if __name__ == "__main__":
  main()
