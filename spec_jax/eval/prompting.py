"""From prompt records to the token ids a model is asked: selection per category, the chat
template (or raw text), multi-turn conversations, and the context check.

A tokenizer with a chat template (a Hugging Face folder whose tokenizer_config.json has one)
gets transformers' apply_chat_template(messages, add_generation_prompt=True); every other
tokenizer gets the raw text, turns and answers joined by blank lines, encoded with the model's
BOS convention. Turn t > 1 of a record (MT-bench's second question) is asked after the model's
own answers to turns 1..t-1.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from spec_jax.models.chat import chat_ids, hf_chat_tokenizer

CHAT_TEMPLATE, RAW_TEXT = "chat_template", "raw"


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation: a record's turn (1-based), its category and its prompt token ids."""
  id: str
  category: str
  turn: int
  ids: tuple


def select_records(records, limit_per_category: Optional[int], categories=()) -> list:
  """The first `limit_per_category` records of every category (all with None), file order;
  only those of `categories` when given (ValueError naming the ones the file lacks)."""
  if categories:
    have = list(dict.fromkeys(r.category for r in records))
    missing = [c for c in categories if c not in have]
    if missing:
      raise ValueError(f"--category {', '.join(missing)}: not in the prompts; they have "
                       f"{', '.join(have)}")
    records = [r for r in records if r.category in categories]
  if limit_per_category is None:
    return list(records)
  seen: dict = {}
  out = []
  for r in records:
    seen[r.category] = seen.get(r.category, 0) + 1
    if seen[r.category] <= limit_per_category:
      out.append(r)
  return out


def chat_tokenizer(model):
  """The transformers tokenizer behind model.tokenizer when it has a chat template, else None."""
  return hf_chat_tokenizer(model.tokenizer)


def prompt_format(model) -> str:
  """'chat_template' or 'raw' (see the module docstring)."""
  return CHAT_TEMPLATE if chat_tokenizer(model) is not None else RAW_TEXT


def conversation(record, turn: int, answers: dict) -> list:
  """Messages [user turn 1, assistant answer 1, ..., user turn `turn`]; answers maps
  (record id, turn) -> the model's answer text."""
  messages = []
  for t in range(1, turn + 1):
    messages.append({"role": "user", "content": record.turns[t - 1]})
    if t < turn:
      messages.append({"role": "assistant", "content": answers[(record.id, t)]})
  return messages


def check_template_options(model, chat_template_kwargs) -> None:
  """ValueError when a chat template's options are given for a model without a template."""
  if chat_template_kwargs is not None and chat_tokenizer(model) is None:
    raise ValueError(f"chat template options {json.dumps(chat_template_kwargs)} were given, "
                     f"but this target's tokenizer has no chat template (its prompts are raw "
                     f"text); leave them out")


def encode_conversation(model, messages: list, chat_template_kwargs=None) -> list:
  """Token ids of a conversation ending with a user message, ready for the answer;
  chat_template_kwargs: the template's options (check_template_options)."""
  check_template_options(model, chat_template_kwargs)
  if chat_tokenizer(model) is None:
    return model.encode("\n\n".join(m["content"] for m in messages))
  return chat_ids(model, messages, chat_template_kwargs=chat_template_kwargs)


def build_requests(model, records, turn: int, answers: dict, context: int,
                   max_new_tokens: int, chat_template_kwargs=None) -> tuple:
  """The requests of one turn -> (requests, skipped). A record is asked turn `turn` when it
  has that many turns; it is skipped (listed with the reason) when its previous turn was
  skipped or when prompt + max_new_tokens exceeds the context. chat_template_kwargs: the
  chat template's options (encode_conversation)."""
  requests, skipped = [], []
  for r in records:
    if len(r.turns) < turn:
      continue
    entry = {"id": r.id, "category": r.category, "turn": turn}
    if turn > 1 and (r.id, turn - 1) not in answers:
      skipped.append(dict(entry, prompt_tokens=None, reason=f"turn {turn - 1} was skipped"))
      continue
    ids = encode_conversation(model, conversation(r, turn, answers), chat_template_kwargs)
    if len(ids) + max_new_tokens > context:
      skipped.append(dict(entry, prompt_tokens=len(ids), reason=(
          f"{len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the context of "
          f"{context}")))
      continue
    requests.append(Request(id=r.id, category=r.category, turn=turn, ids=tuple(ids)))
  return requests, skipped
