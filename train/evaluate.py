"""Acceptance of draft heads with the real engine, on held-out prompts (evaluation only)."""

from __future__ import annotations

import jax

import spec_jax as sj
from spec_jax.bench.prompts import PROMPT_SETS, read_prompt_records, source_path
from spec_jax.models.chat import chat_ids, hf_chat_tokenizer
from train.data import read_paragraphs


def heldout_prompts(target, path, num_prompts: int, prompt_tokens: int) -> list:
  """Evaluation prompts: a text file's paragraphs cut to their first prompt_tokens tokens, or
  (a prompt set: a PROMPT_SETS name such as spec_bench, or a .jsonl) the first turns of
  num_prompts questions taken round-robin over its categories, in the target's chat template
  when it has one (whole questions: prompt_tokens is not applied)."""
  if path in PROMPT_SETS and PROMPT_SETS[path].endswith(".txt"):
    path = PROMPT_SETS[path]
  if not (path in PROMPT_SETS or ".jsonl" in str(path)):
    paragraphs = read_paragraphs(path)[:num_prompts]
    return [target.encode(p)[:prompt_tokens] for p in paragraphs]
  source_path(path)                           # ValueError naming the sets when missing
  by_category: dict = {}
  for r in read_prompt_records(path):
    by_category.setdefault(r.category, []).append(r.turns[0])
  picked, i = [], 0
  while len(picked) < num_prompts and any(i < len(q) for q in by_category.values()):
    picked += [q[i] for q in by_category.values() if i < len(q)]
    i += 1
  picked = picked[:num_prompts]
  if hf_chat_tokenizer(target.tokenizer) is not None:
    return [chat_ids(target, [{"role": "user", "content": q}]) for q in picked]
  return [target.encode(q) for q in picked]


def measure(target, drafter, prompts, num_draft: int, temperatures, max_new_tokens: int,
            seed: int = 0, tree=None) -> dict:
  """{temperature: {"alpha", "tau", "accepted_at"}} from sj.generate with `drafter` (a chain of
  num_draft, or `tree`, an sj.TreeSpec)."""
  out = {}
  for t in temperatures:
    res = sj.generate(target, prompts, drafter=drafter, num_draft=num_draft,
                      max_new_tokens=max_new_tokens, sampling=sj.Sampling(temperature=float(t)),
                      key=jax.random.key(seed), tree=tree)
    s = res.stats
    out[float(t)] = {"alpha": s.acceptance_rate, "tau": s.mean_accepted_length,
                     "accepted_at": list(s.accepted_at), "rounds": s.rounds}
  return out


def format_table(kind: str, num_draft: int, rows: dict) -> str:
  """rows: {"before": measure(...), "after": measure(...)} -> a text table."""
  temps = sorted({t for r in rows.values() for t in r})
  head = f"{kind} heads, K={num_draft}: acceptance on held-out prompts (sj.generate)"
  cols = "".join(f" | {'greedy' if t == 0 else f'T={t:g}':>6} alpha    tau" for t in temps)
  lines = [head, f"{'':8}{cols}"]
  for name, r in rows.items():
    cells = "".join(f" | {r[t]['alpha']:>12.3f} {r[t]['tau']:>6.2f}" if t in r else
                    f" | {'-':>12} {'-':>6}" for t in temps)
    lines.append(f"{name:8}{cells}" if len(name) <= 8 else f"{name}\n{'':8}{cells}")
  return "\n".join(lines)
