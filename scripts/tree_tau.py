"""tau of chains and trees on train/evaluate.py's held-out prompts (24 prompts of 12 tokens,
96 new tokens, all prompts in one generate() call, key 0), greedy and T=1.

    python scripts/tree_tau.py --drafter draft:../shared/models/salty279K --chain 4 \
        --tree 4,3,12 --tree 6,4,31
    python scripts/tree_tau.py --drafter heads:/work/runs/tree-eagle3 --chain 6 --tree 6,4,31

Prints one line per (configuration, temperature): tau, rounds, accepted_at.
"""

import argparse
import json

import jax

import spec_jax as sj
from spec_jax.bench.specs import load_model, make_drafter
from spec_jax.tree import parse_tree_spec
from train.evaluate import heldout_prompts


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--target", default="../shared/models/stories260K")
  p.add_argument("--drafter", required=True)
  p.add_argument("--chain", type=int, nargs="*", default=[])
  p.add_argument("--tree", action="append", default=[])
  p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
  p.add_argument("--num-prompts", type=int, default=24)
  p.add_argument("--prompt-tokens", type=int, default=12)
  p.add_argument("--max-new-tokens", type=int, default=96)
  p.add_argument("--seeds", type=int, nargs="+", default=[0])
  p.add_argument("--json", default=None)
  a = p.parse_args()
  target = load_model(a.target)
  drafter = make_drafter(a.drafter, target)
  prompts = heldout_prompts(target, "../shared/data/tinystories/heldout.txt", a.num_prompts,
                            a.prompt_tokens)
  configs = [("K=%d" % k, dict(num_draft=k)) for k in a.chain]
  configs += [(parse_tree_spec(t).label(), dict(tree=parse_tree_spec(t))) for t in a.tree]
  results = []
  for temp in a.temperatures:
    for name, kw in configs:
      taus = []
      for seed in a.seeds:
        out = sj.generate(target, prompts, drafter=drafter, max_new_tokens=a.max_new_tokens,
                          sampling=sj.Sampling(temperature=temp), key=jax.random.key(seed), **kw)
        taus.append(out.stats.mean_accepted_length)
      s = out.stats
      tau = sum(taus) / len(taus)
      print(f"T={temp:g} {name:28s} tau={tau:.3f} (seeds {' '.join(f'{t:.2f}' for t in taus)}) "
            f"rounds={s.rounds} accepted_at=[{' '.join(f'{x:.2f}' for x in s.accepted_at)}] "
            f"s={s.seconds:.2f}", flush=True)
      results.append({"temperature": temp, "config": name, "tau": tau, "taus": taus})
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
