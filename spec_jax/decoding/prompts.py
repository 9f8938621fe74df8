"""Host-side prompt preparation: checks (ValueError naming the bad prompt), token ids, right
padding to a bucketed length, the stop-token array. Shared by generate() and the benchmarks."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from spec_jax.decoding.checks import as_token_ids, check_capacity, is_static_int
from spec_jax.models.chat import default_stop_ids

PROMPT_BUCKET = 16
CAPACITY_BUCKET = 64
MIN_CAPACITY = 512
STOP_BUCKET = 8        # stop ids padded to a multiple of this: one executable for 0-8 stop ids


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def capacity_bucket(needed: int, context: Optional[int] = None) -> int:
  """generate()'s default KV capacity: the next power of two >= needed, at least MIN_CAPACITY
  (or, for a model with a shorter context, the power of two covering that context). Prompts of
  any length then share a few compiled decodes: with the 512 floor every request up to 2048
  tokens (prompt + new tokens) compiles at most three times (512, 1024, 2048); attention reads
  only the filled part of a bucket (kernels_pallas.blocked), so the floor costs memory, not
  time."""
  floor = MIN_CAPACITY if context is None else min(MIN_CAPACITY, _pow2(context))
  return max(floor, _pow2(needed))


def prompt_ids(target, prompts, allow_empty: bool = False) -> list[list[int]]:
  """Token ids of every prompt (ValueError on bad ones); allow_empty: a process of a
  multi-process call may feed no rows."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or (
      len(prompts) == 0 and not allow_empty):
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists, got "
                     f"{type(prompts).__name__}")
  vocab = target.config.vocab_size
  out = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      if target.tokenizer is None:
        raise ValueError("text prompts need a model with a tokenizer; this model has none: pass "
                         "lists of token ids")
      ids = target.encode(prompt)
    else:
      ids = as_token_ids(prompt, f"prompt {i}")
    if len(ids) == 0:
      raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    out.append(ids)
  return out


def stop_array(target, stop_tokens) -> np.ndarray:
  """int32 [N] stop ids; None = the model's default stops (its EOS ids and its tokenizer's
  end-of-turn tokens: spec_jax.models.chat.default_stop_ids)."""
  if stop_tokens is None:
    stop_tokens = default_stop_ids(target)
  if hasattr(stop_tokens, "__array__") and not isinstance(stop_tokens, np.ndarray):
    stop_tokens = np.asarray(stop_tokens)                   # a jax array: what decode takes
  if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, (Sequence, np.ndarray)) \
      or np.ndim(stop_tokens) == 0:
    raise ValueError(f"stop_tokens must be None (the model's end-of-text tokens) or a list of "
                     f"token ids ([] = never stop early), got {stop_tokens!r}")
  stop = as_token_ids(stop_tokens, "stop_tokens") if len(stop_tokens) else []
  bad = [t for t in stop if not 0 <= t < target.config.vocab_size]
  if bad:
    raise ValueError(f"stop_tokens outside the vocabulary [0, {target.config.vocab_size}): {bad}")
  return np.asarray(stop, np.int32).reshape(-1)


def padded_stops(stop) -> np.ndarray:
  """int32 [N] stop ids -> int32 [round_up(max(N, 1), STOP_BUCKET)], padded with -1 (token ids
  are >= 0, so a pad never matches). The stop array's length is a static shape of the compiled
  decode: padded, calls with no stops ([]), a model's default stops (1-3 ids) and a user's
  short list share one executable instead of compiling once per count."""
  stop = np.asarray(stop, np.int32).reshape(-1)
  out = np.full((round_up(max(stop.size, 1), STOP_BUCKET),), -1, np.int32)
  out[:stop.size] = stop
  return out


def prepare_batch(target, prompts, max_new_tokens: int, k: int, capacity=None,
                  prompt_bucket: int = PROMPT_BUCKET):
  """Host-side prompt preparation shared by generate() and the benchmarks.

  Returns (prompt_tokens int32 [B, P] right-padded to a multiple of prompt_bucket (one compile
  per padded length; the padding is masked), prompt_lens int32 [B], capacity). Raises ValueError
  on bad prompts or a capacity that is too small."""
  return pad_batch(target, prompt_ids(target, prompts), max_new_tokens, k, capacity,
                    prompt_bucket)


def default_capacity(target, ids: list, max_new_tokens: int, k: int) -> int:
  """The KV-cache capacity generate() picks when none is given: capacity_bucket of the longest
  prompt + max_new_tokens + K + 1 (what a cost table for its decode must be measured at)."""
  needed = max(len(r) for r in ids) + max_new_tokens + k + 1
  return capacity_bucket(needed, target.config.max_position_embeddings)


def pad_batch(target, ids: list, max_new_tokens: int, k: int, capacity, prompt_bucket):
  """prepare_batch after the prompts were checked (ids: list[list[int]], non-empty rows).

  prompt_bucket None: generate()'s layout — the capacity (default: capacity_bucket of what the
  batch needs) and a prompt buffer as long as the cache (P = S), so one compiled decode serves
  every prompt length of a bucket (the chunked prefill works on the real tokens only); an
  integer: prompts padded to a multiple of it (P < S) and capacity rounded up to a multiple of
  CAPACITY_BUCKET (what sj.decode with a static max_new_tokens checks)."""
  if prompt_bucket is not None and (not is_static_int(prompt_bucket) or prompt_bucket < 1):
    raise ValueError(f"prompt_bucket must be None or a positive integer, got {prompt_bucket!r}")
  longest = max(len(r) for r in ids)
  max_pos = target.config.max_position_embeddings
  if longest + max_new_tokens > max_pos:
    raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) "
                     f"exceeds the model's context of {max_pos} positions")
  needed = longest + max_new_tokens + k + 1
  if capacity is None:
    capacity = default_capacity(target, ids, max_new_tokens, k) if prompt_bucket is None \
        else round_up(needed, CAPACITY_BUCKET)
  else:
    check_capacity(capacity, longest, max_new_tokens, k)
  if prompt_bucket is None:
    p = int(capacity)
  else:
    p = min(round_up(longest, prompt_bucket), capacity - max_new_tokens - k - 1)
    p = max(p, longest)
  prompt_tokens = np.zeros((len(ids), p), np.int32)
  for b, r in enumerate(ids):
    prompt_tokens[b, :len(r)] = r
  prompt_lens = np.asarray([len(r) for r in ids], np.int32)
  return prompt_tokens, prompt_lens, int(capacity)
