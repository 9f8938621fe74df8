"""The strategy a decode or generate call runs: its strategy= argument, or the sugar num_draft=,
tree= and governor= turned into one, checked against the drafter and target once."""

from __future__ import annotations

from spec_jax.decoding.strategies.base import Strategy
from spec_jax.decoding.strategies.chain import Chain, check_num_draft
from spec_jax.decoding.strategies.governed import Governed
from spec_jax.decoding.strategies.tree import Tree
from spec_jax.drafters.registry import TREE_DRAFTERS
from spec_jax.tree.spec import check_tree

DEFAULT_NUM_DRAFT = 4      # decode's and generate's num_draft default
AUTO = Governed            # strategy="auto" (and num_draft="auto")


def strategy_for(strategy=None, drafter=None, num_draft=DEFAULT_NUM_DRAFT, tree=None,
                 governor=None, target=None) -> Strategy:
  """The bound Strategy of a call (ValueError on a bad combination, before anything compiles;
  decode and generate share it, so their messages agree).

  strategy: a Strategy (Chain(K), Tree(spec), Governed(governor), or one of your own), "auto",
    or None: then the sugar decides. A tree= gives Tree(tree) (num_draft ignored beside it,
    "auto" refused); num_draft="auto" gives Governed(governor); otherwise Chain(num_draft)
    (Chain(0) without a drafter). With strategy=, num_draft stays at its default and tree= and
    governor= at None.
  target: a Target to check the strategy against, or None (host-side sizing)."""
  if strategy is None:
    strategy = _from_sugar(drafter, num_draft, tree, governor)
  else:
    if tree is not None or governor is not None or num_draft != DEFAULT_NUM_DRAFT:
      raise ValueError("give strategy= or the num_draft= / tree= / governor= it replaces, not "
                       "both")
    if is_auto(strategy):
      strategy = AUTO()
    elif not isinstance(strategy, Strategy):
      raise ValueError(f"strategy must be 'auto' or a spec_jax.strategies Strategy (Chain(K), "
                       f"Tree(spec), Governed(...)), got {strategy!r}")
  bound = strategy.bind(drafter, target)
  limit = getattr(target, "max_verify", None)
  if limit is not None and bound.verify_tokens > limit:
    raise ValueError(f"this target verifies at most {limit} tokens per round (K <= {limit - 1}, "
                     f"its cache's per-position buffers); {bound.label} verifies "
                     f"{bound.verify_tokens} (its drafts and the last committed token)")
  return bound


def _from_sugar(drafter, num_draft, tree, governor) -> Strategy:
  if tree is not None:
    return Tree(check_tree(tree, drafter, num_draft, governor, TREE_DRAFTERS))
  if is_auto(num_draft):
    return AUTO(governor)
  if governor is not None:
    raise ValueError("governor= is used only with num_draft='auto'")
  return Chain(check_num_draft(drafter, num_draft))


def is_auto(value) -> bool:
  """num_draft="auto" / strategy="auto"."""
  return isinstance(value, str) and value == "auto"
