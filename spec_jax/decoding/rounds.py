"""The round primitives and the chain round: propose -> verify -> accept -> commit -> statistics.

One round (fixed shapes; ../shared/DESIGN.md):

    drafter.propose ─► draft_tokens [B,K] (+ q [B,K,V] or None)
    [last committed token, drafts] [B,K+1] ─► verify_step: one target forward at cache offsets
        lengths-1 .. lengths-1+K ─► p [B,K+1,V] ─► rejection_sample ─► tokens [B,K+1], n_accepted
    commit: lengths += emitted (n_accepted + 1, cut at a stop token or max_new_tokens);
        rejected KV slots stay in the cache, masked by the lengths, and are overwritten later;
        Target.commit_cache keeps a recurrent state's accepted prefix (identity for KV caches).

Invariant: row b holds `lengths[b]` committed tokens in `tokens[b]`; the target's KV cache holds
entries for positions < lengths[b] - 1 (the last committed token is fed in the next round).
K = 0 (no drafter) is plain autoregressive decoding through the same loop: the baseline.

The ways to run rounds (a chain, a tree, the governor) are the strategies of
decoding.strategies; they call these primitives, which know none of them.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from spec_jax import sampling as sampling_lib
from spec_jax.decoding.state import DecodeState, LoopEnv
from spec_jax.decoding.target import as_target
from spec_jax.drafters.base import DraftContext, Drafter, VerifyInfo
from spec_jax.rejection import rejection_sample
from spec_jax.sampling import Sampling


class NoDrafter(Drafter):
  """K = 0: plain decoding. Proposes nothing."""
  reads_prompt_hidden = False

  def propose(self, params, state, ctx):
    b = ctx.tokens.shape[0]
    return jnp.zeros((b, 0), jnp.int32), None, state


def row_keys(key, batch: int):
  """One key per row, fold_in(key, row): a row's randomness does not depend on the others."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch))


def draft_step(drafter: Drafter, drafter_params, drafter_state, ctx: DraftContext):
  """Runs the drafter. Returns (draft_tokens [B,K] with -1 padding, draft_probs or None,
  draft_lengths int32 [B], drafter_state)."""
  draft_tokens, draft_probs, drafter_state = drafter.propose(drafter_params, drafter_state, ctx)
  draft_tokens = draft_tokens.astype(jnp.int32)
  valid = jnp.cumprod((draft_tokens >= 0).astype(jnp.int32), axis=1)  # a prefix per row
  return draft_tokens, draft_probs, jnp.sum(valid, axis=1), drafter_state


def verify_step(params, target, cache, last_tokens, draft_tokens, lengths, sampling: Sampling,
                return_layers: Sequence[int] = (), greedy: bool = False, history=None):
  """One target forward over [last committed token, drafts] at offsets lengths-1.

  Args:
    target: a Target (or a ModelConfig, wrapped by as_target).
    last_tokens: int32 [B]; draft_tokens: int32 [B, K] (-1 padding allowed); lengths: int32 [B].
    greedy: every row is greedy (static): skip the probabilities, return the argmax.
    history: the committed sampling.History [B, V] or None (no penalties); verify position i
      is processed with it plus drafts 0..i-1 (`chain_history`): its own prefix.
  Returns:
    (target_probs [B, K+1, V] — or, when greedy, the target's argmax int32 [B, K+1] —,
    ForwardOutput) — the output carries the updated cache and the hidden states drafters follow.
  """
  inputs = jnp.concatenate([last_tokens[:, None], jnp.maximum(draft_tokens, 0)], axis=1)
  out = as_target(target).forward(params, inputs, cache, lengths - 1, return_layers=return_layers)
  rows = None if history is None else chain_history(history, draft_tokens)
  if greedy:
    return sampling_lib.greedy_tokens(out.logits, sampling, rows), out
  return sampling_lib.probs(out.logits, sampling, rows), out


def chain_history(history, draft_tokens):
  """The History of each of a chain's K+1 verify positions [B, K+1, V]: the committed one
  plus the drafts before the position (History.along_chain; a module-level name so that
  tests can swap in a lossy variant)."""
  return history.along_chain(draft_tokens)


def accept_step(key, draft_tokens, draft_probs, target_probs, draft_lengths):
  """Per-row rejection sampling with fold_in(key, row) keys -> (tokens [B,K+1], n_accepted [B])."""
  b, k = draft_tokens.shape
  keys = row_keys(key, b)
  if k == 0:  # plain decoding: the "bonus" token straight from p.
    toks = jax.vmap(sampling_lib.sample)(keys, target_probs[:, 0])
    return toks[:, None], jnp.zeros((b,), jnp.int32)

  def one_row(rkey, dt, dp, tp, dl):
    toks, n = rejection_sample(rkey, dt[None], None if dp is None else dp[None], tp[None], dl[None])
    return toks[0], n[0]

  if draft_probs is None:
    return jax.vmap(lambda r, dt, tp, dl: one_row(r, dt, None, tp, dl))(
        keys, draft_tokens, target_probs, draft_lengths)
  return jax.vmap(one_row)(keys, draft_tokens, draft_probs, target_probs, draft_lengths)


def accept_greedy(draft_tokens, target_argmax, draft_lengths):
  """Greedy verification: the longest draft prefix equal to the target's argmax, then the
  target's argmax at the first mismatch (or the bonus position).

  What `accept_step` returns when every p is one-hot (temperature 0), without any random draws.
  Args: draft_tokens int32 [B, K]; target_argmax int32 [B, K+1]; draft_lengths int32 [B].
  Returns: (tokens [B, K+1] with -1 after n_accepted, n_accepted [B]).
  """
  k = draft_tokens.shape[1]
  pos = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  match = (draft_tokens == target_argmax[:, :k]) & (pos[:, :k] < draft_lengths[:, None])
  n_acc = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
  return jnp.where(pos <= n_acc[:, None], target_argmax, -1), n_acc


def commit_step(tokens, lengths, done, emitted, n_accepted, stop_tokens, limit):
  """Appends the emitted block to each active row, cut after a stop token or at the limit.

  Args:
    tokens: int32 [B, S]; lengths: int32 [B]; done: bool [B].
    emitted: int32 [B, K+1] from the rejection sampler (-1 after n_accepted).
    stop_tokens: int32 [N] (may be empty); limit: int32 [B] max committed length per row.
  Returns:
    (tokens, new lengths, new done, n_emit int32 [B] tokens appended to each row).
  """
  k1 = emitted.shape[1]
  pos = jnp.arange(k1, dtype=jnp.int32)[None, :]
  n_emit = n_accepted + 1
  is_stop = jnp.any(emitted[:, :, None] == stop_tokens[None, None, :], axis=-1) & (pos < n_emit[:, None])
  first_stop = jnp.min(jnp.where(is_stop, pos, k1), axis=1)
  n_emit = jnp.minimum(n_emit, first_stop + 1)
  n_emit = jnp.minimum(n_emit, limit - lengths)
  n_emit = jnp.where(done, 0, jnp.maximum(n_emit, 0))
  # Write the whole block; entries past n_emit lie beyond the new length and are never read.
  tokens = jax.vmap(lambda row, blk, o: jax.lax.dynamic_update_slice(row, blk, (o,)))(
      tokens, emitted, lengths)
  new_lengths = lengths + n_emit
  stopped = first_stop < n_emit
  new_done = done | stopped | (new_lengths >= limit)
  return tokens, new_lengths, new_done, n_emit


def update_stats(st: DecodeState, new: DecodeState, draft_lengths, n_accepted, n_emit):
  """`new` with the statistics (RowCounts) of the round st -> new added (rows active at its
  start only) and the iteration counted.

  accepted counts the drafts that were emitted: drafts cut by a stop token or the token limit
  are not accepted tokens of this generation, and a round cut inside its accepted drafts
  (n_emit <= n_accepted) counts as drafted only the n_emit drafts it emitted (the rest were
  thrown away unjudged, like the drafts after a rejection), so alpha is not understated.
  rejected counts the rounds whose emitted tokens end in a correction (n_accepted <
  draft_lengths and the cut, if any, after it). accepted_at may be wider than this round's K."""
  active = (~st.done).astype(jnp.int32)
  n_used = jnp.minimum(n_emit, n_accepted) * active
  c = st.counts
  width = c.accepted_at.shape[1]
  iteration = st.iterations + 1
  return new.replace(iterations=iteration, counts=c.replace(
      rounds=c.rounds + active,
      drafted=c.drafted + active * jnp.where(n_emit <= n_accepted, n_emit, draft_lengths),
      accepted=c.accepted + n_used,
      accepted_at=c.accepted_at + (jnp.arange(width)[None, :] < n_used[:, None]).astype(jnp.int32),
      finished_at_round=jnp.where(new.done & ~st.done, iteration, c.finished_at_round),
      rejected=c.rejected + active * ((n_accepted < draft_lengths)
                                      & (n_emit > n_accepted)).astype(jnp.int32)))


class Verified(NamedTuple):
  """What a sampled chain round verified, for a strategy that learns from it (chain_round's
  `observe`): draft_probs float32 [B, K, V] (the q each draft was drawn from), target_probs
  float32 [B, K+1, V] (p at each verify position), draft_lengths and n_accepted int32 [B],
  active bool [B] (the rows that were running at the round's start)."""
  draft_probs: jax.Array
  target_probs: jax.Array
  draft_lengths: jax.Array
  n_accepted: jax.Array
  active: jax.Array


def chain_round(env: LoopEnv, st: DecodeState, *, k: int, draft_rows=None,
                sync_drafter: bool = True, observe=None) -> DecodeState:
  """One speculative round with a chain of K drafts (K = 0: a plain decoding step):
  propose -> verify -> accept -> commit -> drafter.commit -> statistics.

  K = 0 does not call drafter.propose (a drafter with state still gets commit, with K+1 = 1
  verified token, to stay in sync). draft_rows: optional per-row limits on this round's drafts
  (the verify stays [B, K+1]; a row's drafts past its limit are masked to -1, as a drafter's
  missing ones are): bool [B], the rows that may use their drafts (the others decode one token:
  the governor's per-row gating), or int32 [B] in 0..K, each row's own draft length (a
  strategy that budgets each row's verify). sync_drafter=False (K = 0 only) skips
  drafter.commit: a plain step and nothing else, for a loop that never drafts again.
  observe: optional (state after the round, Verified) -> state, called in sampled rounds whose
  drafter reports its q (a strategy's own statistics of p and q); never in greedy loops."""
  key, draft_key, accept_key = jax.random.split(st.key, 3)
  if k == 0:
    b = st.tokens.shape[0]
    draft_tokens, draft_probs = jnp.zeros((b, 0), jnp.int32), None
    draft_lengths, dstate = jnp.zeros((b,), jnp.int32), st.drafter_state
  else:
    ctx = DraftContext(key=draft_key, tokens=st.tokens, lengths=st.lengths,
                       sampling=env.sampling.for_drafts(), target_params=env.target_params,
                       num_draft=k, greedy=env.greedy, rolled=env.rolled, target_cache=st.cache,
                       history=env.history_of(st))
    draft_tokens, draft_probs, draft_lengths, dstate = draft_step(
        env.drafter, env.drafter_params, st.drafter_state, ctx)
    if draft_rows is not None:
      if draft_rows.dtype == jnp.bool_:
        keep, draft_lengths = draft_rows[:, None], jnp.where(draft_rows, draft_lengths, 0)
      else:
        keep = jnp.arange(k)[None, :] < draft_rows[:, None]
        draft_lengths = jnp.minimum(draft_lengths, draft_rows)
      draft_tokens = jnp.where(keep, draft_tokens, -1)
  last = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)[:, 0]
  target_out, out = verify_step(env.target_params, env.target, st.cache, last, draft_tokens,
                                st.lengths, env.sampling, env.layers, greedy=env.greedy,
                                history=env.history_of(st))
  if env.greedy:
    emitted, n_acc = accept_greedy(draft_tokens, target_out, draft_lengths)
  else:
    emitted, n_acc = accept_step(accept_key, draft_tokens, draft_probs, target_out,
                                 draft_lengths)
  tokens, lengths, done, n_emit = commit_step(st.tokens, st.lengths, st.done, emitted, n_acc,
                                              env.stop_tokens, env.limit)
  # A cache that is not positional (a recurrent state) keeps only the accepted prefix; a KV
  # cache's commit is the identity (Target.commit_cache).
  cache = env.target.commit_cache(out.cache, st.lengths, n_acc)
  verify = VerifyInfo(input_tokens=jnp.concatenate([last[:, None], jnp.maximum(draft_tokens, 0)], 1),
                      hidden=out.hidden, layer_hidden=out.layer_hidden,
                      lengths_before=st.lengths, lengths=lengths,
                      target_params=env.target_params)
  if sync_drafter or k:
    dstate = env.drafter.commit(env.drafter_params, dstate, emitted, n_acc, verify)
  new = st.replace(tokens=tokens, lengths=lengths, done=done, cache=cache,
                   drafter_state=dstate, key=key,
                   sampling_state=commit_history(env, st, emitted, n_emit))
  if observe is not None and not env.greedy and draft_probs is not None:
    new = observe(new, Verified(draft_probs, target_out, draft_lengths, n_acc, ~st.done))
  return update_stats(st, new, draft_lengths, n_acc, n_emit)


def commit_history(env: LoopEnv, st: DecodeState, emitted, n_emit):
  """DecodeState.sampling_state after a round emitted emitted[b, :n_emit[b]] (int32 [B, W])."""
  if not env.history:
    return st.sampling_state
  return st.sampling_state.add(emitted, n_emit)


def run_until_done(round_fn, state: DecodeState) -> DecodeState:
  """round_fn (state -> state) in a lax.while_loop until every row is done."""
  return jax.lax.while_loop(lambda st: ~jnp.all(st.done), round_fn, state)
