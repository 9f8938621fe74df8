"""The decode loop's state types: the carry, the result, what every round closes over."""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax

from spec_jax.decoding.target import Target
from spec_jax.drafters.base import Drafter
from spec_jax.sampling import Sampling


@flax.struct.dataclass
class DecodeState:
  """Loop carry. B rows, capacity S, K drafts.

  tokens: int32 [B, S] prompt + generated tokens; row b valid in [0, lengths[b]).
  lengths: int32 [B] committed tokens.
  done: bool [B] rows that hit a stop token or max_new_tokens (they keep running, masked).
  cache: the target's KV cache (its own pytree: spec_jax.models' KVCache [L, B, S, Hkv, Dh]).
  drafter_state: the drafter's pytree.
  key: PRNG key, split once per round.
  rounds, drafted, accepted: int32 [B] statistics; accepted_at: int32 [B, K].
  finished_at_round: int32 [B], the round in which the row finished (0 = at the prefill), or -1
    while it runs.
  iterations: int32 scalar, loop iterations so far.
  governor: the governor's state with num_draft="auto" (spec_jax.governor.GovernorState), else ().
  """
  tokens: jax.Array
  lengths: jax.Array
  done: jax.Array
  cache: Any
  drafter_state: Any
  key: jax.Array
  rounds: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  accepted_at: jax.Array
  finished_at_round: jax.Array
  iterations: jax.Array
  governor: Any = ()


@flax.struct.dataclass
class DecodeResult:
  """What `decode` returns: arrays only (B rows, capacity S, K drafts).

  tokens: int32 [B, S]; row b holds its prompt in [0, prompt_lens[b]) and its new tokens in
    [prompt_lens[b], lengths[b]) (a stop token that ended the row included); the rest is junk.
  lengths: int32 [B] prompt + new tokens.
  prompt_lens: int32 [B].
  rounds: int32 [B] target verify passes while the row was running.
  drafted: int32 [B] valid draft tokens proposed to the row.
  accepted: int32 [B] drafts accepted AND emitted (drafts cut by a stop token or the token limit
    are not counted).
  accepted_at: int32 [B, K], rounds in which draft position i was accepted and emitted.
  finished_at_round: int32 [B], the loop iteration in which the row finished (0 = its first
    token, sampled at the prefill, already ended it): a request's latency in rounds.
  iterations: int32 scalar, loop iterations (target forwards after the prefill).
  k_rounds: int32 [K+1], loop iterations that ran with k drafts, k = 0..K (a fixed K puts every
    iteration at index K, a tree at its depth D; with num_draft="auto" it is the governor's
    histogram of choices).
  """
  tokens: jax.Array
  lengths: jax.Array
  prompt_lens: jax.Array
  rounds: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  accepted_at: jax.Array
  finished_at_round: jax.Array
  iterations: jax.Array
  k_rounds: jax.Array


class LoopEnv(NamedTuple):
  """What every round of one decode call closes over (set once, before the loop).

  target (a spec_jax.decoding.target.Target), drafter, greedy, layers, rolled are static; the
  rest are arrays: drafter_params and target_params (execution layout), sampling (per-row
  [B]), stop_tokens int32 [N], limit int32 [B] (the longest committed length of each row).
  rolled: drafters run their K-1 draft steps as a loop rather than unrolled
  (DraftContext.rolled; the governor's many K compile faster). round_costs: float32 [N] the
  cost table of a strategy that chooses its rounds by cost (the governor), else None."""
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
