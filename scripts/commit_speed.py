"""Plain greedy and n-gram (K = 4) decoding speed of SmolLM2-135M-Instruct with whichever
spec_jax comes first on sys.path, so two commits can be timed side by side on one host:

    git worktree add /tmp/old 4bd8a4c
    for i in 1 2; do
      PYTHONPATH=/tmp/old python scripts/commit_speed.py 2; python scripts/commit_speed.py 2
    done

bf16, B = 1, the first turns of 4 Spec-Bench questions as raw text (no chat template, so the
script runs on commits whose eval differed), 128 new tokens at most, each configuration
compiled and warmed on every prompt before its timed call (stats.seconds: the compiled call).
Prints one JSON line: the spec_jax it ran, tok/s per repeat, and n-gram's tau.
"""
import json
import pathlib
import sys

import spec_jax as sj

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"
SMOL = SHARED / "models" / "smollm2-135m-instruct"


def tokens_per_second(target, prompts, drafter=None, k=0):
  """(new tokens / seconds of the timed calls, tokens per verify) over the prompts, one by one."""
  secs, toks, taus = 0.0, 0, []
  for p in prompts:
    kw = dict(max_new_tokens=128, capacity=512)
    if drafter is not None:
      kw.update(drafter=drafter, num_draft=k)
    sj.generate(target, [p], **kw)                       # compile and warm
    out = sj.generate(target, [p], **kw)
    secs += out.stats.seconds
    toks += len(out.tokens[0])
    taus.append(out.stats.mean_accepted_length)
  return toks / secs, sum(taus) / len(taus)


def main(repeats: int) -> None:
  lines = [json.loads(l) for l in open(SHARED / "data" / "prompts" / "spec_bench.jsonl")]
  prompts = [lines[i]["turns"][0] for i in (0, 10, 20, 30)]
  target = sj.load(str(SMOL), dtype="bfloat16")
  res = {"spec_jax": sj.__file__, "plain": [], "ngram": []}
  for _ in range(repeats):
    res["plain"].append(round(tokens_per_second(target, prompts)[0], 2))
    speed, tau = tokens_per_second(target, prompts, sj.drafters.NGram(), 4)
    res["ngram"].append(round(speed, 2))
    res["ngram_tau"] = round(tau, 3)
  print(json.dumps(res))


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
