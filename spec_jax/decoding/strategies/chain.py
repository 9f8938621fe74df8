"""Chain: K drafts every round (K = 0: plain decoding, the baseline)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from spec_jax.decoding.checks import is_static_int
from spec_jax.decoding.rounds import chain_round
from spec_jax.decoding.strategies.base import Strategy
from spec_jax.drafters.base import Drafter


def check_num_draft(drafter: Optional[Drafter], num_draft) -> int:
  """The K a (drafter, num_draft) pair runs with (0 without a drafter); ValueError naming what
  is allowed."""
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


@dataclasses.dataclass(frozen=True)
class Chain(Strategy):
  """A chain of K drafts every round, verified in one target forward over K+1 tokens
  (decoding.rounds.chain_round); K = 0 is plain decoding (no drafter)."""
  k: int = 0
  width = property(lambda self: self.k)
  label = property(lambda self: f"K={self.k}")

  def __post_init__(self):
    if not is_static_int(self.k) or self.k < 0:
      raise ValueError(f"Chain(K): K (num_draft) must be an integer >= 0, got {self.k!r}")
    object.__setattr__(self, "k", int(self.k))

  def bind(self, drafter, target) -> "Chain":
    if drafter is None and self.k:
      raise ValueError(f"Chain({self.k}) drafts: it needs a drafter (Chain(0) decodes plainly)")
    check_num_draft(drafter, self.k)
    return self

  def round(self, env, state):
    return chain_round(env, state, k=self.k)
