"""Prefill, draft/verify rounds, commit, and generate(): one jit around one while_loop.

One round (fixed shapes; ../shared/DESIGN.md):

    drafter.propose ─► draft_tokens [B,K] (+ q [B,K,V] or None)
    [last committed token, drafts] [B,K+1] ─► verify_step: one target forward at cache offsets
        lengths-1 .. lengths-1+K ─► p [B,K+1,V] ─► rejection_sample ─► tokens [B,K+1], n_accepted
    commit: lengths += emitted (n_accepted + 1, cut at a stop token or max_new_tokens);
        rejected KV slots stay in the cache, masked by the lengths, and are overwritten later.

Invariant: row b holds `lengths[b]` committed tokens in `tokens[b]`; the target's KV cache holds
entries for positions < lengths[b] - 1 (the last committed token is fed in the next round).
K = 0 (no drafter) is plain autoregressive decoding through the same loop: the baseline.
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_jax import sampling as sampling_lib
from spec_jax import sharding as sharding_lib
from spec_jax.drafters.base import DraftContext, Drafter, PrefillInfo, VerifyInfo
from spec_jax.models.config import ModelConfig
from spec_jax.models.transformer import KVCache, forward, unstack_layers
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
  rounds, drafted, accepted, emitted: int32 [B] statistics of what was emitted (see
    SpecStats); accepted_at: int32 [B, K].
  iterations: int32 scalar, loop iterations so far.
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
  iterations: jax.Array
  emitted: jax.Array


class GenerateOutput(NamedTuple):
  """tokens: list[list[int]] new tokens per row (a stop token that ended a row is included);
  text: list[str] or None (decoded new tokens, special tokens dropped); stats: SpecStats."""
  tokens: list
  text: Optional[list]
  stats: SpecStats


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
                sampling: Sampling, return_layers: Sequence[int] = ()):
  """One target forward over [last committed token, drafts] at offsets lengths-1.

  Args:
    last_tokens: int32 [B]; draft_tokens: int32 [B, K] (-1 padding allowed); lengths: int32 [B].
  Returns:
    (target_probs [B, K+1, V], ForwardOutput) — the output carries the updated cache and the
    hidden states drafters follow.
  """
  inputs = jnp.concatenate([last_tokens[:, None], jnp.maximum(draft_tokens, 0)], axis=1)
  out = forward(params, config, inputs, cache, lengths - 1, return_layers=return_layers)
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


def commit_step(tokens, lengths, done, emitted, n_accepted, stop_tokens, limit):
  """Appends the emitted block to each active row, cut after a stop token or at the limit.

  Args:
    tokens: int32 [B, S]; lengths: int32 [B]; done: bool [B].
    emitted: int32 [B, K+1] from the rejection sampler (-1 after n_accepted).
    stop_tokens: int32 [N] (may be empty); limit: int32 [B] max committed length per row.
  Returns:
    (tokens, new lengths, new done).
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
  return tokens, new_lengths, new_done


# ----------------------------------------------------------------------------- the jitted loop

@functools.partial(jax.jit,
                   static_argnames=("config", "drafter", "num_draft", "capacity", "mesh"))
def _generate_loop(target_params, drafter_params, prompt_tokens, prompt_lens, max_new_tokens,
                   stop_tokens, sampling: Sampling, key, *, config: ModelConfig, drafter: Drafter,
                   num_draft: int, capacity: int, mesh=None):
  """Prefill + rounds until every row is done. Returns the final DecodeState."""
  b, p = prompt_tokens.shape
  k, s = num_draft, capacity
  layers = tuple(drafter.target_layers)
  limit = prompt_lens + max_new_tokens  # max committed length per row
  if jax.default_backend() == "cpu":
    # XLA:CPU copies a stacked weight's slice before each dot; slice once per call instead.
    target_params = unstack_layers(target_params)
  drafter_params = drafter.prepare(drafter_params)

  # Prefill: the right-padded prompts at offset 0 (padding sits after each row's prompt, is
  # never attended by real tokens, and its KV slots are overwritten by generated tokens).
  cache = sharding_lib.constrain_cache(mesh, KVCache.zeros(config, b, s))
  pre = forward(target_params, config, prompt_tokens, cache, jnp.zeros((b,), jnp.int32),
                return_layers=layers)
  last_logits = jnp.take_along_axis(pre.logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
  key, first_key = jax.random.split(key)
  first = jax.vmap(sampling_lib.sample)(row_keys(first_key, b),
                                        sampling_lib.probs(last_logits, sampling))
  tokens = jnp.zeros((b, s), jnp.int32).at[:, :p].set(
      jnp.where(jnp.arange(p)[None] < prompt_lens[:, None], prompt_tokens, 0))
  tokens = tokens.at[jnp.arange(b), prompt_lens].set(first)
  lengths = prompt_lens + 1
  done = jnp.any(first[:, None] == stop_tokens[None, :], axis=1) | (lengths >= limit)
  drafter_state = drafter.init_state(drafter_params, PrefillInfo(
      tokens=tokens, prompt_tokens=prompt_tokens, prompt_lens=prompt_lens, hidden=pre.hidden,
      layer_hidden=pre.layer_hidden, target_params=target_params, sampling=sampling))
  zeros = jnp.zeros((b,), jnp.int32)
  state = DecodeState(tokens=tokens, lengths=lengths, done=done, cache=pre.cache,
                      drafter_state=drafter_state, key=key, rounds=zeros, drafted=zeros,
                      accepted=zeros, accepted_at=jnp.zeros((b, k), jnp.int32),
                      iterations=jnp.zeros((), jnp.int32), emitted=zeros)

  def round_(st: DecodeState) -> DecodeState:
    key, draft_key, accept_key = jax.random.split(st.key, 3)
    ctx = DraftContext(key=draft_key, tokens=st.tokens, lengths=st.lengths, sampling=sampling,
                       target_params=target_params, num_draft=k)
    draft_tokens, draft_probs, draft_lengths, dstate = draft_step(
        drafter, drafter_params, st.drafter_state, ctx)
    last = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)[:, 0]
    target_probs, out = verify_step(target_params, config, st.cache, last, draft_tokens,
                                    st.lengths, sampling, layers)
    emitted, n_acc = accept_step(accept_key, draft_tokens, draft_probs, target_probs,
                                 draft_lengths)
    tokens, lengths, done = commit_step(st.tokens, st.lengths, st.done, emitted, n_acc,
                                        stop_tokens, limit)
    verify = VerifyInfo(input_tokens=jnp.concatenate([last[:, None], jnp.maximum(draft_tokens, 0)], 1),
                        hidden=out.hidden, layer_hidden=out.layer_hidden,
                        lengths_before=st.lengths, lengths=lengths, target_params=target_params)
    dstate = drafter.commit(drafter_params, dstate, emitted, n_acc, verify)
    # Statistics count what was emitted: a block cut by max_new_tokens or a stop token after
    # e <= n_acc tokens emitted e accepted drafts (the rest were thrown away, like the drafts
    # past a rejection) and judged only those e drafts. Finished rows emit 0 and count nothing.
    active = (~st.done).astype(jnp.int32)
    n_out = lengths - st.lengths                       # tokens this round emitted (0 if done)
    cut = n_out <= n_acc
    acc_out = jnp.minimum(n_acc, n_out)
    return DecodeState(
        tokens=tokens, lengths=lengths, done=done, cache=out.cache, drafter_state=dstate, key=key,
        rounds=st.rounds + active,
        drafted=st.drafted + active * jnp.where(cut, n_out, draft_lengths),
        accepted=st.accepted + active * acc_out,
        accepted_at=st.accepted_at + active[:, None] * (
            jnp.arange(k)[None, :] < acc_out[:, None]).astype(jnp.int32),
        iterations=st.iterations + 1,
        emitted=st.emitted + active * n_out)

  return jax.lax.while_loop(lambda st: ~jnp.all(st.done), round_, state)


# ----------------------------------------------------------------------------- generate()

def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _prepare_prompts(target, prompts) -> list[list[int]]:
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
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
      ids = _token_ids(prompt, f"prompt {i}")
    if len(ids) == 0:
      raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    out.append(ids)
  return out


def _token_ids(values, what: str) -> list[int]:
  """A flat list of token ids from a sequence of integers (integral floats are accepted, as
  from a float array); raises ValueError on anything else instead of truncating it."""
  if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray, jax.Array)):
    raise ValueError(f"{what} must be a list of integer token ids, got {type(values).__name__}")
  try:
    arr = np.asarray(values)
  except ValueError as e:  # ragged nesting
    raise ValueError(f"{what} must be a flat list of integer token ids: {e}") from None
  if arr.size == 0:
    return []
  if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                               or np.issubdtype(arr.dtype, np.floating)):
    raise ValueError(f"{what} must hold integer token ids, got {arr.dtype} values "
                     f"{arr.reshape(-1)[:5].tolist()}")
  if np.issubdtype(arr.dtype, np.floating):
    bad = arr[~np.isfinite(arr) | (arr != np.round(arr))]
    if bad.size:
      raise ValueError(f"{what} must hold integer token ids; these are not integers: "
                       f"{bad[:5].tolist()}")
  return [int(t) for t in arr.reshape(-1).tolist()]


def _stop_array(target, stop_tokens) -> np.ndarray:
  if stop_tokens is None:
    stop_tokens = target.config.eos_token_ids
  stop = _token_ids(stop_tokens, "stop_tokens (None = the model's end-of-text tokens, [] = none)")
  bad = [t for t in stop if not 0 <= t < target.config.vocab_size]
  if bad:
    raise ValueError(f"stop_tokens outside the vocabulary [0, {target.config.vocab_size}): {bad}")
  return np.asarray(stop, np.int32).reshape(-1)


def _check_key(key) -> None:
  """None, a typed key (jax.random.key) or a raw uint32[2] key (jax.random.PRNGKey)."""
  if key is None:
    return
  if isinstance(key, (jax.Array, np.ndarray)):
    dtype = key.dtype
    if jnp.issubdtype(dtype, jax.dtypes.prng_key) and key.shape == ():
      return
    if dtype == np.uint32 and key.shape == (2,):
      return
    what = f"an array of dtype {dtype} and shape {key.shape}"
  else:
    what = f"{type(key).__name__} {key!r}"
  raise ValueError(f"key must be one jax PRNG key, jax.random.key(seed) (or a uint32[2] "
                   f"jax.random.PRNGKey), or None for key(0); got {what}")


_COMPILED: dict = {}


def _compiled_loop(args, static):
  """AOT-compiles once per (shapes, static config) so that timings exclude compilation."""
  leaves, treedef = jax.tree.flatten(args)
  sig = (tuple(sorted(static.items(), key=lambda kv: kv[0])), treedef,
         tuple((np.shape(a), str(getattr(a, "dtype", type(a)))) for a in leaves))
  if sig not in _COMPILED:
    _COMPILED[sig] = _generate_loop.lower(*args, **static).compile()
  return _COMPILED[sig]


def generate(target, prompts, drafter: Optional[Drafter] = None, num_draft: int = 4,
             max_new_tokens: int = 128, sampling: Sampling = Sampling(), key=None,
             stop_tokens=None, capacity: Optional[int] = None, mesh=None) -> GenerateOutput:
  """Speculative (or, with drafter=None, plain) generation for a batch of prompts.

  Args:
    target: a Model (sj.load / sj.init_model).
    prompts: list[str] (needs a tokenizer; BOS added as the tokenizer does) or list[list[int]];
      rows may differ in length.
    drafter: a Drafter (sj.drafters.*) or None for plain decoding (then num_draft is ignored).
    num_draft: K, draft tokens per round (>= 1 with a drafter).
    max_new_tokens: new tokens per row at most (>= 1).
    sampling: Sampling, scalars or per-row [B] arrays; temperature 0 = greedy.
    key: jax PRNG key (default key(0)).
    stop_tokens: None = the model's end-of-text tokens; [] = never stop early.
    capacity: KV-cache capacity S (default: the longest prompt + max_new_tokens + K + 1, rounded
      up to a multiple of 64); one compile per (B, prompt bucket, S, K).
    mesh: optional jax.sharding.Mesh with axes "data" (batch rows) and "model" (heads, MLP
      features, vocabulary): see spec_jax.sharding. The batch must divide the "data" size.

  Returns:
    GenerateOutput(tokens, text, stats).
  """
  ids = _prepare_prompts(target, prompts)
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  if drafter is None:
    drafter, k = NoDrafter(), 0
  else:
    if not isinstance(drafter, Drafter):
      raise ValueError(f"drafter must be a spec_jax.drafters drafter or None, got "
                       f"{type(drafter).__name__}")
    if isinstance(num_draft, bool) or not isinstance(num_draft, (int, np.integer)) or num_draft < 1:
      raise ValueError(f"num_draft (K) must be an integer >= 1 when a drafter is given, got "
                       f"{num_draft!r}")
    if drafter.max_draft is not None and num_draft > drafter.max_draft:
      raise ValueError(f"this drafter proposes at most {drafter.max_draft} tokens per round; "
                       f"num_draft={num_draft} is too large")
    drafter.check_compatible(target)
    k = int(num_draft)
  batch = len(ids)
  sharding_lib.check_mesh(mesh, batch)
  mesh = sharding_lib.as_auto(mesh)
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a spec_jax.Sampling (e.g. sj.Sampling(temperature=0.0) "
                     f"for greedy), got {type(sampling).__name__}")
  sampling = sampling.as_arrays(batch)
  _check_key(key)
  stop = _stop_array(target, stop_tokens)

  longest = max(len(r) for r in ids)
  max_pos = target.config.max_position_embeddings
  if longest + max_new_tokens > max_pos:
    raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) "
                     f"exceeds the model's context of {max_pos} positions")
  needed = longest + max_new_tokens + k + 1
  if capacity is None:
    capacity = _round_up(needed, CAPACITY_BUCKET)
  elif isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
    raise ValueError(f"capacity must be an integer number of KV-cache slots (or None for "
                     f"automatic), got {capacity!r} of type {type(capacity).__name__}")
  elif capacity < needed:
    raise ValueError(f"capacity {capacity} is too small: the longest prompt ({longest}) + "
                     f"max_new_tokens ({max_new_tokens}) + K+1 ({k + 1}) needs {needed}")
  p = min(_round_up(longest, PROMPT_BUCKET), capacity)
  prompt_tokens = np.zeros((batch, p), np.int32)
  for b, r in enumerate(ids):
    prompt_tokens[b, :len(r)] = r
  prompt_lens = np.asarray([len(r) for r in ids], np.int32)
  if key is None:
    key = jax.random.key(0)

  args = (sharding_lib.shard_params(mesh, target.params),
          sharding_lib.shard_params(mesh, drafter.params),
          *sharding_lib.shard_rows(mesh, (jnp.asarray(prompt_tokens), jnp.asarray(prompt_lens))),
          *sharding_lib.replicate(mesh, (jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(stop))),
          sharding_lib.shard_rows(mesh, sampling), sharding_lib.replicate(mesh, key))
  static = dict(config=target.config, drafter=drafter, num_draft=k, capacity=int(capacity),
                mesh=mesh)
  compiled = _compiled_loop(args, static)
  start = time.perf_counter()
  final = compiled(*args)
  jax.block_until_ready(final.lengths)
  seconds = time.perf_counter() - start

  tokens_np = np.asarray(final.tokens)
  lengths_np = np.asarray(final.lengths)
  new = [tokens_np[b, prompt_lens[b]:lengths_np[b]].tolist() for b in range(batch)]
  text = None
  if target.tokenizer is not None:
    text = [target.tokenizer.decode(t) for t in new]
  stats = SpecStats.from_counts(
      rounds=np.asarray(final.rounds), drafted=np.asarray(final.drafted),
      accepted=np.asarray(final.accepted), accepted_at=np.asarray(final.accepted_at),
      seconds=seconds, new_tokens=sum(len(t) for t in new),
      iterations=int(final.iterations), num_draft=k, emitted=np.asarray(final.emitted))
  return GenerateOutput(tokens=new, text=text, stats=stats)
