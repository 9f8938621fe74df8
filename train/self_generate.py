"""Conversations an instruct target writes itself (the Magpie recipe, Xu et al. 2024): training
data for its drafters whose prompts AND responses follow the target's own distribution, and
never touch an evaluation prompt set.

  1. The user turn: the chat template rendered up to the start of a user message (its default
     system prompt included, as the template writes it) and nothing else; the target continues
     it, writing a user message, until its end-of-turn token.
  2. The answer: that message as a one-turn conversation with the generation prompt; the
     target answers until its end-of-turn token.

Rows are batched (one compiled shape per phase: fixed batch and token budgets), deduplicated by
the normalised user message, and stored as the chat-templated token ids of the whole
conversation (prompt + answer), the sequences `train.data` packs into windows. Progress is
kept in shards (one npz per batch, written atomically): a killed run resumes at the next batch
with the same seeds, and `conversations` more than a finished run extends it.

    python -m train.self_generate --target ../shared/models/smollm2-135m-instruct \\
        --conversations 2000 --out runs/cache/smollm2_selfgen
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import time
from typing import Optional, Sequence

import jax
import numpy as np

import spec_jax as sj
from spec_jax.decoding.prompts import stop_array
from spec_jax.models.chat import chat_ids, hf_chat_tokenizer

_MARK = "\x00SPECJAXUSER\x00"


def user_turn_prefix(target, system: str = "") -> list:
  """Token ids of the chat template up to where a user message's text starts: after the
  template's default system prompt, or after `system` when given (Magpie's way of steering
  the questions towards a task). ValueError without a chat template."""
  hf = hf_chat_tokenizer(target.tokenizer)
  if hf is None:
    raise ValueError("self-generated conversations need an instruct target with a chat "
                     "template")
  turns = [{"role": "system", "content": system}] if system else []
  text = hf.apply_chat_template(turns + [{"role": "user", "content": _MARK}], tokenize=False,
                                add_generation_prompt=False)
  if _MARK not in text:
    raise ValueError("the chat template does not render the user's message verbatim")
  return list(hf.encode(text[:text.index(_MARK)], add_special_tokens=False))


def _normal(text: str) -> str:
  return re.sub(r"\s+", " ", text).strip().lower()


def _shard(out: pathlib.Path, i: int) -> pathlib.Path:
  return out / f"shard_{i:05d}.npz"


def _save_atomic(path: pathlib.Path, **arrays) -> None:
  tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
  np.savez(tmp, **arrays)
  os.replace(tmp, path)


def load_conversations(out) -> tuple:
  """(token sequences, user messages) of every finished shard of `out`, in order."""
  out = pathlib.Path(out)
  seqs, users = [], []
  i = 0
  while _shard(out, i).is_file():
    z = np.load(_shard(out, i), allow_pickle=False)
    tokens, offsets = z["tokens"], z["offsets"]
    seqs += [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    users += [str(u) for u in z["users"]]
    i += 1
  return seqs, users


def new_questions(asked, stops, seen: set, min_user_chars: int = 8,
                  limit: Optional[int] = None) -> list:
  """The first `limit` user messages of `asked` (an sj.generate output from the user-turn
  prefix) worth answering: ended by a stop token (not cut off), at least min_user_chars long,
  and not in `seen` (normalised text; the kept ones are added to it), in order."""
  kept = []
  for toks, text in zip(asked.tokens, asked.text):
    if limit is not None and len(kept) == limit:
      break
    message = text.strip()
    if not toks or toks[-1] not in stops or len(message) < min_user_chars \
        or _normal(message) in seen:
      continue                             # cut off, empty or a duplicate
    seen.add(_normal(message))
    kept.append(message)
  return kept


def self_generate(target, conversations: int, out, *, batch: int = 32,
                  user_batch: Optional[int] = None, user_tokens: int = 64, answer_tokens: int = 256, temperature: float = 1.0,
                  top_p: float = 1.0, answer_temperature: Optional[float] = None,
                  system_prompts: Sequence[str] = (), min_user_chars: int = 8, seed: int = 0,
                  max_batches=None, log=lambda m: print(m, file=sys.stderr)) -> list:
  """At least `conversations` distinct conversations (token ids, chat-templated), written to
  and resumed from the shards in `out`. A batch whose rows are all duplicates or empty still
  counts against max_batches (default: 4x the batches needed), so a target that repeats
  itself cannot loop forever. Each batch asks `user_batch` user messages (default 1.5 x batch:
  about a quarter are cut off at user_tokens, empty or duplicates) and answers up to `batch`
  of them, so the answer phase, the long one, rarely runs padding rows.

  answer_temperature (default: temperature) samples the answers apart from the questions: 0
  answers greedily, so the drafter trains on the contexts a greedy decode visits (the
  questions stay sampled, for variety).

  system_prompts steer the questions (Magpie's task control): the j-th question asked
  (counting over batches) is written after system_prompts[j % len] ("" keeps the template's
  default), and every answer is written to the question alone, in the default template, as a
  user's prompt is at inference."""
  out = pathlib.Path(out)
  user_batch = batch + batch // 2 if user_batch is None else user_batch
  if conversations < 1 or batch < 1 or user_batch < 1:
    raise ValueError(f"conversations, batch and user_batch must be >= 1, got {conversations}, "
                     f"{batch}, {user_batch}")
  if answer_temperature is None:
    answer_temperature = temperature
  if answer_temperature < 0:
    raise ValueError(f"answer_temperature must be >= 0 (0: greedy answers), got "
                     f"{answer_temperature}")
  if isinstance(system_prompts, str) or not all(isinstance(x, str) for x in system_prompts):
    raise ValueError(f"system_prompts must be a list of strings, got {system_prompts!r}")
  prefixes = [user_turn_prefix(target, x) for x in list(system_prompts) or [""]]
  out.mkdir(parents=True, exist_ok=True)
  seqs, users = load_conversations(out)
  seen = {_normal(u) for u in users}
  sampling = sj.Sampling(temperature=temperature, top_p=top_p)
  answer_sampling = sj.Sampling(temperature=answer_temperature, top_p=top_p)
  if max_batches is None:
    max_batches = 4 * -(-conversations // batch) + 4
  shard = 0                        # the next shard: after the finished ones load_conversations read
  while _shard(out, shard).is_file():
    shard += 1
  for stale in out.glob("shard_*.npz.tmp*.npz"):   # a run killed inside np.savez left these
    stale.unlink()
  resumed = sum(len(s) for s in seqs)
  stops = set(stop_array(target, None).tolist())
  start = time.perf_counter()
  while len(seqs) < conversations:
    if shard >= max_batches:
      raise RuntimeError(f"{len(seqs)} distinct conversations after {shard} batches "
                         f"(wanted {conversations}): the target repeats itself; raise the "
                         f"temperature or max_batches")
    key = jax.random.fold_in(jax.random.key(seed), shard)
    first = shard * user_batch                     # questions asked before this batch
    asking = [prefixes[(first + r) % len(prefixes)] for r in range(user_batch)]
    asked = sj.generate(target, asking, max_new_tokens=user_tokens, sampling=sampling,
                        key=jax.random.fold_in(key, 0))
    new_users = new_questions(asked, stops, seen, min_user_chars, limit=batch)
    convs = [[{"role": "user", "content": message}] for message in new_users]
    kept_seqs = []
    if convs:
      rows = convs + [convs[0]] * (batch - len(convs))       # one compiled shape
      answered = sj.generate(target, messages=rows, max_new_tokens=answer_tokens,
                             sampling=answer_sampling, key=jax.random.fold_in(key, 1))
      for conv, toks in zip(convs, answered.tokens):
        kept_seqs.append(chat_ids(target, conv) + list(toks))
    offsets = np.cumsum([0] + [len(s) for s in kept_seqs])
    tokens = (np.concatenate([np.asarray(s, np.int32) for s in kept_seqs]) if kept_seqs
              else np.zeros((0,), np.int32))
    _save_atomic(_shard(out, shard), tokens=tokens, offsets=offsets,
                 users=np.asarray(new_users, dtype=str))
    seqs += kept_seqs
    users += new_users
    shard += 1
    rate = (sum(len(s) for s in seqs) - resumed) / max(time.perf_counter() - start, 1e-9)
    log(f"self-generated {len(seqs)}/{conversations} conversations ({shard} batches, "
        f"{len(kept_seqs)}/{batch} kept this batch, ~{rate:.0f} tokens/s this run)")
  return seqs[:conversations]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m train.self_generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", required=True)
  p.add_argument("--conversations", type=int, required=True)
  p.add_argument("--out", required=True, help="the shard directory (resumed when it exists)")
  p.add_argument("--batch", type=int, default=32, help="conversations answered per batch")
  p.add_argument("--user-batch", type=int, default=None,
                 help="user messages asked per batch (default 1.5 x batch)")
  p.add_argument("--user-tokens", type=int, default=64)
  p.add_argument("--answer-tokens", type=int, default=256)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--answer-temperature", type=float, default=None,
                 help="the answers' temperature (default: --temperature; 0: greedy answers)")
  p.add_argument("--system-prompt", action="append", default=[],
                 help="steer the questions (repeat: question j asks after prompt j %% n; "
                      "\"\" is the template's default)")
  p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  try:
    target = sj.load(args.target, dtype=args.dtype)
    seqs = self_generate(target, args.conversations, args.out, batch=args.batch,
                         user_batch=args.user_batch,
                         user_tokens=args.user_tokens, answer_tokens=args.answer_tokens,
                         temperature=args.temperature, top_p=args.top_p,
                         answer_temperature=args.answer_temperature,
                         system_prompts=args.system_prompt, seed=args.seed)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  _, users = load_conversations(args.out)
  print(json.dumps({"conversations": len(seqs), "tokens": int(sum(map(len, seqs))),
                    "example_user_messages": users[:3]}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
