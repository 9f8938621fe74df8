"""Where a trained head's acceptance is lost: tau on questions it trained on, on fresh questions
the target writes the same way (never trained on), and on Spec-Bench (docs/real_model.md,
"The data recipe, varied").

    python scripts/head_transfer.py --heads runs/smollm2_eagle3_s14 \
        --data runs/cache/selfgen_<key> --spec-prompts 26 --json out.json

The three sets, K = 4, 64 new tokens, greedy and T = 1, the prompts in the chat template:
  train       `--prompts` user messages drawn (seed 0) from the head's own training shards;
  fresh       the first `--prompts` distinct user messages the target writes from the
              template's user-turn prefix under a fixed key (12345) that are not in --data;
              the same questions for every head;
  spec_bench  `--spec-prompts` first turns, round-robin over its 13 categories.
train vs fresh is what the head memorised; fresh vs spec_bench is the distribution shift.
"""

import argparse
import json
import pathlib
import tempfile

import jax
import numpy as np

import spec_jax as sj
from spec_jax.bench.specs import make_drafter
from spec_jax.decoding.prompts import stop_array
from train import evaluate
from train.self_generate import _normal, load_conversations, new_questions, user_turn_prefix


def fresh_questions(target, seen: set, n: int, asked: int = 48) -> list:
  """The first n new questions the target writes from its user-turn prefix (key 12345), kept
  as train.self_generate keeps them."""
  out = sj.generate(target, [user_turn_prefix(target)] * asked, max_new_tokens=64,
                    sampling=sj.Sampling(temperature=1.0), key=jax.random.key(12345))
  return new_questions(out, set(stop_array(target, None).tolist()), seen, limit=n)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default="../shared/models/smollm2-135m-instruct")
  p.add_argument("--heads", required=True, help="a train.distill_heads out_dir")
  p.add_argument("--data", required=True, help="the self_generate shard folder it trained on")
  p.add_argument("--prompts", type=int, default=13)
  p.add_argument("--spec-prompts", type=int, default=26)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  target = sj.load(args.target, dtype="bfloat16")
  _, users = load_conversations(args.data)
  if not users:
    raise SystemExit(f"{args.data}: no self-generated shards")
  rng = np.random.default_rng(0)
  sets = {"train": [users[i] for i in rng.choice(len(users), args.prompts, replace=False)],
          "fresh": fresh_questions(target, {_normal(u) for u in users}, args.prompts)}
  drafter = make_drafter(f"heads:{args.heads}", target)
  result = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, questions in sets.items():
      path = pathlib.Path(tmp) / f"{name}.jsonl"
      path.write_text("".join(json.dumps({"category": name, "turns": [q]}) + "\n"
                              for q in questions))
      sets[name] = str(path)
    sets["spec_bench"] = "spec_bench"
    for name, path in sets.items():
      n = args.spec_prompts if name == "spec_bench" else args.prompts
      prompts = evaluate.heldout_prompts(target, path, n, 0)
      r = evaluate.measure(target, drafter, prompts, 4, [0.0, 1.0], 64)
      result[name] = {"prompts": len(prompts),
                      **{f"T={t:g}": {"tau": v["tau"], "accepted_at": list(v["accepted_at"])}
                         for t, v in r.items()}}
      print(name, json.dumps(result[name]), flush=True)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps({"heads": args.heads, **result}, indent=1))


if __name__ == "__main__":
  main()
