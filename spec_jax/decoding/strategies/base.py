"""Strategy: the interface of a way to run decode's rounds.

A strategy is a static, hashable object (a jit static argument) with pure functions over the
loop's state, in optax's style: `init` makes the state the strategy owns (it lives in
DecodeState.strategy; the core never looks inside), `round` runs one round, `run` runs rounds
until every row is done. Strategies call the core's round primitives (decoding.rounds) and
never import the loop; the loop (decoding.loop.decode) calls them.

Adding a strategy: a module in this package with a subclass, and its name in the package's
__init__. A sketch, a chain whose rows each draft their own number of tokens (the chain round
verifies [B, K+1] and masks each row's drafts past its budget):

    @dataclasses.dataclass(frozen=True)
    class Budgeted(Strategy):
      k: int                                   # the static maximum
      width = property(lambda self: self.k)
      def init(self, env, state):              # its own state: each row's budget, int32 [B]
        return jnp.full(state.lengths.shape, self.k, jnp.int32)
      def round(self, env, state):
        return chain_round(env, state, k=self.k, draft_rows=state.strategy)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax.numpy as jnp

from spec_jax.decoding.rounds import run_until_done
from spec_jax.decoding.state import DecodeState, LoopEnv
from spec_jax.governor.options import shrunk_rates
from spec_jax.stats import chain_position_acceptance


class Strategy:
  """How a decode runs its rounds (static, hashable; subclasses are frozen dataclasses).

  Attributes:
    width: accepted_at columns, the most drafts a round can accept (K; a tree's depth D).
    extent: cache slots past the last committed token a round may write (default: the width;
      a tree's cache_extent); capacity must hold the prompt + max_new_tokens + extent + 1.
    verify_tokens: tokens the target verifies in one round, the last committed one included
      (default: width + 1; a tree's num_nodes + 1): what a Target's max_verify bounds.
    lazy_drafter: the drafter may skip plain rounds and catch up later (PrefillInfo.lazy).
  """
  width: int = 0
  extent = property(lambda self: self.width)
  verify_tokens = property(lambda self: self.width + 1)
  lazy_drafter: bool = False

  def bind(self, drafter, target) -> "Strategy":
    """The strategy that runs with this drafter (None: no drafter) on this target (a Target, or
    None to skip the target's checks), defaults resolved; ValueError when it cannot. decode and
    generate call it once per call, before anything compiles; binding a bound strategy gives
    an equal one."""
    del drafter, target
    return self

  def round_costs(self, drafter, round_costs) -> Optional[Any]:
    """The per-round cost table this strategy reads (LoopEnv.round_costs: float32 [N]),
    checked; None for strategies that do not choose by cost (round_costs is then ignored)."""
    del drafter, round_costs
    return None

  def acceptance_prior(self, prior) -> Optional[Any]:
    """generate()'s acceptance_prior as the array decode takes, checked; None for strategies
    that take none (the prior is then ignored)."""
    del prior
    return None

  @property
  def calibration_ks(self) -> Optional[tuple]:
    """The K values whose per-round seconds generate() must measure for this strategy (the
    order of its round_costs), or None when it needs no measured table."""
    return None

  def init(self, env: LoopEnv, state: DecodeState) -> Any:
    """This strategy's own state after the prefill (DecodeState.strategy); () for none."""
    del env, state
    return ()

  def init_drafter(self, env: LoopEnv, state: DecodeState, init: Callable[[], Any]) -> Any:
    """The drafter's state after the prefill: init() (Drafter.init_state on the prefill),
    unless this strategy knows before the first round that the drafter will never run (the
    governor, when its first round is plain and plain is final). state: the state after the
    prefill, drafter_state None."""
    del env, state
    return init()

  def round(self, env: LoopEnv, state: DecodeState) -> DecodeState:
    """One round: the state after it, statistics included (decoding.rounds.update_stats)."""
    raise NotImplementedError(f"{type(self).__name__} defines no round")

  def run(self, env: LoopEnv, state: DecodeState) -> DecodeState:
    """Rounds until every row is done (default: `round` in one while loop)."""
    return run_until_done(functools.partial(self.round, env), state)

  def k_rounds(self, final: DecodeState):
    """int32 [width+1]: loop iterations per number of drafts (default: all at `width`)."""
    return jnp.zeros((self.width + 1,), jnp.int32).at[self.width].set(final.iterations)

  def position_acceptance(self, final: DecodeState):
    """float32 [width]: the acceptance of draft position j given the positions before it were
    accepted, pooled over the rows (DecodeResult.position_acceptance). Default: from the counts
    of a round that drafts `width` tokens (spec_jax.stats.chain_position_acceptance)."""
    return chain_position_acceptance(final.counts.accepted_at, final.counts.rounds,
                                     final.counts.drafted)

  def row_acceptance(self, final: DecodeState):
    """float32 [B, width]: each row's acceptance from its own counts (judged as in
    position_acceptance), shrunk toward the pooled rate (governor.options.shrunk_rates: a
    row judged twice stays near the pool; a row that never drafted takes the pool's); -1
    where nothing was judged at all.
    DecodeResult.row_acceptance: the spread a later call's acceptance_prior can carry."""
    at = final.counts.accepted_at.astype(jnp.float32)                          # [B, W]
    if at.shape[1] == 0:
      return at
    judged = jnp.concatenate([_rounds_with_drafts(final).astype(jnp.float32)[:, None],
                              at[:, :-1]], axis=1)
    return shrunk_rates(at, judged, self.position_acceptance(final))

  def stats_fields(self, greedy: bool, drafter) -> dict:
    """SpecStats.from_result's description of the rounds: num_draft (accepted_at's width),
    auto (several K), tree (a TreeSpec) and the label statistics print."""
    del greedy, drafter
    return {"num_draft": self.width, "strategy": self.label}

  @property
  def label(self) -> str:
    """What statistics print for these rounds (SpecStats.strategy)."""
    return type(self).__name__


def _rounds_with_drafts(final: DecodeState):
  """int32 [B]: each row's rounds, 0 for a row that never drafted (nothing of it was judged)."""
  return jnp.where(final.counts.drafted > 0, final.counts.rounds, 0)
