"""The static arguments of a decode call, checked, and the round strategy they make.

Every check raises ValueError naming what was wrong and what is allowed, before anything is
traced or compiled; decode and generate share them, so their messages agree.
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

from spec_jax.decoding.rounds import Chain, RoundStrategy
from spec_jax.drafters.base import Drafter
from spec_jax.governor import resolve
from spec_jax.governor.loop import Governed
from spec_jax.tree import check_tree
from spec_jax.tree.round import TreeRounds


def is_static_int(x) -> bool:
  return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def check_num_draft(drafter: Optional[Drafter], num_draft) -> int:
  """The K a (drafter, num_draft) pair runs with; ValueError naming what is allowed."""
  if drafter is None:
    return 0
  if not isinstance(drafter, Drafter):
    raise ValueError(f"drafter must be a spec_jax.drafters drafter or None, got "
                     f"{type(drafter).__name__}")
  if not is_static_int(num_draft) or num_draft < 1:
    raise ValueError(f"num_draft (K) must be an integer >= 1 when a drafter is given, got "
                     f"{num_draft!r}")
  if drafter.max_draft is not None and num_draft > drafter.max_draft:
    raise ValueError(f"this drafter proposes at most {drafter.max_draft} tokens per round; "
                     f"num_draft={num_draft} is too large")
  return int(num_draft)


def check_capacity(capacity, longest_prompt: int, max_new_tokens: int, k: int) -> None:
  """Raises ValueError unless the KV cache holds prompt + max_new_tokens + a K+1 verify block."""
  if not is_static_int(capacity) or capacity < 1:
    raise ValueError(f"capacity must be a positive integer (the KV-cache length S), got "
                     f"{capacity!r}")
  needed = longest_prompt + max_new_tokens + k + 1
  if capacity < needed:
    raise ValueError(f"capacity {capacity} is too small: the longest prompt ({longest_prompt}) + "
                     f"max_new_tokens ({max_new_tokens}) + K+1 ({k + 1}; a tree's cache_extent "
                     f"+ 1) needs {needed}")


def drafting_plan(drafter, num_draft, tree=None, governor=None) -> RoundStrategy:
  """Checks how a call drafts -> the RoundStrategy it runs with (ValueError on a bad
  combination; shared by decode and generate, so their messages agree).

  A tree (TreeRounds) ignores num_draft: its depth bounds the accepted drafts, its cache_extent
  what a round writes. num_draft="auto" (Governed) chooses among the governor's candidates
  every round from a cost table (decode's round_costs). Otherwise a Chain of K = num_draft
  drafts (K = 0 without a drafter)."""
  if tree is not None:
    return TreeRounds(check_tree(tree, drafter, num_draft, governor))
  if is_auto(num_draft):
    return Governed.of(resolve(governor, drafter), drafter)
  if governor is not None:
    raise ValueError("governor= is used only with num_draft='auto'")
  return Chain(check_num_draft(drafter, num_draft))


def is_auto(num_draft) -> bool:
  """num_draft="auto": the governor chooses K every round."""
  return isinstance(num_draft, str) and num_draft == "auto"

