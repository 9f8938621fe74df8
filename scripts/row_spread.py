"""The slowest row at batch B: each row's acceptance against the batch's pooled one.

At fixed K (greedy, 64 new tokens, widened stories260K in float32, TinyStories openings: the
timed prompts of scripts/auto_vs_plain.py), per row: the acceptance of draft position j given
the earlier ones were accepted (from the per-row counts), its quantiles over the rows, and the
expected rounds of the slowest row (`spec_jax.governor.choice.batch_seconds`, the
governor's "slowest" model) computed two ways: every row at the pooled acceptance (what a
pooled prior or an unseen batch gives the governor) and every row at its own; beside the loop's
actual iterations.

    python scripts/row_spread.py --drafter heads:runs/eagle3_fused --batch 32 --out F.json
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import spec_jax as sj
from spec_jax.bench.prompts import prompt_token_lists
from spec_jax.bench.specs import load_model, make_drafter
from spec_jax.files import atomic_write_json
from spec_jax.governor.choice import batch_seconds, expected_tokens, token_variance


def slowest_rounds(alpha, k: int, new_tokens: int) -> float:
  """E[max_b rounds_b] for rows with per-position acceptance alpha [B, k]: the governor's own
  "slowest" prediction (`batch_seconds`) at one second a round."""
  alpha = jnp.asarray(alpha, jnp.float32)
  rows = alpha.shape[0]
  return float(batch_seconds(sj.Governor(objective="slowest"), expected_tokens(alpha, k), 1.0,
                             jnp.ones(rows, bool), jnp.full(rows, float(new_tokens)),
                             token_variance(alpha, k)))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--target", default="widened:../shared/models/stories260K")
  ap.add_argument("--drafter", default="heads:runs/eagle3_fused")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("-K", type=int, nargs="+", default=[1, 2, 4])
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--out", default="row_spread.json")
  args = ap.parse_args(argv)
  target = load_model(args.target, dtype="float32")
  drafter = make_drafter(args.drafter, target)
  b = args.batch
  prompts = prompt_token_lists(target, "tinystories", b + max(b, 8), 8, 128, 0)[0][:b]
  report = {"target": args.target, "drafter": args.drafter, "batch": b, "cells": {}}
  for k in args.K:
    stats = sj.generate(target, prompts, drafter=drafter, num_draft=k,
                        max_new_tokens=args.max_new_tokens, sampling=sj.Sampling(0.0),
                        stop_tokens=[], key=jax.random.key(0)).stats
    rounds = np.asarray(stats.row_counts["rounds"], float)
    at = np.asarray(stats.row_counts["accepted_at"], float).reshape(b, k)      # [B, K]
    judged = np.concatenate([rounds[:, None], at[:, :-1]], axis=1)           # reached position j
    own = np.clip(at / np.maximum(judged, 1e-9), 0.0, 1.0)
    pooled = at.sum(0) / np.maximum(judged.sum(0), 1e-9)
    cell = {"iterations": int(stats.iterations), "row_rounds_mean": float(rounds.mean()),
            "pooled_alpha": pooled.round(3).tolist(),
            "row_alpha0_quantiles_0_10_50_90_100": np.quantile(own[:, 0], [0, .1, .5, .9, 1])
            .round(3).tolist(),
            "slowest_predicted_pooled": round(slowest_rounds(np.tile(pooled, (b, 1)), k,
                                                             args.max_new_tokens), 1),
            "slowest_predicted_per_row": round(slowest_rounds(own, k, args.max_new_tokens), 1)}
    report["cells"][k] = cell
    print(f"K={k}: {cell}", flush=True)
  atomic_write_json(args.out, report)


if __name__ == "__main__":
  main()
