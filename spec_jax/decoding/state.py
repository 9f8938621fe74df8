"""The decode loop's state types: the carry, its statistics, the result, what every round
closes over."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.struct
import jax

from spec_jax.decoding.target import Target
from spec_jax.drafters.base import Drafter
from spec_jax.sampling import Sampling


@flax.struct.dataclass
class RowCounts:
  """Per-row statistics of the rounds so far (B rows, W = the strategy's width). Rows count
  only while they run.

  rounds: int32 [B] target verify passes.
  drafted: int32 [B] valid draft tokens proposed.
  accepted: int32 [B] drafts accepted and emitted (drafts cut by a stop token or the token
    limit are not counted).
  accepted_at: int32 [B, W] rounds in which draft position i was accepted and emitted.
  finished_at_round: int32 [B] the loop iteration in which the row finished (0 = at the
    prefill), or -1 while it runs.
  rejected: int32 [B] rounds that emitted a correction in place of a rejected draft (a round
    cut by a stop token or the token limit before its rejection counts none): with accepted,
    the judged drafts' outcomes, so accepted / (accepted + rejected) is the per-token acceptance
    whatever the rounds' lengths (bench.metrics.alpha_per_verified_token).
  """
  rounds: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  accepted_at: jax.Array
  finished_at_round: jax.Array
  rejected: jax.Array


@flax.struct.dataclass
class DecodeState:
  """Loop carry. B rows, capacity S.

  tokens: int32 [B, S] prompt + generated tokens; row b valid in [0, lengths[b]).
  lengths: int32 [B] committed tokens.
  done: bool [B] rows that hit a stop token or max_new_tokens (they keep running, masked).
  cache: the target's KV cache (its own pytree: spec_jax.models' KVCache [L, B, S, Hkv, Dh]).
  drafter_state: the drafter's pytree.
  key: PRNG key, split once per round.
  counts: RowCounts, the statistics (decoding.rounds.update_stats adds each round's).
  iterations: int32 scalar, loop iterations so far.
  strategy: the round strategy's own state (Strategy.init: the governor's GovernorState), or
    (); the core never looks inside.
  sampling_state: per-row state of the sampling transform that rounds update as they commit
    tokens: the penalties' sampling.History (counts [B, V], prompt [B, V]) when the loop
    tracks it (LoopEnv.history), else ().
  """
  tokens: jax.Array
  lengths: jax.Array
  done: jax.Array
  cache: Any
  drafter_state: Any
  key: jax.Array
  counts: RowCounts
  iterations: jax.Array
  strategy: Any = ()
  sampling_state: Any = ()


@flax.struct.dataclass
class DecodeResult:
  """What `decode` returns: arrays only (B rows, capacity S, W = the strategy's width: K, a
  tree's depth, the governor's largest K).

  tokens: int32 [B, S]; row b holds its prompt in [0, prompt_lens[b]) and its new tokens in
    [prompt_lens[b], lengths[b]) (a stop token that ended the row included); the rest is junk.
  lengths: int32 [B] prompt + new tokens.
  prompt_lens: int32 [B].
  rounds, drafted, accepted, rejected: int32 [B]; accepted_at: int32 [B, W];
    finished_at_round: int32 [B] (0 = its first token, sampled at the prefill, already ended
    it: a request's latency in rounds): the RowCounts of the last round.
  iterations: int32 scalar, loop iterations (target forwards after the prefill).
  k_rounds: int32 [W+1], loop iterations that ran with k drafts, k = 0..W (a fixed K puts every
    iteration at index K, a tree at its depth D; with num_draft="auto" it is the governor's
    histogram of choices: the verify width, while a row's own budget can be lower, gated or
    capped by its last tokens).
  position_acceptance: float32 [W], the acceptance of draft position j given that the ones
    before it were accepted, pooled over the rows (Strategy.position_acceptance; -1 where
    nothing was judged): with num_draft="auto" the governor's estimate, what the next call of
    the same pair takes as its `acceptance_prior`.
  row_acceptance: float32 [B, W], the same for each row from its own counts
    (Strategy.row_acceptance): the rows' spread, which a later call's `acceptance_prior` may
    carry instead of the pooled estimate.
  """
  tokens: jax.Array
  lengths: jax.Array
  prompt_lens: jax.Array
  rounds: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  accepted_at: jax.Array
  finished_at_round: jax.Array
  rejected: jax.Array
  iterations: jax.Array
  k_rounds: jax.Array
  position_acceptance: jax.Array
  row_acceptance: jax.Array

  @classmethod
  def of(cls, final: DecodeState, prompt_lens, k_rounds, position_acceptance,
         row_acceptance) -> "DecodeResult":
    """The result of the loop's final state."""
    counts = {f.name: getattr(final.counts, f.name) for f in dataclasses.fields(RowCounts)}
    return cls(tokens=final.tokens, lengths=final.lengths, prompt_lens=prompt_lens,
               iterations=final.iterations, k_rounds=k_rounds,
               position_acceptance=position_acceptance, row_acceptance=row_acceptance,
               **counts)


class LoopEnv(NamedTuple):
  """What every round of one decode call closes over (set once, before the loop).

  target (a spec_jax.decoding.target.Target), drafter, greedy, layers, rolled, history are
  static; the
  rest are arrays: drafter_params and target_params (execution layout), sampling (per-row
  [B]), stop_tokens int32 [N], limit int32 [B] (the longest committed length of each row).
  rolled: drafters run their K-1 draft steps as a loop rather than unrolled
  (DraftContext.rolled; the governor's many K compile faster). round_costs: float32 [N] the
  cost table of a strategy that chooses its rounds by cost (Strategy.round_costs), else None.
  acceptance_prior: float32 [W] per-position acceptance learned from earlier calls (decode's
  acceptance_prior: the governor's starting estimate), or None.
  history: (static) the loop carries the token history (DecodeState.sampling_state) and
  applies the penalties; False when every penalty is concretely off (nothing is paid)."""
  target: Target
  drafter: Drafter
  drafter_params: Any
  target_params: Any
  sampling: Sampling
  stop_tokens: jax.Array
  limit: jax.Array
  greedy: bool
  layers: tuple
  rolled: bool = False
  round_costs: Any = None
  history: bool = False
  acceptance_prior: Any = None

  def history_of(self, st: "DecodeState"):
    """The committed sampling.History of st, or None when the loop tracks none."""
    return st.sampling_state if self.history else None
