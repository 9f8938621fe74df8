"""Acceptance of draft heads with the real engine, on held-out prompts (evaluation only)."""

from __future__ import annotations

import jax

import spec_jax as sj
from train.data import read_paragraphs


def heldout_prompts(target, path, num_prompts: int, prompt_tokens: int) -> list:
  paragraphs = read_paragraphs(path)[:num_prompts]
  return [target.encode(p)[:prompt_tokens] for p in paragraphs]


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
