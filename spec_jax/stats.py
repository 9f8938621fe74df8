"""Acceptance statistics of a speculative generation."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class SpecStats:
  """Counts over every row and round of one generate() call.

  rounds: target verify passes, summed over rows (rows that finished are not counted).
  drafted: draft tokens proposed (valid ones only; an n-gram miss proposes fewer than K).
  accepted: draft tokens accepted by the rejection sampler.
  acceptance_rate: accepted / drafted (alpha, the per-token acceptance).
  mean_accepted_length: tokens emitted per target forward, bonus included: (accepted + rounds)
    / rounds, the tau of the papers (1.0 for plain decoding).
  accepted_at: [K] fraction of rounds in which draft position i was accepted.
  seconds: wall time of the compiled generation (prefill + decode loop; compile excluded).
  tokens_per_second: new tokens / seconds, over all rows.
  new_tokens: new tokens emitted over all rows (stop tokens included).
  iterations: decode-loop iterations (target forwards after the prefill).
  num_draft: K.
  row_counts: per-row counts {'rounds', 'drafted', 'accepted': [B] ints, 'accepted_at': [B][K]
    ints}, or None. Rows count rounds only while active, so rounds[b] is also the round at which
    row b finished (0: it finished at the prefill's token): the per-request latency of a batch.
  tree: None for chains; for tree drafting (depth, top_k, num_nodes, candidates). Then
    num_draft is the depth D, drafted counts the tree nodes verified (so acceptance_rate is
    accepted nodes / verified nodes), accepted_at[d] the rounds whose accepted path reached
    depth d+1, and mean_accepted_length is tau, tokens emitted per verify, as for chains.
  """
  rounds: int
  drafted: int
  accepted: int
  acceptance_rate: float
  mean_accepted_length: float
  accepted_at: tuple
  seconds: float
  tokens_per_second: float
  new_tokens: int = 0
  iterations: int = 0
  num_draft: int = 0
  row_counts: Optional[dict] = None
  tree: Optional[tuple] = None

  @classmethod
  def from_counts(cls, rounds, drafted, accepted, accepted_at, seconds, new_tokens, iterations,
                  num_draft) -> "SpecStats":
    """From per-row count arrays (rounds, drafted, accepted [B], accepted_at [B, K]) or their
    totals; the per-row counts are kept in row_counts."""
    row_counts = {name: np.asarray(x, np.int64).reshape(-1).tolist()
                  for name, x in (("rounds", rounds), ("drafted", drafted), ("accepted", accepted))}
    n_rows = len(row_counts["rounds"])
    row_counts["accepted_at"] = (np.asarray(accepted_at, np.int64).reshape(n_rows, -1).tolist()
                                 if num_draft else [[] for _ in range(n_rows)])
    rounds, drafted, accepted = int(np.sum(rounds)), int(np.sum(drafted)), int(np.sum(accepted))
    accepted_at = np.asarray(accepted_at).reshape(-1, num_draft).sum(0) if num_draft else np.zeros(0)
    return cls(
        rounds=rounds,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=(accepted + rounds) / rounds if rounds else 0.0,
        accepted_at=tuple(float(a) / rounds if rounds else 0.0 for a in accepted_at),
        seconds=float(seconds),
        tokens_per_second=new_tokens / seconds if seconds > 0 else 0.0,
        new_tokens=int(new_tokens),
        iterations=int(iterations),
        num_draft=int(num_draft),
        row_counts=row_counts)

  @classmethod
  def from_result(cls, result, seconds: float = 0.0, num_draft: Optional[int] = None,
                  tree=None) -> "SpecStats":
    """Statistics of a DecodeResult (host side; arrays or numpy). tau counts the tokens the
    rounds emitted (every row's first token comes from the prefill, not from a round)."""
    accepted_at = np.asarray(result.accepted_at)
    k = accepted_at.shape[-1] if num_draft is None else int(num_draft)
    new = np.asarray(result.lengths) - np.asarray(result.prompt_lens)
    stats = cls.from_counts(
        rounds=np.asarray(result.rounds), drafted=np.asarray(result.drafted),
        accepted=np.asarray(result.accepted), accepted_at=accepted_at, seconds=seconds,
        new_tokens=int(new.sum()), iterations=int(np.asarray(result.iterations)), num_draft=k)
    rounds = stats.rounds
    from_rounds = int(new.sum()) - int(np.sum(new > 0))
    tau = from_rounds / rounds if rounds else 1.0
    tree = None if tree is None else (tree.depth, tree.top_k, tree.num_nodes, tree.candidates)
    return dataclasses.replace(stats, mean_accepted_length=tau, tree=tree)

  def summary(self) -> str:
    at = " ".join(f"{a:.2f}" for a in self.accepted_at)
    shape = (f"K={self.num_draft}" if self.tree is None else
             "tree D={},k={},N={}{}".format(*self.tree[:3],
                                            "" if self.tree[3] == "topk" else ",sampled"))
    return (f"{shape} rounds={self.rounds} drafted={self.drafted} "
            f"accepted={self.accepted} alpha={self.acceptance_rate:.3f} "
            f"tau={self.mean_accepted_length:.3f} accepted_at=[{at}] "
            f"new_tokens={self.new_tokens} seconds={self.seconds:.3f} "
            f"tokens/s={self.tokens_per_second:.1f}")

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)
