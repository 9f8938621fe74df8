"""EAGLE-3's draft vocabulary size V_d on a real model: what a smaller LM head saves per draft,
what it costs in tokens the head can no longer propose, and the tau a trained head keeps when
its vocabulary is cut (issue 31).

For each V_d (the V_d most frequent tokens of the training data, train.data.frequent_tokens):
  coverage   the share of the target's own greedy / T = 1 answer tokens on Spec-Bench questions
             that lie in the draft vocabulary (a drafted position whose target token is outside
             can never be accepted: an upper bound on per-position acceptance);
  round      the time of one K-draft speculative round relative to one plain decode step, with
             a head of that V_d (its layer the same: only the LM head's width differs), medians
             of interleaved repeats at B = 1;
  tau        the trained head (--heads, trained at some V_d) evaluated with its vocabulary cut
             to each smaller V_d (its most frequent tokens, LM-head columns kept): a lower bound
             for a head trained at that size. Sizes above the trained one need their own run.
  speedup    with --speed-prompts N: that cut head's greedy wall time against plain greedy on
             the first N prompts one at a time (B = 1), each prompt's plain and speculative
             calls side by side, every size in the same interleaved rounds; the median over
             --repeats rounds after a warm-up round, and the plain rounds' spread as the noise.

    python scripts/draft_vocab_sweep.py --heads runs/smollm2_eagle3 \\
        --data runs/cache/selfgen_<key> [--speed-prompts 6 --compare-heads RUN ...] \\
        --json docs/measurements/draft_vocab_sweep.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import spec_jax as sj  # noqa: E402
from spec_jax.compile_cache import enable as enable_compile_cache  # noqa: E402
from spec_jax.drafters.formats import heads_folder  # noqa: E402
from spec_jax.files import atomic_write_json  # noqa: E402
from train.data import frequent_tokens  # noqa: E402
from train.evaluate import heldout_prompts  # noqa: E402
from train.self_generate import load_conversations  # noqa: E402


def cut_vocabulary(head, keep_ids):
  """The head with its draft vocabulary cut to keep_ids (a subset of head.draft_tokens; all
  target ids when the head drafts over the whole vocabulary)."""
  ids = (np.arange(head.target_config.vocab_size) if head.draft_tokens is None
         else np.asarray(head.draft_tokens))
  cols = np.searchsorted(ids, np.sort(keep_ids))
  assert np.array_equal(ids[cols], np.sort(keep_ids))
  params = dict(head.params, lm_head=np.asarray(head.params["lm_head"], np.float32)[:, cols])
  return head.replace(draft_tokens=np.sort(keep_ids), params=params)


def timed(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def measure_speed(target, prompts, heads: dict, args) -> dict:
  """B = 1 greedy: every prompt's plain call, then each head's call on it, round after round;
  {speedup_greedy_b1: {V_d: median of per-round plain seconds / head seconds}, noise: the plain
  rounds' (max - min) / median, rounds}. Seconds are the engine's own (GenerationStats.seconds:
  prefill + decode loop + the copy of the result), the same measure for both."""
  greedy = sj.Sampling(temperature=0.0)

  def one_round():
    plain, spec = 0.0, {n: 0.0 for n in heads}
    for p in prompts:
      plain += sj.generate(target, [p], max_new_tokens=args.tokens,
                           sampling=greedy).stats.seconds
      for n, head in heads.items():
        spec[n] += sj.generate(target, [p], drafter=head, num_draft=args.num_draft,
                               max_new_tokens=args.tokens, sampling=greedy).stats.seconds
    return plain, spec

  one_round()                                         # compiles every shape
  rounds = [one_round() for _ in range(args.repeats)]
  plains = [r[0] for r in rounds]
  for i, (pt, st) in enumerate(rounds):
    print(f"speed round {i}: plain {pt:.2f} s, " +
          ", ".join(f"V_d {n}: {s:.2f} s" for n, s in st.items()), file=sys.stderr, flush=True)
  return {"speedup_greedy_b1": {n: statistics.median(pt / st[n] for pt, st in rounds)
                                for n in heads},
          "plain_seconds": plains,
          "noise": (max(plains) - min(plains)) / statistics.median(plains),
          "prompts": len(prompts), "rounds": len(rounds)}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="../shared/models/smollm2-135m-instruct")
  p.add_argument("--heads", required=True, help="a trained EAGLE-3 run folder")
  p.add_argument("--data", required=True, help="the self-generated shard folder it trained on")
  p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768, 49152])
  p.add_argument("--prompts", type=int, default=13)
  p.add_argument("--tokens", type=int, default=96)
  p.add_argument("--num-draft", type=int, default=4)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--speed-prompts", type=int, default=0,
                 help="measure each cut head's B = 1 greedy speedup on this many prompts")
  p.add_argument("--compare-heads", nargs="*", default=[], metavar="DIR",
                 help="other trained EAGLE-3 runs (another V_d, the same recipe): their tau, "
                 "and their speed in the same interleaved rounds, under 'trained_<V_d>'")
  p.add_argument("--save-cut", nargs=2, action="append", default=[], metavar=("V_D", "DIR"),
                 help="also save the head cut to V_D tokens as a heads folder (for "
                 "`heads:DIR` in spec_jax.eval); repeatable")
  p.add_argument("--json")
  args = p.parse_args(argv)
  if bad := [n for n, _ in args.save_cut if not n.isdigit() or int(n) not in args.sizes]:
    p.error(f"--save-cut sizes {bad} are not among --sizes {args.sizes}")
  save_cut = {int(n): d for n, d in args.save_cut}
  enable_compile_cache()
  target = sj.load(args.target, dtype="bfloat16")
  vocab = target.config.vocab_size
  trained = sj.drafters.load(args.heads, target)
  if bad := sorted(n for n in save_cut if n > trained.draft_vocab_size):
    p.error(f"--save-cut sizes {bad} exceed the trained head's {trained.draft_vocab_size} tokens: "
            "a head cannot be cut to more tokens than it drafts")
  seqs, _ = load_conversations(args.data)
  counts_of = np.bincount(np.concatenate(seqs), minlength=vocab)
  prompts = heldout_prompts(target, "spec_bench", args.prompts, 0)
  answers = {}
  for t in (0.0, 1.0):
    out = sj.generate(target, prompts, max_new_tokens=args.tokens,
                      sampling=sj.Sampling(temperature=t), key=jax.random.key(0))
    answers[t] = np.concatenate([np.asarray(x) for x in out.tokens])
  report = {"trained_vocab": trained.draft_vocab_size, "sizes": {}}
  trained_ids = (np.arange(vocab) if trained.draft_tokens is None
                 else np.asarray(trained.draft_tokens))
  cut_heads = {}
  one = prompts[:1]
  greedy = sj.Sampling(temperature=0.0)
  plain = lambda: sj.generate(target, one, max_new_tokens=args.tokens, sampling=greedy)  # noqa
  for n in args.sizes:
    ids = frequent_tokens(np.concatenate(seqs)[None], n, vocab)
    row = {"coverage_greedy": float(np.isin(answers[0.0], ids).mean()),
           "coverage_t1": float(np.isin(answers[1.0], ids).mean()),
           "training_token_share": float(counts_of[ids].sum() / counts_of.sum())}
    # a fresh head of this width (acceptance ~0: one round = K drafts + a K+1 verify)
    fresh = sj.drafters.EAGLE3.init(target, target_layers=trained.target_layers,
                                    draft_tokens=None if n >= vocab else ids)
    spec = lambda d=fresh: sj.generate(target, one, drafter=d, num_draft=args.num_draft,  # noqa
                                       max_new_tokens=args.tokens, sampling=greedy)
    plain(), spec()                                   # compiled
    tp, ts = [], []
    for _ in range(args.repeats):                     # interleaved
      tp += timed(plain, 1)
      out = spec()
      ts.append(out.stats.seconds)
      rounds = out.stats.rounds
    row["round_over_plain_step"] = (statistics.median(ts) / rounds) / \
        (statistics.median(tp) / args.tokens)
    if n <= trained.draft_vocab_size:
      cut = trained if n == trained.draft_vocab_size else cut_vocabulary(
          trained, trained_ids[np.argsort(-counts_of[trained_ids], kind="stable")[:n]])
      cut_heads[n] = cut
      if n in save_cut:
        heads_folder.save(save_cut[n], cut, target, num_draft=args.num_draft,
                          extra={"cut_from": str(args.heads), "draft_vocab_size": n})
      for t in (0.0, 1.0):
        out = sj.generate(target, prompts, drafter=cut, num_draft=args.num_draft,
                          max_new_tokens=args.tokens, sampling=sj.Sampling(temperature=t),
                          key=jax.random.key(1))
        row[f"tau_{'greedy' if t == 0 else 't1'}"] = out.stats.mean_accepted_length
    report["sizes"][n] = row
    print(n, json.dumps(row), file=sys.stderr, flush=True)
  for folder in args.compare_heads:
    other = sj.drafters.load(folder, target)
    name = f"trained_{other.draft_vocab_size}"
    row = {"heads": folder}
    for t in (0.0, 1.0):
      out = sj.generate(target, prompts, drafter=other, num_draft=args.num_draft,
                        max_new_tokens=args.tokens, sampling=sj.Sampling(temperature=t),
                        key=jax.random.key(1))
      row[f"tau_{'greedy' if t == 0 else 't1'}"] = out.stats.mean_accepted_length
    report["sizes"][name] = row
    cut_heads[name] = other
    print(name, json.dumps(row), file=sys.stderr, flush=True)
  if args.speed_prompts and cut_heads:
    report["speed"] = measure_speed(target, prompts[:args.speed_prompts], cut_heads, args)
    for n, ratio in report["speed"]["speedup_greedy_b1"].items():
      report["sizes"][n]["speedup_greedy_b1"] = ratio
  print(json.dumps(report, indent=1))
  if args.json:
    atomic_write_json(args.json, report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
