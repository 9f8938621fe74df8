"""Prefill, draft/verify rounds, commit: `decode` (pure, jittable) and `generate` (host wrapper).

One round (fixed shapes; ../shared/DESIGN.md):

    drafter.propose ─► draft_tokens [B,K] (+ q [B,K,V] or None)
    [last committed token, drafts] [B,K+1] ─► verify_step: one target forward at cache offsets
        lengths-1 .. lengths-1+K ─► p [B,K+1,V] ─► rejection_sample ─► tokens [B,K+1], n_accepted
    commit: lengths += emitted (n_accepted + 1, cut at a stop token or max_new_tokens);
        rejected KV slots stay in the cache, masked by the lengths, and are overwritten later.

Invariant: row b holds `lengths[b]` committed tokens in `tokens[b]`; the target's KV cache holds
entries for positions < lengths[b] - 1 (the last committed token is fed in the next round).
K = 0 (no drafter) is plain autoregressive decoding through the same loop: the baseline.

`decode` is the whole generation as one pure function of arrays (prefill + `lax.while_loop`),
for research code to call inside its own `jax.jit`; `generate` prepares prompts, compiles
`decode` ahead of time, times the compiled call and decodes text.
"""

from __future__ import annotations

import functools
import numbers
import time
import weakref
from typing import Any, NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import global_batch
from spec_jax import sampling as sampling_lib
from spec_jax import sharding as sharding_lib
from spec_jax.drafters.base import DraftContext, Drafter, PrefillInfo, VerifyInfo
from spec_jax.models.config import ModelConfig
from spec_jax.models.transformer import KVCache, forward, prepare_params
from spec_jax.rejection import rejection_sample
from spec_jax.sampling import Sampling
from spec_jax.stats import SpecStats

PROMPT_BUCKET = 16
CAPACITY_BUCKET = 64


@flax.struct.dataclass
class DecodeState:
  """Loop carry. B rows, capacity S, K drafts.

  tokens: int32 [B, S] prompt + generated tokens; row b valid in [0, lengths[b]).
  lengths: int32 [B] committed tokens.
  done: bool [B] rows that hit a stop token or max_new_tokens (they keep running, masked).
  cache: the target KVCache [L, B, S, Hkv, Dh].
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
  cache: KVCache
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


class GenerateOutput(NamedTuple):
  """tokens: list[list[int]] new tokens per row (a stop token that ended a row is included);
  text: list[str] or None (decoded new tokens, special tokens dropped); stats: SpecStats;
  result: the DecodeResult as numpy arrays (per-row statistics, finished_at_round); rows: the
  global row indices of tokens and text. With a mesh over several processes, tokens and text are
  this process's rows, result and stats cover every process's rows (new_tokens(result) is every
  row's tokens, in global order)."""
  tokens: list
  text: Optional[list]
  stats: SpecStats
  result: Optional[Any] = None
  rows: Optional[range] = None


class NoDrafter(Drafter):
  """K = 0: plain decoding. Proposes nothing."""

  def propose(self, params, state, ctx):
    b = ctx.tokens.shape[0]
    return jnp.zeros((b, 0), jnp.int32), None, state


# ----------------------------------------------------------------------------- pure steps

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


def verify_step(params, config: ModelConfig, cache: KVCache, last_tokens, draft_tokens, lengths,
                sampling: Sampling, return_layers: Sequence[int] = (), greedy: bool = False):
  """One target forward over [last committed token, drafts] at offsets lengths-1.

  Args:
    last_tokens: int32 [B]; draft_tokens: int32 [B, K] (-1 padding allowed); lengths: int32 [B].
    greedy: every row is greedy (static): skip the probabilities, return the argmax.
  Returns:
    (target_probs [B, K+1, V] — or, when greedy, the target's argmax int32 [B, K+1] —,
    ForwardOutput) — the output carries the updated cache and the hidden states drafters follow.
  """
  inputs = jnp.concatenate([last_tokens[:, None], jnp.maximum(draft_tokens, 0)], axis=1)
  out = forward(params, config, inputs, cache, lengths - 1, return_layers=return_layers)
  if greedy:
    return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out
  return sampling_lib.probs(out.logits, sampling), out


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


# ----------------------------------------------------------------------------- one round

class LoopEnv(NamedTuple):
  """What every round of one decode call closes over (set once, before the loop).

  config, drafter, greedy, layers, rolled are static; the rest are arrays: drafter_params and
  target_params (execution layout), sampling (per-row [B]), stop_tokens int32 [N], limit int32
  [B] (the longest committed length of each row). rolled: drafters run their K-1 draft steps
  as a loop rather than unrolled (DraftContext.rolled; the governor's many K compile faster)."""
  config: ModelConfig
  drafter: Drafter
  drafter_params: Any
  target_params: Any
  sampling: Sampling
  stop_tokens: jax.Array
  limit: jax.Array
  greedy: bool
  layers: tuple
  rolled: bool = False


def update_stats(st: DecodeState, new: DecodeState, draft_lengths, n_accepted, n_emit):
  """`new` with the statistics of the round st -> new added (rows active at its start only).

  accepted counts the drafts that were emitted: drafts cut by a stop token or the token limit
  are not accepted tokens of this generation, and a round cut inside its accepted drafts
  (n_emit <= n_accepted) counts as drafted only the n_emit drafts it emitted (the rest were
  thrown away unjudged, like the drafts after a rejection), so alpha is not understated.
  accepted_at may be wider than this round's K."""
  active = (~st.done).astype(jnp.int32)
  n_used = jnp.minimum(n_emit, n_accepted) * active
  width = st.accepted_at.shape[1]
  iteration = st.iterations + 1
  return new.replace(
      rounds=st.rounds + active,
      drafted=st.drafted + active * jnp.where(n_emit <= n_accepted, n_emit, draft_lengths),
      accepted=st.accepted + n_used,
      accepted_at=st.accepted_at + (jnp.arange(width)[None, :] < n_used[:, None]).astype(jnp.int32),
      finished_at_round=jnp.where(new.done & ~st.done, iteration, st.finished_at_round),
      iterations=iteration)


def chain_round(env: LoopEnv, st: DecodeState, *, k: int, draft_rows=None) -> DecodeState:
  """One speculative round with a chain of K drafts (K = 0: a plain decoding step):
  propose -> verify -> accept -> commit -> drafter.commit -> statistics.

  K = 0 does not call drafter.propose (a drafter with state still gets commit, with K+1 = 1
  verified token, to stay in sync). draft_rows: optional bool [B], the rows that may use their
  drafts this round; the others get draft_length 0 (drafts masked to -1) and decode one token
  (the governor's per-row gating)."""
  key, draft_key, accept_key = jax.random.split(st.key, 3)
  if k == 0:
    b = st.tokens.shape[0]
    draft_tokens, draft_probs = jnp.zeros((b, 0), jnp.int32), None
    draft_lengths, dstate = jnp.zeros((b,), jnp.int32), st.drafter_state
  else:
    ctx = DraftContext(key=draft_key, tokens=st.tokens, lengths=st.lengths,
                       sampling=env.sampling, target_params=env.target_params, num_draft=k,
                       greedy=env.greedy, rolled=env.rolled, target_cache=st.cache)
    draft_tokens, draft_probs, draft_lengths, dstate = draft_step(
        env.drafter, env.drafter_params, st.drafter_state, ctx)
    if draft_rows is not None:
      draft_tokens = jnp.where(draft_rows[:, None], draft_tokens, -1)
      draft_lengths = jnp.where(draft_rows, draft_lengths, 0)
  last = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)[:, 0]
  target_out, out = verify_step(env.target_params, env.config, st.cache, last, draft_tokens,
                                st.lengths, env.sampling, env.layers, greedy=env.greedy)
  if env.greedy:
    emitted, n_acc = accept_greedy(draft_tokens, target_out, draft_lengths)
  else:
    emitted, n_acc = accept_step(accept_key, draft_tokens, draft_probs, target_out,
                                 draft_lengths)
  tokens, lengths, done, n_emit = commit_step(st.tokens, st.lengths, st.done, emitted, n_acc,
                                              env.stop_tokens, env.limit)
  verify = VerifyInfo(input_tokens=jnp.concatenate([last[:, None], jnp.maximum(draft_tokens, 0)], 1),
                      hidden=out.hidden, layer_hidden=out.layer_hidden,
                      lengths_before=st.lengths, lengths=lengths,
                      target_params=env.target_params)
  dstate = env.drafter.commit(env.drafter_params, dstate, emitted, n_acc, verify)
  new = st.replace(tokens=tokens, lengths=lengths, done=done, cache=out.cache,
                   drafter_state=dstate, key=key)
  return update_stats(st, new, draft_lengths, n_acc, n_emit)


# ----------------------------------------------------------------------------- decode()

def _is_static_int(x) -> bool:
  return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def check_num_draft(drafter: Optional[Drafter], num_draft) -> int:
  """The K a (drafter, num_draft) pair runs with; ValueError naming what is allowed."""
  if drafter is None:
    return 0
  if not isinstance(drafter, Drafter):
    raise ValueError(f"drafter must be a spec_jax.drafters drafter or None, got "
                     f"{type(drafter).__name__}")
  if not _is_static_int(num_draft) or num_draft < 1:
    raise ValueError(f"num_draft (K) must be an integer >= 1 when a drafter is given, got "
                     f"{num_draft!r}")
  if drafter.max_draft is not None and num_draft > drafter.max_draft:
    raise ValueError(f"this drafter proposes at most {drafter.max_draft} tokens per round; "
                     f"num_draft={num_draft} is too large")
  return int(num_draft)


def check_capacity(capacity, longest_prompt: int, max_new_tokens: int, k: int) -> None:
  """Raises ValueError unless the KV cache holds prompt + max_new_tokens + a K+1 verify block."""
  if not _is_static_int(capacity) or capacity < 1:
    raise ValueError(f"capacity must be a positive integer (the KV-cache length S), got "
                     f"{capacity!r}")
  needed = longest_prompt + max_new_tokens + k + 1
  if capacity < needed:
    raise ValueError(f"capacity {capacity} is too small: the longest prompt ({longest_prompt}) + "
                     f"max_new_tokens ({max_new_tokens}) + K+1 ({k + 1}; a tree's cache_extent "
                     f"+ 1) needs {needed}")


def decode(target_params, prompt_tokens, prompt_lens, key, *, config: ModelConfig,
           drafter: Optional[Drafter] = None, drafter_params=None, num_draft=4,
           max_new_tokens, capacity: int, sampling: Sampling, stop_tokens=(),
           tree=None, mesh=None, greedy: Optional[bool] = None, cache: Optional[KVCache] = None,
           governor=None, round_costs=None) -> DecodeResult:
  """The whole speculative generation as one pure function of arrays: prefill + rounds in one
  `lax.while_loop`. Jittable; call it inside your own `jax.jit` next to other work.

  Args (arrays, traced):
    target_params: the target's param pytree (`model.params`).
    prompt_tokens: int32 [B, P] right-padded prompts (any valid id as padding).
    prompt_lens: int32 [B] real prompt lengths, >= 1.
    key: a jax PRNG key (the only source of randomness; same key -> same tokens).
    drafter_params: the drafter's params (`drafter.params`); None uses `drafter.params`, which
      then become compile-time constants of your jit — pass them as an argument instead.
    sampling: Sampling with scalars or per-row [B] arrays.
    stop_tokens: a tuple of ints or an int32 [N] array; () never stops early.
    max_new_tokens: int, or a traced int32 scalar (then capacity is not checked against it).
    cache: optional KVCache [L, B, S, Hkv, Dh] buffer to decode into (donate it with
      `donate_argnums` to reuse its memory); default a fresh zero cache.
    round_costs: with num_draft="auto", float [len(governor.ks)] seconds (or any common unit)
      of one round at each candidate K, in the order of `governor.candidates(drafter)` —
      `sj.calibrate(...).round_costs`; None takes the governor's own `costs` table (or, with a
      `schedule`, needs none).
  Static (hashable; mark them static in your jit, e.g. with functools.partial):
    config: the target's ModelConfig. drafter: a Drafter or None (plain decoding, K = 0).
    num_draft: K, or "auto": the governor picks K every round (spec_jax.governor).
    governor: with num_draft="auto", a `sj.Governor` (None = the defaults).
    capacity: S, the KV-cache length: >= P_max + max_new_tokens + K + 1 (K: the largest
      candidate with "auto"; a tree's cache_extent).
    tree: a spec_jax.TreeSpec for tree drafting (spec_jax.tree; num_draft is then ignored, and
      "auto" refused), or None (a chain).
    mesh: optional Mesh ("data", "model") for the sharding annotations (spec_jax.sharding).
    greedy: every row is greedy (temperature 0): argmax verification, no random draws. None
      infers it from concrete sampling values (traced values: False; both paths give the same
      tokens, the greedy one is cheaper).

  Returns:
    DecodeResult (arrays). Host helpers: `new_tokens(result)`, `SpecStats.from_result`.

  Example — sample with speculation, then score the samples, in one jitted function:

      @functools.partial(jax.jit, static_argnames=("n",))
      def sample_and_score(params, dparams, prompts, lens, key, n):
        res = sj.decode(params, prompts, lens, key, config=cfg, drafter=drafter,
                        drafter_params=dparams, num_draft=4, max_new_tokens=n,
                        capacity=256, sampling=sj.Sampling(temperature=1.0))
        logits = sj.forward(params, cfg, res.tokens, sj.KVCache.zeros(cfg, B, 256),
                            jnp.zeros((B,), jnp.int32)).logits
        logp = jax.nn.log_softmax(logits[:, :-1])
        tok_logp = jnp.take_along_axis(logp, res.tokens[:, 1:, None], -1)[..., 0]
        pos = jnp.arange(255)[None]
        new = (pos >= res.prompt_lens[:, None] - 1) & (pos < res.lengths[:, None] - 1)
        return res, jnp.sum(jnp.where(new, tok_logp, 0.0), axis=1)
  """
  if drafter is not None and not isinstance(drafter, Drafter):
    raise ValueError(f"drafter must be a spec_jax.drafters drafter or None, got "
                     f"{type(drafter).__name__}")
  k, extent, gov, tree = drafting_plan(drafter, num_draft, tree, governor)
  if drafter is None:
    drafter = NoDrafter()
  if drafter_params is None:
    drafter_params = drafter.params
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
  if prompt_tokens.ndim != 2 or prompt_lens.shape != prompt_tokens.shape[:1]:
    raise ValueError(f"prompt_tokens must be int32 [B, P] and prompt_lens [B]; got shapes "
                     f"{prompt_tokens.shape} and {prompt_lens.shape}")
  b, p = prompt_tokens.shape
  if _is_static_int(max_new_tokens):
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_capacity(capacity, p, int(max_new_tokens), extent)
  elif not _is_static_int(capacity) or capacity < p + extent + 2:
    raise ValueError(f"capacity must be an integer >= P + K + 2 = {p + extent + 2}, got "
                     f"{capacity!r}")
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a spec_jax.Sampling, got {type(sampling).__name__}")
  if gov is not None:
    costs = gov.cost_array(drafter, round_costs)          # ValueError on a bad table
  env, state = init_loop(target_params, prompt_tokens, prompt_lens, key, config=config,
                         drafter=drafter, drafter_params=drafter_params,
                         max_new_tokens=max_new_tokens, capacity=capacity, sampling=sampling,
                         stop_tokens=stop_tokens, greedy=greedy, mesh=mesh, cache=cache, width=k,
                         lazy_drafter=gov is not None)
  from spec_jax import governor as governor_lib, tree as tree_lib   # (they import this module)
  if gov is None:
    if tree is not None:
      round_ = functools.partial(tree_lib.tree_round, env, spec=tree)
    else:
      round_ = functools.partial(chain_round, env, k=k)
    final = jax.lax.while_loop(lambda st: ~jnp.all(st.done), round_, state)
  else:
    final = governor_lib.governed_loop(env, gov, costs,
                                       state.replace(governor=gov.init_state(drafter, b)))
  if gov is None:               # every iteration ran K drafts (a tree: its depth D)
    k_rounds = jnp.zeros((k + 1,), jnp.int32).at[k].set(final.iterations)
  else:
    k_rounds = governor_lib.k_rounds(gov, drafter, final.governor)
  return DecodeResult(tokens=final.tokens, lengths=final.lengths, prompt_lens=prompt_lens,
                      rounds=final.rounds, drafted=final.drafted, accepted=final.accepted,
                      accepted_at=final.accepted_at, finished_at_round=final.finished_at_round,
                      iterations=final.iterations, k_rounds=k_rounds)


def drafting_plan(drafter, num_draft, tree, governor) -> tuple:
  """Checks how a call drafts -> (K, cache extent, Governor or None, TreeSpec or None).

  A tree ignores num_draft (its depth bounds the accepted drafts; extent: its cache reach);
  num_draft="auto" takes the governor's largest candidate; otherwise K = num_draft. ValueError
  on a bad combination (shared by decode and generate, so their messages agree)."""
  if tree is not None:
    from spec_jax import tree as tree_lib
    tree = tree_lib.check_tree(tree, drafter, num_draft, governor)
    return tree.depth, tree.cache_extent, None, tree
  if is_auto(num_draft):
    from spec_jax import governor as governor_lib
    gov = governor_lib.resolve(governor, drafter)
    k = max(gov.candidates(drafter))
    return k, k, gov, None
  if governor is not None:
    raise ValueError("governor= is used only with num_draft='auto'")
  k = check_num_draft(drafter, num_draft)
  return k, k, None, None


def is_auto(num_draft) -> bool:
  """num_draft="auto": the governor chooses K every round."""
  return isinstance(num_draft, str) and num_draft == "auto"


def init_loop(target_params, prompt_tokens, prompt_lens, key, *, config: ModelConfig,
              drafter: Drafter, drafter_params, max_new_tokens, capacity: int,
              sampling: Sampling, stop_tokens=(), greedy: Optional[bool] = None, mesh=None,
              cache: Optional[KVCache] = None, width: int = 0,
              lazy_drafter: bool = False) -> tuple:
  """Everything before the loop (inputs already checked by `decode`): the execution layout of
  the weights, the prefill, the first token, the drafter's state -> (LoopEnv, DecodeState)
  with accepted_at [B, width]. lazy_drafter: the loop calls drafter.catch_up before drafting
  (the governor's loop; PrefillInfo.lazy)."""
  b, p = prompt_tokens.shape
  if greedy is None:
    greedy = _concretely_greedy(sampling)
  sampling = Sampling(
      temperature=jnp.broadcast_to(jnp.asarray(sampling.temperature, jnp.float32), (b,)),
      top_k=jnp.broadcast_to(jnp.asarray(sampling.top_k, jnp.int32), (b,)),
      top_p=jnp.broadcast_to(jnp.asarray(sampling.top_p, jnp.float32), (b,)))
  stop_tokens = jnp.asarray(stop_tokens, jnp.int32).reshape(-1)
  s = int(capacity)
  layers = tuple(drafter.target_layers)
  limit = prompt_lens + jnp.asarray(max_new_tokens, jnp.int32)  # max committed length per row
  # Loop-invariant work on the weights, once per call, outside the loop (the execution layout:
  # see transformer.prepare_params).
  target_params = prepare_params(target_params, config, mesh)
  drafter_params = drafter.prepare(drafter_params)

  # Prefill: the right-padded prompts at offset 0 (padding sits after each row's prompt, is
  # never attended by real tokens, and its KV slots are overwritten by generated tokens).
  if cache is None:
    cache = KVCache.zeros(config, b, s)
  else:
    want = jax.eval_shape(lambda: KVCache.zeros(config, b, s, head_major=cache.head_major))
    if cache.k.shape != want.k.shape or cache.v.shape != want.k.shape:
      layout = "[L, B, Hkv, S, Dh]" if cache.head_major else "[L, B, S, Hkv, Dh]"
      raise ValueError(f"cache must be {layout} = {want.k.shape} (sj.KVCache.zeros(config, B, "
                       f"capacity)), got {cache.k.shape}")
  cache = sharding_lib.constrain_cache(mesh, cache)
  pre = forward(target_params, config, prompt_tokens, cache, jnp.zeros((b,), jnp.int32),
                return_layers=layers)
  last_logits = jnp.take_along_axis(pre.logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
  key, first_key = jax.random.split(key)
  if greedy:
    first = jnp.argmax(last_logits, axis=-1).astype(jnp.int32)
  else:
    first = jax.vmap(sampling_lib.sample)(row_keys(first_key, b),
                                          sampling_lib.probs(last_logits, sampling))
  tokens = jnp.zeros((b, s), jnp.int32).at[:, :p].set(
      jnp.where(jnp.arange(p)[None] < prompt_lens[:, None], prompt_tokens, 0))
  tokens = tokens.at[jnp.arange(b), prompt_lens].set(first)
  lengths = prompt_lens + 1
  done = jnp.any(first[:, None] == stop_tokens[None, :], axis=1) | (lengths >= limit)
  drafter_state = drafter.init_state(drafter_params, PrefillInfo(
      tokens=tokens, prompt_tokens=prompt_tokens, prompt_lens=prompt_lens, hidden=pre.hidden,
      layer_hidden=pre.layer_hidden, target_params=target_params, sampling=sampling,
      lazy=lazy_drafter))
  zeros = jnp.zeros((b,), jnp.int32)
  state = DecodeState(tokens=tokens, lengths=lengths, done=done, cache=pre.cache,
                      drafter_state=drafter_state, key=key, rounds=zeros, drafted=zeros,
                      accepted=zeros, accepted_at=jnp.zeros((b, width), jnp.int32),
                      finished_at_round=jnp.where(done, 0, -1).astype(jnp.int32),
                      iterations=jnp.zeros((), jnp.int32))
  env = LoopEnv(config=config, drafter=drafter, drafter_params=drafter_params,
                target_params=target_params, sampling=sampling, stop_tokens=stop_tokens,
                limit=limit, greedy=greedy, layers=layers)
  return env, state


def _concretely_greedy(sampling: Sampling) -> bool:
  """True when every temperature is a concrete 0 (known at trace time)."""
  t = sampling.temperature
  if isinstance(t, jax.core.Tracer):
    return False
  try:
    return bool(np.all(np.asarray(t) == 0))
  except (TypeError, jax.errors.ConcretizationTypeError):
    return False


def new_tokens(result) -> list:
  """Host side: list[list[int]] of each row's new tokens (a stop token that ended a row
  included) from a DecodeResult."""
  tokens = np.asarray(result.tokens)
  lengths, prompt_lens = np.asarray(result.lengths), np.asarray(result.prompt_lens)
  return [tokens[b, prompt_lens[b]:lengths[b]].tolist() for b in range(tokens.shape[0])]


_DECODE_STATIC = ("config", "drafter", "num_draft", "capacity", "tree", "mesh", "greedy",
                  "governor")


# ----------------------------------------------------------------------------- generate()

def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _as_token_ids(values, what: str) -> list:
  """A 1-D sequence of integral values -> list[int]; ValueError on anything else."""
  arr = np.asarray(values)
  if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or
                                 np.issubdtype(arr.dtype, np.floating) or arr.dtype == bool):
    raise ValueError(f"{what} must hold integer token ids, got {values!r}")
  if arr.dtype == bool:
    raise ValueError(f"{what} must hold integer token ids, got booleans")
  if np.issubdtype(arr.dtype, np.floating) and not np.all(np.equal(np.mod(arr, 1), 0)):
    raise ValueError(f"{what} must hold integer token ids, got non-integral values "
                     f"{arr.reshape(-1)[np.mod(arr.reshape(-1), 1) != 0][:5].tolist()}")
  return [int(t) for t in arr.reshape(-1).tolist()]


def _prepare_prompts(target, prompts, allow_empty: bool = False) -> list[list[int]]:
  """Token ids of every prompt (ValueError on bad ones); allow_empty: a process of a
  multi-process call may feed no rows."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or (
      len(prompts) == 0 and not allow_empty):
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists, got "
                     f"{type(prompts).__name__}")
  vocab = target.config.vocab_size
  out = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, str):
      if target.tokenizer is None:
        raise ValueError("text prompts need a model with a tokenizer; this model has none: pass "
                         "lists of token ids")
      ids = target.encode(prompt)
    else:
      ids = _as_token_ids(prompt, f"prompt {i}")
    if len(ids) == 0:
      raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    out.append(ids)
  return out


def _stop_array(target, stop_tokens) -> np.ndarray:
  if stop_tokens is None:
    stop_tokens = target.config.eos_token_ids
  if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, (Sequence, np.ndarray)):
    raise ValueError(f"stop_tokens must be None (the model's end-of-text tokens) or a list of "
                     f"token ids ([] = never stop early), got {stop_tokens!r}")
  stop = _as_token_ids(stop_tokens, "stop_tokens") if len(stop_tokens) else []
  bad = [t for t in stop if not 0 <= t < target.config.vocab_size]
  if bad:
    raise ValueError(f"stop_tokens outside the vocabulary [0, {target.config.vocab_size}): {bad}")
  return np.asarray(stop, np.int32).reshape(-1)


_COMPILED: dict = {}   # tree signature -> PackedDecode (see _compiled_decode)


def clear_compiled() -> None:
  """Drops generate()'s compiled executables: the next call traces decode afresh (tests that
  patch the engine; long benchmarks bounding their memory)."""
  _COMPILED.clear()


@functools.lru_cache(maxsize=None)
def _default_key():
  """jax.random.key(0), made once (creating a key is an eager device op, ~0.5 ms a call)."""
  return jax.random.key(0)


def _packed_decode(layout: list, *args, **kwargs) -> jax.Array:
  """decode, its DecodeResult packed into one int32 vector, so that generate() copies it to the
  host in one transfer (a copy per field cost ~0.2 ms a call in place, ~1 % of a 128-token
  stories260K decode; measured). layout receives (treedef, [(shape, dtype)]) at trace time."""
  leaves, treedef = jax.tree.flatten(decode(*args, **kwargs))
  for x in leaves:           # counts and token ids: int32 holds them exactly
    assert jnp.issubdtype(x.dtype, jnp.integer) and jnp.iinfo(x.dtype).bits <= 32, x.dtype
  layout[:] = [treedef, [(x.shape, x.dtype) for x in leaves]]
  return jnp.concatenate([jnp.ravel(x).astype(jnp.int32) for x in leaves])


class PackedDecode:
  """An AOT-compiled decode whose call returns its DecodeResult as one int32 vector [N];
  `unpack` turns the host copy of that vector back into a DecodeResult of numpy arrays."""

  def __init__(self, compiled, treedef, shapes: list):
    self.compiled, self._treedef = compiled, treedef
    self._layout, start = [], 0
    for shape, dtype in shapes:
      size = int(np.prod(shape, dtype=np.int64))
      self._layout.append((start, start + size, shape, np.dtype(dtype)))
      start += size

  def __call__(self, *args, **kwargs) -> jax.Array:
    return self.compiled(*args, **kwargs)

  def unpack(self, flat) -> DecodeResult:
    flat = np.asarray(flat)
    return jax.tree.unflatten(self._treedef, [
        flat[a:b].reshape(shape).astype(dtype, copy=False)
        for a, b, shape, dtype in self._layout])


def _compiled_decode(args, static, params_signature=None) -> PackedDecode:
  """AOT-compiles once per (shapes, static config) so that timings exclude compilation.

  params_signature: tree_signature(args[0][0]), the target params, when the caller has it
  cached (execution_params); they are then not walked again."""
  positional, keywords = args
  if params_signature is None:
    params_signature = tree_signature(positional[0])
  # static items in the caller's (fixed) order; shapes and dtypes as they are (hashable).
  sig = (tuple(static.items()), params_signature, tree_signature((positional[1:], keywords)))
  hit = _COMPILED.get(sig)
  if hit is None:
    layout = []
    packed = jax.jit(functools.partial(_packed_decode, layout), static_argnames=_DECODE_STATIC)
    compiled = packed.lower(*positional, **keywords, **static).compile()
    hit = _COMPILED[sig] = PackedDecode(compiled, *layout)
  return hit


def tree_signature(tree) -> tuple:
  """(treedef, ((shape, dtype) of every leaf)): what a compiled call depends on."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(map(_leaf_signature, leaves))


def _leaf_signature(x) -> tuple:
  """(shape, dtype) of an array leaf; ((), type) of a Python scalar."""
  try:
    return x.shape, x.dtype
  except AttributeError:
    return np.shape(x), type(x)


def _host(x, dtype):
  """A numpy array of dtype, unless x is already a jax array (then as it is)."""
  return x if isinstance(x, jax.Array) else np.asarray(x, dtype)


# id(params) -> (weakrefs to every leaf, prepared params, their tree_signature)
_EXECUTION_PARAMS: dict = {}
_prepare_jit = jax.jit(prepare_params, static_argnums=(1,))


def execution_params(target, mesh=None):
  """target.params in the execution layout (transformer.prepare_params), made once per model
  and cached while its weights live: on CPU without a mesh, where that layout is a transposed,
  unstacked copy of every weight. decode() prepares canonical params itself, inside its jit,
  once per call: for the 78M widened model that copy is ~0.3 s, a quarter of a 64-token
  generate() (measured; README Speed section). Costs a second copy of the weights in host
  memory. Elsewhere (accelerators, meshes) the canonical params are returned and decode
  prepares them in its jit (a fuse at HBM bandwidth, no second copy held).

  The cache is keyed by the identity of every leaf (arrays are immutable, so a params dict
  changed in place is a miss) and dropped when the model's first layer weight is freed."""
  return _signed_execution_params(target, mesh)[0]


def _signed_execution_params(target, mesh=None) -> tuple:
  """(execution_params(target, mesh), their tree_signature or None when not cached): the
  cache hit that checks every leaf also saves generate() a second walk of the weights."""
  params = target.params
  if mesh is not None or jax.default_backend() != "cpu":
    return params, None
  layers = params.get("layers") if isinstance(params, dict) else None
  if not isinstance(layers, dict) or "wq" not in layers:     # already prepared, or not ours
    return params, None
  leaves = jax.tree.leaves(params)
  key = id(params)
  hit = _EXECUTION_PARAMS.get(key)
  if hit is not None and len(hit[0]) == len(leaves) and all(
      r() is x for r, x in zip(hit[0], leaves)):
    return hit[1], hit[2]
  prepared = _prepare_jit(params, target.config)
  _EXECUTION_PARAMS[key] = ([weakref.ref(x) for x in leaves], prepared, tree_signature(prepared))
  weakref.finalize(layers["wq"], _EXECUTION_PARAMS.pop, key, None)
  return prepared, _EXECUTION_PARAMS[key][2]


def compiled_decode_call(target, drafter, prompt_tokens, prompt_lens, key, *, max_new_tokens,
                         sampling: Sampling, stop, capacity: int, greedy: bool, mesh=None,
                         num_draft=4, governor=None, round_costs=None, tree=None) -> tuple:
  """(compiled decode, args, kwargs) of one call as generate() makes it: inputs placed for the
  mesh, max_new_tokens traced (one executable for every length), compiled ahead of time once
  per shapes and static configuration. The governor's calibration times this same executable.
  compiled(*args, **kwargs) returns the DecodeResult packed into one int32 vector;
  compiled.unpack(np.asarray(it)) is the DecodeResult (PackedDecode).

  prompt_tokens int32 [B, P], prompt_lens [B] (numpy or jax); sampling: per-row arrays [B];
  stop: int32 [N]; round_costs: float32 [len(candidates)] or None; tree: a TreeSpec or None."""
  drafter_params = None if drafter is None else drafter.params
  # Host arrays stay numpy: the compiled call transfers them itself (an eager jnp op per input
  # would cost a dispatch each; generate()'s overhead over a bare decode is measured).
  params, params_signature = _signed_execution_params(target, mesh)
  args = (sharding_lib.shard_params(mesh, params),
          *sharding_lib.shard_rows(mesh, (_host(prompt_tokens, np.int32),
                                          _host(prompt_lens, np.int32))),
          sharding_lib.replicate(mesh, key))
  kwargs = dict(drafter_params=sharding_lib.shard_params(mesh, drafter_params),
                max_new_tokens=sharding_lib.replicate(mesh, np.asarray(max_new_tokens, np.int32)),
                sampling=sharding_lib.shard_rows(mesh, sampling),
                stop_tokens=sharding_lib.replicate(mesh, np.asarray(stop, np.int32)))
  static = dict(config=target.config, drafter=drafter, num_draft=num_draft, capacity=capacity,
                mesh=mesh, greedy=greedy)
  if governor is not None:
    static["governor"] = governor
  if tree is not None:
    static["tree"] = tree
  if round_costs is not None:
    kwargs["round_costs"] = sharding_lib.replicate(mesh, np.asarray(round_costs, np.float32))
  return _compiled_decode((args, kwargs), static, params_signature), args, kwargs


def prepare_batch(target, prompts, max_new_tokens: int, k: int, capacity=None,
                  prompt_bucket: int = PROMPT_BUCKET):
  """Host-side prompt preparation shared by generate() and the benchmarks.

  Returns (prompt_tokens int32 [B, P] right-padded to a multiple of prompt_bucket (one compile
  per padded length; the padding is masked), prompt_lens int32 [B], capacity). Raises ValueError
  on bad prompts or a capacity that is too small."""
  return _pad_batch(target, _prepare_prompts(target, prompts), max_new_tokens, k, capacity,
                    prompt_bucket)


def _pad_batch(target, ids: list, max_new_tokens: int, k: int, capacity, prompt_bucket: int):
  """prepare_batch after the prompts were checked (ids: list[list[int]], non-empty rows)."""
  if not _is_static_int(prompt_bucket) or prompt_bucket < 1:
    raise ValueError(f"prompt_bucket must be a positive integer, got {prompt_bucket!r}")
  longest = max(len(r) for r in ids)
  max_pos = target.config.max_position_embeddings
  if longest + max_new_tokens > max_pos:
    raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) "
                     f"exceeds the model's context of {max_pos} positions")
  needed = longest + max_new_tokens + k + 1
  if capacity is None:
    capacity = _round_up(needed, CAPACITY_BUCKET)
  else:
    check_capacity(capacity, longest, max_new_tokens, k)
  p = min(_round_up(longest, prompt_bucket), capacity - max_new_tokens - k - 1)
  p = max(p, longest)
  prompt_tokens = np.zeros((len(ids), p), np.int32)
  for b, r in enumerate(ids):
    prompt_tokens[b, :len(r)] = r
  prompt_lens = np.asarray([len(r) for r in ids], np.int32)
  return prompt_tokens, prompt_lens, int(capacity)


def generate(target, prompts, drafter: Optional[Drafter] = None, num_draft=4,
             max_new_tokens: int = 128, sampling: Sampling = Sampling(), key=None,
             stop_tokens=None, capacity: Optional[int] = None, mesh=None,
             prompt_bucket: int = PROMPT_BUCKET, governor=None, tree=None) -> GenerateOutput:
  """Speculative (or, with drafter=None, plain) generation for a batch of prompts.

  A host-side wrapper over `decode`: prepares and pads the prompts, compiles `decode` ahead of
  time (one compile per (B, prompt bucket, S, K, greedy); compilation is not timed), times the
  compiled call, and decodes the text.

  Args:
    target: a Model (sj.load / sj.init_model).
    prompts: list[str] (needs a tokenizer; BOS added as the tokenizer does) or list[list[int]];
      rows may differ in length.
    drafter: a Drafter (sj.drafters.*) or None for plain decoding (then num_draft is ignored).
    num_draft: K, draft tokens per round (>= 1 with a drafter), or "auto": the governor picks
      K (0 = a plain step) every round from a cost table (`sj.calibrate`, measured on first
      use for this batch and capacity, then cached on disk; not part of the timed seconds)
      and the batch's live acceptance (spec_jax.governor).
    max_new_tokens: new tokens per row at most (>= 1).
    sampling: Sampling, scalars or per-row [B] arrays; temperature 0 = greedy.
    key: jax PRNG key (default key(0)).
    stop_tokens: None = the model's end-of-text tokens; [] = never stop early.
    capacity: KV-cache capacity S (default: the longest prompt + max_new_tokens + K + 1, rounded
      up to a multiple of 64).
    mesh: optional jax.sharding.Mesh with axes "data" (batch rows) and "model" (heads, MLP
      features, vocabulary): see spec_jax.sharding. The batch must divide the "data" size.
      A mesh over several processes (after spec_jax.distributed.initialize()): every process
      calls generate() with the same options and its own prompts (possibly none); the batch
      is every process's rows in process order (spec_jax.global_batch); each process gets its
      own rows' tokens and text back, and statistics over all rows (stats.processes says how
      many processes they sum over).
    prompt_bucket: prompts are right-padded to a multiple of this (one compile per padded
      length; the padding is masked, so outputs do not depend on it).
    governor: with num_draft="auto", a `sj.Governor` (or a dict of its options); None = the
      defaults.
    tree: sj.TreeSpec(depth=D, top_k=k, num_nodes=N) for tree drafting (spec_jax.tree: one
      verify over N+1 tree nodes per round, lossless); num_draft is then ignored. None: a chain.

  Returns:
    GenerateOutput(tokens, text, stats, result).
  """
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  max_new_tokens = int(max_new_tokens)
  k, extent, gov, tree = drafting_plan(drafter, num_draft, tree, governor)
  if drafter is not None:
    drafter.check_compatible(target)
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a spec_jax.Sampling, got {type(sampling).__name__}")
  if key is None:
    key = _default_key()
  elif not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            and key.shape == ()):
    raise ValueError(f"key must be a jax PRNG key (jax.random.key(seed)), got {key!r}")
  if capacity is not None and (not _is_static_int(capacity) or capacity < 1):
    raise ValueError(f"capacity must be None or a positive integer, got {capacity!r}")
  sharding_lib.check_mesh(mesh, 0)
  spans = sharding_lib.spans_processes(mesh)
  if not spans:
    ids = _prepare_prompts(target, prompts)
    rows, processes = range(len(ids)), 1
  else:       # each process fed its own rows: every process now gets the whole global batch
    try:
      ids, error = _prepare_prompts(target, prompts, allow_empty=True), None
    except ValueError as e:
      ids, error = [], str(e)
    ids, sampling, rows, processes = global_batch.assemble(ids, sampling, _agreed_options(
        target, drafter, k, max_new_tokens, sampling, key, stop_tokens, capacity, prompt_bucket,
        tree), error=error)
  sharding_lib.check_mesh(mesh, len(ids))
  prompt_tokens, prompt_lens, capacity = _pad_batch(target, ids, max_new_tokens, extent,
                                                     capacity, prompt_bucket)
  batch = prompt_tokens.shape[0]
  mesh = sharding_lib.as_auto(mesh)
  greedy = sampling.is_greedy
  sampling = sampling.as_arrays(batch)
  stop = _stop_array(target, stop_tokens)

  costs = None
  if gov is not None:   # the cost table (calibrated on first use, then cached): not timed
    from spec_jax import governor as governor_lib
    costs = governor_lib.round_costs_for(gov, target, drafter, batch, capacity, greedy,
                                         max_new_tokens, prompt_len=prompt_tokens.shape[1],
                                         stop_count=len(stop), mesh=mesh)
  compiled, args, kwargs = compiled_decode_call(
      target, drafter, prompt_tokens, prompt_lens, key, max_new_tokens=max_new_tokens,
      sampling=sampling, stop=stop, capacity=capacity, greedy=greedy, mesh=mesh,
      num_draft="auto" if gov is not None else k, governor=gov, round_costs=costs, tree=tree)
  start = time.perf_counter()
  packed = compiled(*args, **kwargs)
  flat = global_batch.to_host(packed, spans)   # waits for the result; every row, every process
  seconds = time.perf_counter() - start

  result = compiled.unpack(flat)
  new = new_tokens(result)[rows.start:rows.stop]
  text = None
  if target.tokenizer is not None:
    text = [target.tokenizer.decode(t) for t in new]
  stats = SpecStats.from_result(result, seconds=seconds, num_draft=k, processes=processes,
                                auto=gov is not None, tree=tree)
  return GenerateOutput(tokens=new, text=text, stats=stats, result=result, rows=rows)


def _agreed_options(target, drafter, k, max_new_tokens, sampling, key, stop_tokens, capacity,
                    prompt_bucket, tree=None) -> dict:
  """What every process of a multi-process generate() must pass alike (global_batch.assemble
  compares fingerprints): all options but the prompts and per-row sampling arrays."""
  scalar = all(np.ndim(v) == 0 for v in (sampling.temperature, sampling.top_k, sampling.top_p))
  params = lambda pytree: [(np.shape(x), str(x.dtype)) for x in jax.tree.leaves(pytree)]
  return {"target": [repr(target.config), params(target.params)],
          "drafter": None if drafter is None else [type(drafter).__name__,
                                                   params(drafter.params)],
          "num_draft": k, "max_new_tokens": max_new_tokens,
          "sampling": [float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)]
          if scalar else "per-row",
          "key": np.asarray(jax.random.key_data(key)).tolist(),
          "stop_tokens": None if stop_tokens is None else np.asarray(stop_tokens).tolist(),
          "capacity": capacity, "prompt_bucket": prompt_bucket,
          "tree": None if tree is None else tree.label()}
