"""Losslessness on a real model (SmolLM2-135M-Instruct): greedy equality on chat prompts and the
T = 1 chi-square of the first new tokens against their exact joint, for any drafter.

The CI test (tests/test_real_model_lossless.py) runs both at a small size with freshly
initialised heads; the full check with trained heads is this module's command line:

    python -m tests.real_model_lossless --eagle3 runs/smollm2_eagle3 --dflash runs/smollm2_dflash \\
        --prompts 16 --tokens 64 --samples 4000 --json docs/measurements/smollm2_lossless.json

The exact joint of tokens 1-3 cannot be enumerated over 49,152^3 continuations, so the chi-square
bins are chosen from the exact distribution alone, before any sample is drawn: the `top`
likeliest first tokens, for each the likeliest second tokens, for each pair the likeliest
third tokens (their probabilities exact: two batched reference forwards), and one bin for all
other triples (1 - the enumerated mass). Bins with an expected count below 5 are pooled
(stats_helpers.chi_square), so the test is data-independent and exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import spec_jax as sj
from spec_jax.files import atomic_write_text
from spec_jax.models.transformer import KVCache, forward
from tests.stats_helpers import chi2_sf, chi_square
from train.evaluate import heldout_prompts

SMOLLM2 = "../shared/models/smollm2-135m-instruct"
RAW_PROMPT = "My favourite thing to do on a rainy day is"   # a short raw prompt: cheap prefill


def greedy_equality(target, drafters: dict, prompts, max_new_tokens: int, num_draft: int = 4):
  """{name: {"equal_rows", "rows", "first_mismatch", "tau"}}: each drafter's speculative greedy
  tokens against plain greedy, row by row (prompts: token-id lists, one batch)."""
  greedy = sj.Sampling(temperature=0.0)
  plain = sj.generate(target, prompts, max_new_tokens=max_new_tokens, sampling=greedy).tokens
  report = {}
  for name, drafter in drafters.items():
    out = sj.generate(target, prompts, drafter=drafter, num_draft=num_draft,
                      max_new_tokens=max_new_tokens, sampling=greedy)
    mismatch = [i for i, (a, b) in enumerate(zip(out.tokens, plain)) if a != b]
    report[name] = {"equal_rows": len(prompts) - len(mismatch), "rows": len(prompts),
                    "first_mismatch": mismatch[0] if mismatch else None,
                    "tau": out.stats.mean_accepted_length}
  return report


def _next_probs(target, sequences, sampling):
  """sampling.probs of the token after each sequence (int32 [N, L], one length) [N, V]."""
  seqs = jnp.asarray(np.asarray(sequences, np.int32))
  n, length = seqs.shape
  out = forward(target.params, target.config, seqs, KVCache.zeros(target.config, n, length),
                jnp.zeros(n, jnp.int32))
  return np.asarray(sj.sampling.probs(out.logits[:, -1], sampling.as_arrays(n)), np.float64)


def exact_top_triples(target, prompt, sampling, top=(24, 12, 8)):
  """The likeliest triples (x1, x2, x3) of plain sampling after `prompt` and their exact
  probabilities: (triples int [M, 3], probs float64 [M]), M = prod(top)."""
  a, b, c = top
  p1 = _next_probs(target, [prompt], sampling)[0]
  x1 = np.argsort(-p1)[:a]
  p2 = _next_probs(target, [list(prompt) + [int(t)] for t in x1], sampling)      # [a, V]
  x2 = np.argsort(-p2, axis=1)[:, :b]                                              # [a, b]
  pairs = [list(prompt) + [int(x1[i]), int(x2[i, j])] for i in range(a) for j in range(b)]
  p3 = _next_probs(target, pairs, sampling).reshape(a, b, -1)                      # [a, b, V]
  x3 = np.argsort(-p3, axis=2)[:, :, :c]                                           # [a, b, c]
  i, j, k = np.meshgrid(np.arange(a), np.arange(b), np.arange(c), indexing="ij")
  triples = np.stack([x1[i], x2[i, j], x3[i, j, k]], -1).reshape(-1, 3)
  probs = (p1[x1][i] * p2[i, x2[i, j]] * p3[i, j, x3[i, j, k]]).reshape(-1)
  return triples, probs


def sample_triples(target, drafter, prompt, sampling, samples: int, num_draft: int,
                   chunk: int = 1000, seed: int = 0):
  """The first three new tokens of `samples` speculative decodes (int [samples, 3]) and the
  drafts' acceptance rate; rows run in chunks of one compiled shape."""
  rows, accepted, drafted = [], 0.0, 0.0
  for c in range(-(-samples // chunk)):
    out = sj.generate(target, [prompt] * chunk, drafter=drafter, num_draft=num_draft,
                      max_new_tokens=3, sampling=sampling, stop_tokens=[], capacity=32,
                      key=jax.random.fold_in(jax.random.key(seed), c))
    rows.append(np.asarray(out.tokens))
    accepted += out.stats.accepted
    drafted += out.stats.drafted
  return np.concatenate(rows)[:samples], accepted / max(drafted, 1.0)


def triple_chi_square(triples, probs, observed):
  """(stat, dof, p_value, enumerated mass): observed triples [N, 3] against the enumerated
  bins `triples` [M, 3] with exact `probs` [M] and one bin for every other triple."""
  index = {tuple(t): m for m, t in enumerate(triples.tolist())}
  counts = np.zeros(len(triples) + 1)
  for t in observed.tolist():
    counts[index.get(tuple(t), len(triples))] += 1
  expected = np.append(probs, max(1.0 - probs.sum(), 0.0))
  stat, dof = chi_square(counts, expected / expected.sum())
  return stat, dof, chi2_sf(stat, dof), float(probs.sum())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tests.real_model_lossless", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default=SMOLLM2)
  p.add_argument("--eagle3", help="a trained EAGLE-3 run (its reduced draft vocabulary)")
  p.add_argument("--dflash", help="a trained DFlash run")
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--tokens", type=int, default=64)
  p.add_argument("--num-draft", type=int, default=4)
  p.add_argument("--samples", type=int, default=4000)
  p.add_argument("--only", choices=["greedy", "chi_square"], help="run one of the two checks")
  p.add_argument("--json", help="write the report here")
  args = p.parse_args(argv)
  target = sj.load(args.target, dtype="float32")
  drafters = {"ngram": sj.drafters.NGram()}
  if args.eagle3:
    drafters["eagle3"] = sj.drafters.load(args.eagle3, target)
  if args.dflash:
    drafters["dflash"] = sj.drafters.load(args.dflash, target)
  prompts = heldout_prompts(target, "spec_bench", args.prompts, 0)
  t0 = time.perf_counter()
  report = {"greedy": {}, "chi_square": {}}
  if args.only != "chi_square":
    report["greedy"] = greedy_equality(target, drafters, prompts, args.tokens, args.num_draft)
    print(json.dumps(report["greedy"]), file=sys.stderr)
  if args.only == "greedy":
    drafters = {}
  prompt = target.encode(RAW_PROMPT)
  sampling = sj.Sampling(temperature=1.0)
  triples, probs = exact_top_triples(target, prompt, sampling) if drafters else (None, None)
  for name, drafter in drafters.items():
    if name == "ngram":
      continue
    k = min(args.num_draft, getattr(drafter, "max_draft", None) or args.num_draft)
    observed, alpha = sample_triples(target, drafter, prompt, sampling, args.samples, k)
    stat, dof, pv, mass = triple_chi_square(triples, probs, observed)
    report["chi_square"][name] = {"stat": stat, "dof": dof, "p_value": pv, "samples": args.samples,
                                  "enumerated_mass": mass, "acceptance": alpha, "num_draft": k}
    print(name, report["chi_square"][name], file=sys.stderr)
  report["seconds"] = time.perf_counter() - t0
  text = json.dumps(report, indent=1)
  print(text)
  if args.json:
    atomic_write_text(args.json, text + "\n")
  ok = all(r["equal_rows"] == r["rows"] for r in report["greedy"].values()) and \
      all(r["p_value"] > 1e-3 for r in report["chi_square"].values())
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
