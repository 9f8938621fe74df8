"""The governed loop (num_draft="auto") and its round strategy."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_jax.decoding.rounds import RoundStrategy, chain_round
from spec_jax.decoding.state import DecodeState, LoopEnv
from spec_jax.drafters.base import Drafter
from spec_jax.governor.choice import choose, observe, row_alpha
from spec_jax.governor.options import Governor, GovernorState


def governed_loop(env: LoopEnv, gov: Governor, costs, state: DecodeState,
                  until=None) -> DecodeState:
  """The loop of num_draft="auto" (Governed.run; a chain runs one fixed-K while_loop instead).

  costs: float32 [len(candidates)] seconds per round at each candidate K.

  Every round runs the K the governor chose after the previous round (GovernorState.choice).
  The rounds of each candidate K form their own inner `lax.while_loop` (body: chain_round at
  that K, then the statistics and the next choice), which runs while the choice stays its K;
  an outer `lax.while_loop` visits the inner loops in turn (K >= 1 first, K = 0 last) until
  every row is done. Each round pays only for its K. (A `lax.switch` over per-K rounds in one
  loop would be the obvious form, but XLA:CPU then copies the KV caches through the
  conditional every round: +50% per round at B = 16 for stories260K. While loops keep their
  carry in place.) A drafter that skipped plain rounds catches up once per outer iteration,
  before the drafting loops (Drafter.catch_up; nothing to do when it is in sync).

  until: optional int, stop after this many rounds (tests)."""
  ks = gov.candidates(env.drafter)
  gate = gov.gate_alpha > 0
  env = env._replace(rolled=True)        # one draft-step body per K: a smaller program
  lazy = type(env.drafter).catch_up is not Drafter.catch_up
  drafts = jnp.asarray([k > 0 for k in ks])

  def running(st):
    go = ~jnp.all(st.done)
    return go if until is None else go & (st.iterations < until)

  def body(i, k):
    def run(st):
      rows = (row_alpha(st.governor) >= gov.gate_alpha) if (gate and k) else None
      new = chain_round(env, st, k=k, draft_rows=rows)
      gs = observe(gov, st.governor, st, new, k, rows)
      gs = gs.replace(k_hist=gs.k_hist.at[i].add(1))
      choice, _ = choose(gov, ks, gs, costs, ~new.done, new.iterations)
      return new.replace(governor=gs.replace(choice=choice))
    return run

  def outer(st):
    if lazy:      # before a plain round the drafter is told lengths 0: nothing to do
      st = st.replace(drafter_state=env.drafter.catch_up(
          env.drafter_params, st.drafter_state, st.tokens,
          jnp.where(drafts[st.governor.choice], st.lengths, 0)))
    for i in sorted(range(len(ks)), key=lambda j: ks[j] == 0):
      st = jax.lax.while_loop(lambda s, i=i: running(s) & (s.governor.choice == i),
                              body(i, ks[i]), st)
    return st

  gs = state.governor
  choice, _ = choose(gov, ks, gs, costs, ~state.done, state.iterations)
  state = state.replace(governor=gs.replace(choice=choice))
  return jax.lax.while_loop(running, outer, state)


def k_rounds(ks: tuple, gs: GovernorState):
  """int32 [max(ks)+1]: loop iterations per K (index = K) from the governor's histogram over
  the candidates ks."""
  return jnp.zeros((max(ks) + 1,), jnp.int32).at[jnp.asarray(ks)].set(gs.k_hist)


@dataclasses.dataclass(frozen=True)
class Governed(RoundStrategy):
  """num_draft="auto": every round the governor picks K among `candidates` (0 = a plain step)
  from the cost table (LoopEnv.round_costs) and the live acceptance; the drafter may skip the
  plain rounds and catch up (lazy)."""
  governor: Governor
  candidates: tuple
  lazy_drafter: bool = True

  @classmethod
  def of(cls, governor: Governor, drafter) -> "Governed":
    return cls(governor, governor.candidates(drafter))

  @property
  def width(self) -> int:
    return max(self.candidates)

  @property
  def extent(self) -> int:
    return max(self.candidates)

  def round_costs(self, drafter, round_costs):
    return self.governor.cost_array(drafter, round_costs)        # ValueError on a bad table

  def init(self, env, state):
    return state.replace(governor=self.governor.init_state(env.drafter, state.tokens.shape[0]))

  def run(self, env, state):
    return governed_loop(env, self.governor, env.round_costs, state)

  def k_rounds(self, final):
    return k_rounds(self.candidates, final.governor)
