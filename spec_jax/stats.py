"""Acceptance statistics of a speculative generation."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SpecStats:
  """Counts over every row and round of one generate() call.

  Every count is of what was emitted: a round whose block was cut by max_new_tokens or a stop
  token after e tokens (e <= the drafts it accepted) counts e drafted and e accepted drafts; the
  accepted drafts it threw away count nowhere, like the drafts after a round's first rejection.

  rounds: target verify passes, summed over rows (rows that finished are not counted).
  drafted: draft tokens proposed (valid ones only; an n-gram miss proposes fewer than K; a cut
    round counts the drafts it emitted).
  accepted: accepted draft tokens that were emitted.
  acceptance_rate: accepted / drafted (alpha, per drafted token); 0.0 when nothing was drafted.
  alpha_token: the per-token acceptance alpha of the i.i.d. model, the root in [0, 1] of
    tau = (1 - alpha^(K+1)) / (1 - alpha) for the measured tau (acceptance_rate also counts
    the drafts after a round's first rejection, which were never judged, so it falls with K;
    alpha_token does not). 0.0 when K = 0 or there were no rounds. The model assumes K drafts
    in every round; the last round of a row that max_new_tokens cuts drafts fewer, so on short
    generations alpha_token reads low (a draft identical to the target: 0.82 at 8 new tokens
    and K = 4, 0.98 at 64, where acceptance_rate reads 1.0).
  mean_accepted_length: tokens emitted per target forward, bonus included: emitted / rounds,
    the tau of the papers (= (accepted + rounds) / rounds when no round was cut). 1.0 when
    there were no rounds (max_new_tokens = 1: the prefill's forward emitted the one token) and
    for plain decoding.
  accepted_at: [K] fraction of rounds in which draft position i was accepted and emitted (0.0
    each when there were no rounds).
  seconds: wall time of the compiled generation (prefill + decode loop + the copy of its result
    to the host; compile excluded).
  tokens_per_second: new tokens / seconds, over all rows.
  new_tokens: new tokens emitted over all rows (stop tokens included; the prefill's included).
  iterations: decode-loop iterations (target forwards after the prefill).
  num_draft: K (with num_draft="auto": the largest candidate K, the width of accepted_at).
  emitted: tokens emitted by the rounds (new_tokens less the one token per row the prefill
    sampled).
  k_histogram: {K: decode-loop iterations whose verify was K drafts wide} (K with at least
    one). With num_draft="auto" that is the governor's choice for the batch; a row's own budget
    can be lower (gated to 0 by its acceptance, or its last tokens), so drafted can be less
    than the sum of K x iterations.
  auto: the governor chose K (num_draft="auto"); alpha_token is then 0 (rounds mixed several K,
    so no single K inverts tau; acceptance_rate = accepted / drafted still holds).
  row_counts: per-row counts {'rounds', 'drafted', 'accepted', 'rejected': [B] ints,
    'accepted_at': [B][K] ints} ('rejected' only where the counts had it), or None. Rows
    count rounds only while active, so rounds[b] is also the round at which row b finished (0:
    it finished at the prefill's token): the per-request latency of a batch.
  processes: how many processes fed rows to the generation; every count above sums over all of
    their rows (a multi-process generate() reports global statistics on every process), and
    seconds is this process's wall time of the one collective call.
  tree: None for chains; for tree drafting (depth, top_k, num_nodes, candidates). Then
    num_draft is the depth D, drafted counts the tree nodes verified (so acceptance_rate is
    accepted nodes / verified nodes), accepted_at[d] the rounds whose accepted path reached
    depth d+1, mean_accepted_length is tau, tokens emitted per verify, as for chains, and
    alpha_token is 0 (no chain of K i.i.d. drafts describes a tree round).
  strategy: the label of the round strategy that ran (decoding.strategies: "K=4",
    "K=auto(<=8)", "tree D=..."), what summary() prints first; "" = written from num_draft,
    auto and tree.
  position_acceptance: generate()'s per-position acceptance pooled over the rows
    (DecodeResult.position_acceptance: the governor's estimate with num_draft="auto"), what a
    later call of the same pair takes as its acceptance_prior; None when not measured (and
    after merge of governor or tree runs, whose estimate is not a function of the counts).
  row_acceptance: the same per row of this output (DecodeResult.row_acceptance: the governor's
    per-row estimates with num_draft="auto"), a tuple of tuples: an acceptance_prior that
    carries the rows' spread; None when not measured.
  rejected: rounds whose emitted tokens end in a correction of a rejected draft (RowCounts.
    rejected); None when the counts came without it (statistics made by hand or stored by an
    older version). accepted / (accepted + rejected) is the per-token acceptance over the
    drafts that were judged, exact whatever the rounds' lengths (a cut last round, an n-gram
    miss, the governor's K; bench.metrics.alpha_per_verified_token).
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
  processes: int = 1
  emitted: int = 0
  alpha_token: float = 0.0
  k_histogram: Optional[dict] = None
  auto: bool = False
  tree: Optional[tuple] = None
  strategy: str = ""
  position_acceptance: Optional[tuple] = None
  row_acceptance: Optional[tuple] = None
  rejected: Optional[int] = None

  @classmethod
  def from_counts(cls, rounds, drafted, accepted, accepted_at, seconds, new_tokens, iterations,
                  num_draft, emitted=None, processes: int = 1, rejected=None,
                  **fields) -> "SpecStats":
    """From per-row count arrays (rounds, drafted, accepted [B], accepted_at [B, K], and
    rejected [B] or None) or their totals; the per-row counts are kept in row_counts.
    emitted: the tokens the rounds emitted ([B] or a total); None means no round was cut
    (accepted + rounds). fields: the remaining dataclass fields (k_histogram, auto, tree,
    strategy); with auto or tree, alpha_token is 0.

    Host side and small (B rows): Python lists, not numpy (generate() pays it per call)."""
    row_counts = {name: _int_list(x)
                  for name, x in (("rounds", rounds), ("drafted", drafted), ("accepted", accepted))}
    n_rows = len(row_counts["rounds"])
    if rejected is not None:
      row_counts["rejected"] = _int_list(rejected)
    at_rows = (np.asarray(accepted_at, np.int64).reshape(n_rows, -1).tolist() if num_draft
               else [[] for _ in range(n_rows)])
    row_counts["accepted_at"] = at_rows
    rounds, drafted, accepted = (sum(row_counts[n]) for n in ("rounds", "drafted", "accepted"))
    emitted = accepted + rounds if emitted is None else sum(_int_list(emitted))
    tau = emitted / rounds if rounds else 1.0
    at_totals = [sum(column) for column in zip(*at_rows)] if num_draft else []
    if num_draft and not at_totals:          # no rows: K zero columns
      at_totals = [0] * int(num_draft)
    single_k = not (fields.get("auto") or fields.get("tree"))
    return cls(
        rounds=rounds,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_length=tau,
        accepted_at=tuple(float(a) / rounds if rounds else 0.0 for a in at_totals),
        seconds=float(seconds),
        tokens_per_second=new_tokens / seconds if seconds > 0 else 0.0,
        new_tokens=int(new_tokens),
        iterations=int(iterations),
        num_draft=int(num_draft),
        row_counts=row_counts,
        processes=int(processes),
        emitted=emitted,
        alpha_token=alpha_from_tau(tau, num_draft) if rounds and num_draft and single_k else 0.0,
        rejected=None if rejected is None else sum(row_counts["rejected"]),
        **fields)

  @classmethod
  def from_result(cls, result, seconds: float = 0.0, num_draft: Optional[int] = None,
                  processes: int = 1, auto: bool = False, tree=None,
                  strategy: str = "") -> "SpecStats":
    """Statistics of a DecodeResult (host side; arrays or numpy). tau counts the tokens the
    rounds emitted (every row's first token comes from the prefill, not from a round).
    auto: the result came from num_draft="auto" (the governor). tree: the TreeSpec of a tree
    decode (num_draft is then its depth), or None. strategy: the strategy's label (generate
    passes Strategy.stats_fields for these four)."""
    accepted_at = np.asarray(result.accepted_at)
    k = accepted_at.shape[-1] if num_draft is None else int(num_draft)
    new = [n - p for n, p in zip(_int_list(result.lengths), _int_list(result.prompt_lens))]
    hist = getattr(result, "k_rounds", None)
    if hist is not None:
      hist = {k: n for k, n in enumerate(_int_list(hist)) if n}
    if tree is not None:
      tree = (tree.depth, tree.top_k, tree.num_nodes, tree.candidates)
    return cls.from_counts(
        rounds=result.rounds, drafted=result.drafted, accepted=result.accepted,
        accepted_at=accepted_at, seconds=seconds, new_tokens=sum(new),
        iterations=int(np.asarray(result.iterations)), num_draft=k,
        emitted=[max(n - 1, 0) for n in new], processes=processes, k_histogram=hist,
        auto=bool(auto), tree=tree, strategy=strategy,
        rejected=getattr(result, "rejected", None))

  @classmethod
  def merge(cls, parts: Sequence["SpecStats"]) -> "SpecStats":
    """One SpecStats over several generate() calls of the same configuration (their rows side
    by side): counts, seconds, new tokens and iterations summed, so tokens_per_second is all
    their tokens over all their seconds. Each part needs row_counts."""
    if not parts:
      raise ValueError("SpecStats.merge needs at least one SpecStats")
    first = parts[0]
    if any((p.num_draft, p.auto, p.tree) != (first.num_draft, first.auto, first.tree)
           for p in parts) or any(p.row_counts is None for p in parts):
      raise ValueError("SpecStats.merge takes statistics of one configuration (same num_draft, "
                       "auto and tree), each with its row_counts")
    rows = lambda name: [x for p in parts for x in p.row_counts[name]]
    hist = None
    if any(p.k_histogram for p in parts):
      hist = {}
      for p in parts:
        for k, n in (p.k_histogram or {}).items():
          hist[k] = hist.get(k, 0) + n
    return cls.from_counts(
        rounds=rows("rounds"), drafted=rows("drafted"), accepted=rows("accepted"),
        accepted_at=rows("accepted_at"), seconds=sum(p.seconds for p in parts),
        new_tokens=sum(p.new_tokens for p in parts),
        iterations=sum(p.iterations for p in parts), num_draft=first.num_draft,
        emitted=sum(p.emitted for p in parts), processes=first.processes, k_histogram=hist,
        auto=first.auto, tree=first.tree, strategy=first.strategy,
        rejected=(rows("rejected") if all("rejected" in p.row_counts for p in parts)
                  else None),
        row_acceptance=(None if any(p.row_acceptance is None for p in parts)
                        else tuple(r for p in parts for r in p.row_acceptance)),
        # A fixed-K chain's pooled estimate is a function of the merged counts (it was dropped,
        # and with it the acceptance_prior the bench's merged batches could hand on).
        position_acceptance=(
            tuple(float(a) for a in np.asarray(chain_position_acceptance(
                np.asarray(rows("accepted_at")).reshape(len(rows("rounds")), -1),
                rows("rounds"), rows("drafted"))))
            if not first.auto and first.tree is None and first.num_draft
            and all(p.position_acceptance is not None for p in parts) else None))

  def summary(self) -> str:
    at = " ".join(f"{a:.2f}" for a in self.accepted_at)
    k = f"auto(<={self.num_draft})" if self.auto else str(self.num_draft)
    hist = ""
    if self.auto and self.k_histogram is not None:
      hist = " K_rounds={" + ", ".join(f"{kk}: {n}" for kk, n in
                                       sorted(self.k_histogram.items())) + "}"
    if self.strategy:
      shape = self.strategy + hist
    else:
      shape = (f"K={k}{hist}" if self.tree is None else
               "tree D={},k={},N={},{}".format(*self.tree[:4]))
    return (f"{shape} rounds={self.rounds} drafted={self.drafted} "
            f"accepted={self.accepted} alpha={self.acceptance_rate:.3f} "
            f"alpha_token={self.alpha_token:.3f} "
            f"tau={self.mean_accepted_length:.3f} accepted_at=[{at}] "
            f"new_tokens={self.new_tokens} seconds={self.seconds:.3f} "
            f"tokens/s={self.tokens_per_second:.1f}" +
            (f" (global: summed over {self.processes} processes)" if self.processes > 1 else ""))

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _int_list(x) -> list:
  """A count array (any shape) or a number -> a flat list of Python ints."""
  if isinstance(x, np.ndarray) and x.dtype.kind in "iu":    # the common case: one C call
    return x.reshape(-1).tolist()
  return np.asarray(x, np.int64).reshape(-1).tolist()


def tau_of_alpha(alpha: float, num_draft: int) -> float:
  """Expected tokens per round, (1 - alpha^(K+1)) / (1 - alpha) = 1 + alpha + ... + alpha^K."""
  return float(sum(alpha ** i for i in range(num_draft + 1)))


def alpha_from_tau(tau: float, num_draft: int) -> float:
  """The alpha in [0, 1] with tau_of_alpha(alpha, K) = tau (tau clipped to [1, K+1]).

  f(a) = tau_of_alpha(a, K) - tau is increasing and convex on [0, 1] (a polynomial with
  positive coefficients), so Newton's method started at a = 1 (f(1) > 0) falls monotonically
  onto the unique root; it stops when a step no longer decreases a (float64 precision, a few
  tens of steps at most; generate() pays this per call)."""
  if num_draft < 1:
    raise ValueError(f"alpha_from_tau needs K >= 1, got {num_draft}")
  tau = float(tau)
  if tau <= 1.0:
    return 0.0
  if tau >= num_draft + 1.0:
    return 1.0
  a = 1.0
  for _ in range(200):
    value, slope = 1.0, 0.0
    for _ in range(num_draft):       # Horner for f and f' together: 1 + a (1 + a (1 + ...))
      slope = value + a * slope
      value = 1.0 + a * value
    step = a - (value - tau) / slope
    if not step < a:
      break
    a = step
  return max(a, 0.0)


def chain_position_acceptance(accepted_at, rounds, drafted):
  """float32 [W]: the acceptance of draft position j given the positions before it were
  accepted, pooled over the rows, from per-row counts of rounds that draft W tokens
  (accepted_at [B, W], rounds and drafted [B]; jax or numpy): position 0 was judged in every
  round of a row that drafted at all, position j in the rounds that accepted position j - 1,
  so a_j = sum_b accepted_at[b, j] / sum_b accepted_at[b, j-1] (rounds cut by the token limit,
  or an n-gram round that found nothing, count as judged: an underestimate); a position never
  judged repeats the one before it, -1 when nothing was judged (no round ran, or no row
  drafted). Strategy.position_acceptance in the loop; SpecStats.merge from merged counts."""
  at = jnp.sum(jnp.asarray(accepted_at), axis=0).astype(jnp.float32)         # [W]
  if at.shape[0] == 0:                         # plain decoding: no draft positions
    return at
  first = jnp.sum(jnp.where(jnp.asarray(drafted) > 0, jnp.asarray(rounds), 0))
  judged = jnp.concatenate([first[None].astype(jnp.float32), at[:-1]])
  alpha = at / jnp.maximum(judged, 1.0)
  # carry the last known position forward (positions past the first never-judged one)
  idx = jnp.where(judged > 0, jnp.arange(at.shape[0]), -1)
  last = jax.lax.cummax(idx, axis=0)
  return jnp.where(last >= 0, alpha[jnp.maximum(last, 0)], -1.0)
