"""Seconds per training step of a distill config, online (the target in every step) against
train.precompute_features (the target once per window, its LM head per step), side by side:

    python scripts/train_step_time.py --config configs/distill_smollm2_eagle3.yaml --steps 12

Both step functions are compiled and warmed first, then timed interleaved (online, offline,
online, ...) over the same batches; prints the median seconds per step of each, their ratio,
and the seconds the precompute takes per window (measured on the first batches, so its cost
for the whole data is windows x that). The data comes from the config's cache (run the
trainer once, e.g. with --set train.stop_after=1, to write it).
"""
import argparse
import json
import statistics
import time

import jax
import numpy as np

import spec_jax as sj
from spec_jax.drafters.formats import heads_folder
from train import data as data_lib
from train import distill_heads
from train import features as features_lib
from train.config import load_config


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", required=True)
  ap.add_argument("--set", action="append", default=[], metavar="dotted.key=value")
  ap.add_argument("--steps", type=int, default=12, help="timed steps of each (interleaved)")
  args = ap.parse_args(argv)
  cfg = load_config(args.config, args.set)
  tcfg = cfg["train"]
  target = sj.load(cfg["target"], dtype=cfg["target_dtype"])
  fp = heads_folder.fingerprint(target)
  windows = data_lib.build_windows(target, cfg["data"], fp["sha256"], cfg["seed"], print)
  draft_tokens = None
  if cfg["head"]["draft_vocab_size"] is not None:
    draft_tokens = data_lib.frequent_tokens(windows, cfg["head"]["draft_vocab_size"],
                                            target.config.vocab_size)
  head = distill_heads.build_head(cfg, target, draft_tokens)
  optimizer = distill_heads.make_optimizer(tcfg, head.params)
  loss_fn = distill_heads.make_loss_fn(head, target.config, tcfg)

  train_step = jax.jit(distill_heads.make_train_step(loss_fn, optimizer))
  step = lambda params, opt, tokens, key, f: train_step(params, opt, target.params, tokens, key, f)

  b = tcfg["batch_size"]
  batches = [data_lib.batch_indices(len(windows), b, cfg["seed"], s) for s in range(args.steps)]
  used = np.unique(np.concatenate(batches))
  started = time.perf_counter()
  feats = features_lib.precompute(target, windows[used], head.target_layers, b)
  per_window = (time.perf_counter() - started) / len(used)     # includes its one compile
  where = {int(w): i for i, w in enumerate(used)}
  rows = lambda idx: feats.rows(np.asarray([where[int(i)] for i in idx]))

  params, opt = head.params, optimizer.init(head.params)
  key = jax.random.key(0)
  for f in (None, rows(batches[0])):                           # compile and warm both
    jax.block_until_ready(step(params, opt, windows[batches[0]], key, f))
  times = {"online": [], "precomputed": []}
  for idx in batches:
    for name in times:
      f = rows(idx) if name == "precomputed" else None
      t0 = time.perf_counter()
      jax.block_until_ready(step(params, opt, windows[idx], key, f))
      times[name].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) for k, v in times.items()}
  spread = {k: (max(v) - min(v)) / med[k] for k, v in times.items()}
  print(json.dumps({"config": args.config, "sets": args.set, "batch": b,
                    "window": int(windows.shape[1]), "steps": args.steps,
                    "median_s": med, "spread": spread,
                    "speedup": med["online"] / med["precomputed"],
                    "precompute_s_per_window": per_window, "windows": len(windows)}))


if __name__ == "__main__":
  main()
