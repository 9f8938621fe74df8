"""Prompt sets: the formats of speculative-decoding papers, read into one record type.

  spec_bench, mt_bench  {"question_id", "category", "turns": [...]} (MT-bench: two turns)
  humaneval             {"task_id", "prompt"}                      (.jsonl.gz)
  gsm8k                 {"question", "answer"}
  any .jsonl            one of the above, or {"text"}; "id" / "category" fields are used if there
  a .txt                paragraphs (blank-line separated); the bench takes their openings
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib

from spec_jax.bench.specs import resolve_path

PROMPT_SETS = {  # short names for --prompts
    "tinystories": "../shared/data/tinystories/heldout.txt",
    "spec_bench": "../shared/data/prompts/spec_bench.jsonl",
    "mt_bench": "../shared/data/prompts/mt_bench.jsonl",
    "humaneval": "../shared/data/prompts/HumanEval.jsonl.gz",
    "gsm8k": "../shared/data/prompts/gsm8k_test.jsonl",
}


@dataclasses.dataclass(frozen=True)
class PromptRecord:
  """One question: id (str), category (str), turns (tuple of str; MT-bench has two)."""
  id: str
  category: str
  turns: tuple


def _record(rec: dict, default_category: str, line_no: int, path) -> PromptRecord:
  if isinstance(rec.get("turns"), list) and rec["turns"]:
    turns = tuple(str(t) for t in rec["turns"])           # Spec-Bench / MT-bench
  elif "prompt" in rec:
    turns = (str(rec["prompt"]),)                         # HumanEval
  elif "question" in rec:
    turns = (str(rec["question"]),)                       # GSM8K
  elif "text" in rec:
    turns = (str(rec["text"]),)
  else:
    raise ValueError(f"{path}:{line_no}: no 'turns', 'prompt', 'question' or 'text' field")
  rid = next((rec[k] for k in ("question_id", "task_id", "id") if k in rec), line_no)
  return PromptRecord(id=str(rid), category=str(rec.get("category", default_category)),
                      turns=turns)


def _jsonl_records(path: pathlib.Path, default_category: str) -> list:
  opener = gzip.open if path.suffix == ".gz" else open
  out = []
  with opener(path, "rt", encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      line = line.strip()
      if not line:
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not a JSON object ({e.msg})") from None
      if not isinstance(rec, dict):
        raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(rec).__name__}")
      out.append(_record(rec, default_category, line_no, path))
  return out


def _paragraphs(path: pathlib.Path) -> list:
  return [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def source_path(source: str) -> pathlib.Path:
  """--prompts: a PROMPT_SETS name or a path -> an existing file (ValueError otherwise)."""
  path = resolve_path(PROMPT_SETS.get(source, source))
  if not path.is_file():
    raise ValueError(f"prompt source {source!r} not found (tried {path}); use one of "
                     f"{', '.join(PROMPT_SETS)} or a .txt / .jsonl / .jsonl.gz path")
  return path


def _is_jsonl(path: pathlib.Path) -> bool:
  return path.name.endswith((".jsonl", ".jsonl.gz", ".json"))


def read_prompt_records(source: str) -> list:
  """Every question of a prompt source as PromptRecords, in file order. Records without a
  category get the set's name (e.g. 'humaneval'); a .txt gives one record per paragraph."""
  path = source_path(source)
  default_category = source if source in PROMPT_SETS else path.name.split(".")[0]
  if _is_jsonl(path):
    records = _jsonl_records(path, default_category)
  else:
    records = [PromptRecord(id=str(i), category=default_category, turns=(p.strip(),))
               for i, p in enumerate(_paragraphs(path))]
  if not records:
    raise ValueError(f"no prompts found in {path}")
  return records


def read_prompt_texts(source: str, words: int = 8) -> list:
  """--prompts of the bench: the first turn of every question of a .jsonl / .jsonl.gz source,
  or the first `words` words of every paragraph of a .txt (paragraphs shorter than that and
  repeated openings are skipped)."""
  path = source_path(source)
  if _is_jsonl(path):
    texts = [r.turns[0] for r in read_prompt_records(source)]
  else:
    texts, seen = [], set()
    for para in _paragraphs(path):
      w = para.split()
      opening = " ".join(w[:words])
      if len(w) >= words and opening not in seen:
        seen.add(opening)
        texts.append(opening)
  if not texts:
    raise ValueError(f"no prompts found in {path}")
  return texts


MIXED = "mixed"
MIXED_STORIES = "tinystories"


def _mixed_prompts(model, n: int, words: int, max_prompt_tokens: int, seed: int) -> tuple:
  """--prompts mixed: even rows are tinystories openings, odd rows seeded random token ids
  (ids >= 3, as long as the story prompts): half a batch the drafter can follow, half it
  cannot. Any batch prefix of even size is half and half."""
  import numpy as np
  stories, texts = prompt_token_lists(model, MIXED_STORIES, (n + 1) // 2, words,
                                      max_prompt_tokens, seed)
  rng = np.random.default_rng(seed + 1)
  v = model.config.vocab_size
  ids, out_texts = [], []
  for i in range(n):
    if i % 2 == 0:
      ids.append(stories[i // 2])
      out_texts.append(texts[i // 2] if texts else None)
    else:
      length = len(stories[(i // 2) % len(stories)])
      ids.append(rng.integers(3, v, size=length).tolist())
      out_texts.append(None)
  return ids, (out_texts if texts else None)


def prompt_token_lists(model, source: str, n: int, words: int, max_prompt_tokens: int,
                       seed: int) -> tuple:
  """n prompts as token-id lists for `model` -> (ids, texts or None).

  Models with a tokenizer encode the texts of `source` (BOS as the tokenizer adds it), each cut
  to its first max_prompt_tokens tokens. Random models (no tokenizer) get seeded random ids of
  8..15 tokens (the same for a given seed).
  """
  import numpy as np
  if source.startswith("chat:"):
    raise ValueError(f"--prompts {source}: chat-template prompts are read by the peer suite "
                     f"(spec_jax.bench.chat_prompts); this suite takes a plain prompt set")
  if source == MIXED:
    return _mixed_prompts(model, n, words, max_prompt_tokens, seed)
  if model.tokenizer is None:
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    ids = [rng.integers(3, v, size=int(rng.integers(8, 16))).tolist() for _ in range(n)]
    return ids, None
  texts = read_prompt_texts(source, words)
  if len(texts) < n:
    texts = (texts * (n // len(texts) + 1))
  texts = texts[:n]
  ids = [model.encode(t)[:max_prompt_tokens] for t in texts]
  return ids, texts
