"""TreeSpec: the shape of every round's draft tree, and the checks of a tree call."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import numpy as np

MAX_TREE_TOKENS = 64       # root + nodes per verify: the kernels' two 32-bit mask words per row
CANDIDATES = ("auto", "topk", "sampled", "distinct", "best_first")
# What "auto" draws at T > 0 (greedy rows always take the top-k): samples without replacement
# accepted more than top-k children at T = 1 in scripts/tree_tau.py (docs/trees.md).
SAMPLED_DEFAULT = "distinct"


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """The shape of the draft tree of every round (static, hashable).

  depth: D, the most drafts accepted per round (the deepest node), >= 1.
  top_k: k, children per expanded node (EAGLE-2: also the frontier width; n-gram: branches).
  num_nodes: N, draft nodes verified per round (the root, the last committed token, is extra):
    depth <= N and N + 1 <= 64.
  candidates: "auto" (the default: top-k when greedy, SAMPLED_DEFAULT at T > 0), "topk"
    (deterministic top-k children; verified by recursive rejection with one-hot drafts),
    "sampled" (children drawn i.i.d. from the drafter's q; SpecInfer's multi-step speculative
    sampling), "distinct" (children drawn from q without replacement; recursive rejection
    sampling) or "best_first" (DDTree: the N likeliest sequences under the drafter's q, found
    best-first, at every temperature; deterministic candidates, verified like top-k ones; only
    block drafters, DFlash and DSpark, build them; top_k caps one node's children, no cap when
    top_k >= num_nodes). Greedy decoding and deterministic drafters (n-gram,
    greedy_drafts=True) use top-k candidates for the other kinds.
  """
  depth: int
  top_k: int
  num_nodes: int
  candidates: str = "auto"

  def __post_init__(self):
    for name in ("depth", "top_k", "num_nodes"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (numbers.Integral, np.integer)):
        raise ValueError(f"TreeSpec.{name} must be an integer, got {v!r}")
      object.__setattr__(self, name, int(v))
    if self.depth < 1:
      raise ValueError(f"TreeSpec.depth must be >= 1, got {self.depth}")
    if not 1 <= self.top_k < MAX_TREE_TOKENS:
      # A verify holds at most MAX_TREE_TOKENS - 1 nodes, so a larger k caps nothing more; it
      # only sized the drafter's frontier (top_k per depth) into the cache: 2**31 was a 32 GiB
      # allocation instead of this error.
      raise ValueError(f"TreeSpec.top_k must be in 1 .. {MAX_TREE_TOKENS - 1} (k >= num_nodes "
                       f"already caps nothing), got {self.top_k}")
    if self.num_nodes < self.depth:
      raise ValueError(f"TreeSpec.num_nodes ({self.num_nodes}) must be >= depth ({self.depth}): "
                       "a tree of depth D needs at least D nodes")
    if self.num_nodes + 1 > MAX_TREE_TOKENS:
      raise ValueError(f"TreeSpec.num_nodes ({self.num_nodes}) + 1 (the root) must be <= "
                       f"{MAX_TREE_TOKENS} (two 32-bit mask words per verify row): num_nodes <= "
                       f"{MAX_TREE_TOKENS - 1}")
    if self.candidates not in CANDIDATES:
      raise ValueError(f"TreeSpec.candidates must be one of {CANDIDATES}, got "
                       f"{self.candidates!r}")

  @property
  def cache_extent(self) -> int:
    """Cache slots past the last committed token a round may write: the N verify nodes, and a
    drafter's frontier nodes (at most top_k per depth below D; best-first trees have none)."""
    if self.candidates == "best_first":
      return self.num_nodes
    return max(self.num_nodes, self.top_k * (self.depth - 1))

  def candidates_for(self, greedy: bool) -> str:
    """The candidate kind drafted for greedy (every row temperature 0) or sampled decoding
    (best-first trees are best-first at every temperature)."""
    if self.candidates == "best_first":
      return "best_first"
    if greedy:
      return "topk"
    return SAMPLED_DEFAULT if self.candidates == "auto" else self.candidates

  def resolved(self, greedy: bool) -> "TreeSpec":
    """The same tree with the candidate kind drafted at this temperature ("auto" resolved)."""
    return dataclasses.replace(self, candidates=self.candidates_for(greedy))

  def label(self, greedy: Optional[bool] = None) -> str:
    """'tree D=..,k=..,N=..' plus the candidate kind drafted (resolved when greedy is known)."""
    kind = self.candidates if greedy is None else self.candidates_for(greedy)
    return f"tree D={self.depth},k={self.top_k},N={self.num_nodes},{kind}"


def parse_tree_spec(text: str) -> TreeSpec:
  """'D,k,N' or 'D,k,N,CANDIDATES' (auto, topk, sampled, distinct or best_first; the bench's
  --tree) ->
  TreeSpec; ValueError otherwise."""
  parts = [p.strip() for p in str(text).split(",")]
  if len(parts) not in (3, 4):
    raise ValueError(f"a tree is written D,k,N or D,k,N,{'|'.join(CANDIDATES)} (depth, top_k, "
                     f"num_nodes[, candidates]), got {text!r}")
  try:
    d, k, n = (int(p) for p in parts[:3])
  except ValueError:
    raise ValueError(f"a tree's D,k,N must be integers, got {text!r}") from None
  return TreeSpec(d, k, n, parts[3] if len(parts) == 4 else "auto")


def check_tree(tree, drafter, num_draft=None, governor=None, tree_drafters=None) -> TreeSpec:
  """The TreeSpec a (tree, drafter) pair runs with; ValueError naming what is allowed.
  num_draft is ignored beside a tree, except "auto" (the governor picks a chain's K per round
  from a cost table of chains; it has no tree shapes to choose from), refused with governor=.
  tree_drafters: the names of the drafters that build trees, for the messages (the decode
  core passes spec_jax.drafters.registry.TREE_DRAFTERS; this layer sits below the drafters)."""
  can = (", ".join(tree_drafters) if tree_drafters else
         "the drafters whose supports_tree is True")
  if not isinstance(tree, TreeSpec):
    raise ValueError(f"tree must be a spec_jax.TreeSpec(depth=, top_k=, num_nodes=) for tree "
                     f"drafting, or None; got {type(tree).__name__}")
  if drafter is None:
    raise ValueError(f"tree drafting needs a drafter ({can}); got drafter=None")
  if (isinstance(num_draft, str) and num_draft == "auto") or governor is not None:
    raise ValueError("tree drafting does not combine with num_draft='auto' or governor= (the "
                     "governor chooses among chain lengths K); allowed: tree=TreeSpec(...) with "
                     "an integer num_draft (ignored), or num_draft='auto' with tree=None")
  if not getattr(drafter, "supports_tree", False):
    raise ValueError(f"{type(drafter).__name__} cannot build draft trees; drafters that can: "
                     f"{can} (or pass tree=None for a chain)")
  if tree.candidates == "best_first" and not getattr(drafter, "supports_best_first", False):
    raise ValueError(f"{type(drafter).__name__} cannot build best-first (DDTree) trees: they "
                     "need every depth's child distribution from one forward (block drafters: "
                     "DFlash, DSpark); use candidates 'auto', 'topk', 'sampled' or 'distinct' "
                     "with this drafter")
  return tree
