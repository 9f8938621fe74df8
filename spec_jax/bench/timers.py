"""Jitted timing loops of the engine's pieces: target forward, drafter propose + commit, verify
step, accept step. Each time_* builds a `call(n)` (n iterations of a fori_loop, blocking) and
times it with spec_jax.timing; with call_only=True it returns the call itself, for
several timers measured round-robin by timing.time_interleaved.

The loops mirror what generate() does once per call (unstacked layers on CPU, drafter.prepare)
outside the loop, so the differencing in timing cancels it as the engine's loop amortises it.
"""

from __future__ import annotations

from spec_jax.timing import time_calls
from spec_jax.models.layout import prepare_params
from spec_jax.models.transformer import forward
from spec_jax.drafters.base import DraftContext, VerifyInfo
from spec_jax.drafters.base import PrefillInfo
from spec_jax.models.transformer import KVCache
import spec_jax as sj
from spec_jax.decoding.rounds import verify_step
from spec_jax.decoding.rounds import accept_step
from spec_jax.decoding.loop import rolls_draft_steps

_FN_CACHE: dict = {}


def _as_engine_prepares(params, config):
  """The target params as decode() hands them to its loop: the execution layout of
  models.layout.prepare_params (fused projections; on CPU stored [out, in] and unstacked), made
  once per call. Timers do the same, before their loop."""
  return prepare_params(params, config)


def _forward_loop_fn(config):
  """jit(params, tokens [B,T], cache, offsets, n) -> (tokens, cache): n forwards in a fori_loop,
  the argmax of every position fed back as the next inputs (so the LM head is not dead code),
  the cache carried and updated in place at the same offsets (the fill stays F)."""
  key = ("fwd", config)
  if key not in _FN_CACHE:
    import jax
    import jax.numpy as jnp

    def run(params, tokens, cache, offsets, n):
      params = _as_engine_prepares(params, config)

      def body(_, carry):
        toks, c = carry
        out = forward(params, config, toks, c, offsets)
        return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache
      return jax.lax.fori_loop(0, n, body, (tokens, cache))

    _FN_CACHE[key] = jax.jit(run, donate_argnums=(2,))
  return _FN_CACHE[key]


def _propose_loop_fn(drafter, k, target_config):
  """jit(params, state, tokens [B,S], lengths, rng, sampling, target_params, n) -> (tokens,
  state): n rounds of the drafter's own work in a fori_loop — propose() and then commit() with
  a synthetic verify result (zero target features, nothing accepted), the drafter state carried
  as in the engine. commit is free for draft models and n-gram; feature heads (EAGLE, MTP) run
  their layer over the K+1 verified features there, which is drafting cost too. The first draft
  is written back into the buffer so no call is loop-invariant."""
  key = ("propose", drafter, k, target_config)
  if key not in _FN_CACHE:
    import jax
    import jax.numpy as jnp

    def run(params, state, tokens, lengths, rng, sampling, target_params, n):
      b = tokens.shape[0]
      # What generate() does once per call, outside its loop.
      params = drafter.prepare(params) if hasattr(drafter, "prepare") else params
      target_params = _as_engine_prepares(target_params, target_config)
      width = target_params["embed"].shape[1]
      hidden = jnp.zeros((b, k + 1, width), target_params["embed"].dtype)

      def body(i, carry):
        toks, st = carry
        ctx = DraftContext(key=jax.random.fold_in(rng, i), tokens=toks, lengths=lengths,
                           sampling=sampling, target_params=target_params, num_draft=k,
                           rolled=rolls_draft_steps(drafter))   # as a chain decode does
        drafts, _, st = drafter.propose(params, st, ctx)
        drafts = jnp.maximum(drafts, 0).astype(jnp.int32)
        emitted = jnp.concatenate([drafts[:, :1], jnp.full((b, k), -1, jnp.int32)], axis=1)
        verify = VerifyInfo(input_tokens=jnp.concatenate([drafts[:, :1], drafts], axis=1),
                            hidden=hidden, layer_hidden=tuple(hidden for _ in drafter.target_layers),
                            lengths_before=lengths, lengths=lengths, target_params=target_params)
        st = drafter.commit(params, st, emitted, jnp.zeros((b,), jnp.int32), verify)
        toks = jax.lax.dynamic_update_slice(
            toks, jnp.maximum(drafts[:, :1], 0).astype(toks.dtype), (0, 0))
        return toks, st
      return jax.lax.fori_loop(0, n, body, (tokens, state))

    _FN_CACHE[key] = jax.jit(run, donate_argnums=(1,))
  return _FN_CACHE[key]


def _initial_drafter_state(drafter, target, tokens, fill: int, sampling):
  """The drafter's state after a (fake) prefill of the first min(16, fill) tokens of `tokens`:
  zero target features, real prompt tokens; enough for timing propose()."""
  import jax
  import jax.numpy as jnp
  b = tokens.shape[0]
  p = max(1, min(16, fill))
  d = target.config.hidden_size
  dtype = jnp.dtype(target.config.dtype)
  hidden = jnp.zeros((b, p, d), dtype)
  prefill = PrefillInfo(tokens=tokens, prompt_tokens=tokens[:, :p],
                        prompt_lens=jnp.full((b,), p, jnp.int32), hidden=hidden,
                        layer_hidden=tuple(hidden for _ in drafter.target_layers),
                        target_params=target.params, sampling=sampling)
  return jax.jit(drafter.init_state)(drafter.params, prefill)


def time_forward(model, batch: int, t: int, fill: int, capacity: int, repeats: int = 0,
                 single_call: bool = False, tokens=None, call_only: bool = False):
  """Seconds per forward of `model` over t new tokens per row at cache fill `fill`."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  if fill + t > capacity:
    raise ValueError(f"fill {fill} + T {t} exceeds the capacity {capacity}")
  config = model.config
  fn = _forward_loop_fn(config)
  if tokens is None:
    tokens = np.random.default_rng(0).integers(3, config.vocab_size, size=(batch, t))
  state = {"tokens": jnp.asarray(tokens, jnp.int32).reshape(batch, t),
           "cache": KVCache.zeros(config, batch, capacity)}
  offsets = jnp.full((batch,), fill, jnp.int32)

  def call(n):
    toks, cache = fn(model.params, state["tokens"], state["cache"], offsets, jnp.int32(n))
    jax.block_until_ready(toks)
    state["cache"] = cache
  if call_only:
    return call
  return time_calls(call, repeats, single_call=single_call)


def _text_like_buffer(batch: int, capacity: int, vocab: int):
  """[B, capacity] int32 tokens repeating a random 32-token phrase, so n-grams do match."""
  import numpy as np
  base = np.random.default_rng(0).integers(3, vocab, size=(batch, 32))
  reps = -(-capacity // 32)
  return np.tile(base, (1, reps))[:, :capacity].astype(np.int32)


def time_propose(drafter, target, batch: int, k: int, fill: int, capacity: int, repeats: int = 0,
                 temperature: float = 0.0, call_only: bool = False):
  """Seconds per jitted drafter.propose() of K tokens (the whole draft of one round, sampling
  of q included) on a [B, capacity] buffer with `fill` committed tokens per row."""
  return _time_drafter_loop(_propose_loop_fn(drafter, k, target.config), drafter, target,
                            batch, fill, capacity, repeats, temperature, call_only)


def _propose_tree_loop_fn(drafter, spec, target_config):
  """jit(params, state, tokens, lengths, rng, sampling, target_params, n) -> (tokens, state): n
  rounds of the drafter's tree work, propose_tree() then commit_tree() with a synthetic verify
  (zero target features along a path of depth D, nothing accepted), as _propose_loop_fn."""
  key = ("propose_tree", drafter, spec, target_config)
  if key not in _FN_CACHE:
    import jax
    import jax.numpy as jnp

    def run(params, state, tokens, lengths, rng, sampling, target_params, n):
      b, d = tokens.shape[0], spec.depth
      params = drafter.prepare(params) if hasattr(drafter, "prepare") else params
      target_params = _as_engine_prepares(target_params, target_config)
      width = target_params["embed"].shape[1]
      hidden = jnp.zeros((b, d + 1, width), target_params["embed"].dtype)

      def body(i, carry):
        toks, st = carry
        ctx = DraftContext(key=jax.random.fold_in(rng, i), tokens=toks, lengths=lengths,
                           sampling=sampling, target_params=target_params, num_draft=d)
        tree, st = drafter.propose_tree(params, st, ctx, spec)
        first = tree.tokens[:, 1:2]
        emitted = jnp.concatenate([first, jnp.full((b, d), -1, jnp.int32)], axis=1)
        verify = VerifyInfo(input_tokens=tree.tokens[:, :d + 1], hidden=hidden,
                            layer_hidden=tuple(hidden for _ in drafter.target_layers),
                            lengths_before=lengths, lengths=lengths, target_params=target_params)
        st = drafter.commit_tree(params, st, emitted, jnp.zeros((b,), jnp.int32), verify)
        toks = jax.lax.dynamic_update_slice(toks, first.astype(toks.dtype), (0, 0))
        return toks, st
      return jax.lax.fori_loop(0, n, body, (tokens, state))

    _FN_CACHE[key] = jax.jit(run, donate_argnums=(1,))
  return _FN_CACHE[key]


def time_propose_tree(drafter, target, batch: int, spec, fill: int, capacity: int,
                      repeats: int = 0, temperature: float = 0.0, call_only: bool = False):
  """Seconds per jitted drafter.propose_tree() + commit_tree() of one tree round."""
  return _time_drafter_loop(_propose_tree_loop_fn(drafter, spec, target.config), drafter,
                            target, batch, fill, capacity, repeats, temperature, call_only)


def _time_drafter_loop(fn, drafter, target, batch, fill, capacity, repeats, temperature,
                       call_only):
  """Times fn(params, state, tokens [B, capacity], lengths, key, sampling, target_params, n),
  a jitted loop of n drafter calls, on a text-like buffer with `fill` committed tokens per row
  (call_only: the call itself, for interleaved timing)."""
  import jax
  import jax.numpy as jnp
  tokens = jnp.asarray(_text_like_buffer(batch, capacity, target.config.vocab_size))
  lengths = jnp.full((batch,), fill, jnp.int32)
  sampling = sj.Sampling(temperature=temperature).as_arrays(batch)
  st = {"state": _initial_drafter_state(drafter, target, tokens, fill, sampling)}
  key = jax.random.key(0)

  def call(n):
    toks, st["state"] = fn(drafter.params, st["state"], tokens, lengths, key, sampling,
                           target.params, jnp.int32(n))
    jax.block_until_ready(toks)
  if call_only:
    return call
  return time_calls(call, repeats)


def _verify_loop_fn(config):
  """jit(params, tokens [B,T], cache, offsets, sampling, n): n engine verify_steps (target
  forward + sampling.probs over the T positions), argmax fed back."""
  key = ("verify", config)
  if key not in _FN_CACHE:
    import jax
    import jax.numpy as jnp

    def run(params, tokens, cache, offsets, sampling, n):
      params = _as_engine_prepares(params, config)

      def body(_, carry):
        toks, c = carry
        probs, out = verify_step(params, config, c, toks[:, 0], toks[:, 1:], offsets + 1,
                                        sampling)
        return jnp.argmax(probs, axis=-1).astype(jnp.int32), out.cache
      return jax.lax.fori_loop(0, n, body, (tokens, cache))

    _FN_CACHE[key] = jax.jit(run, donate_argnums=(2,))
  return _FN_CACHE[key]


def time_verify_step(model, batch: int, t: int, fill: int, capacity: int, repeats: int,
                     temperature: float) -> dict:
  """Seconds per verify_step over t tokens (forward + the probs transform)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  fn = _verify_loop_fn(model.config)
  sampling = sj.Sampling(temperature=temperature).as_arrays(batch)
  toks = jnp.asarray(np.random.default_rng(0).integers(3, model.config.vocab_size,
                                                       size=(batch, t)), jnp.int32)
  st = {"cache": KVCache.zeros(model.config, batch, capacity)}
  offsets = jnp.full((batch,), fill, jnp.int32)

  def call(n):
    out, st["cache"] = fn(model.params, toks, st["cache"], offsets, sampling, jnp.int32(n))
    jax.block_until_ready(out)
  return time_calls(call, repeats)


def time_accept(batch: int, k: int, vocab: int, with_draft_probs: bool, temperature: float,
                repeats: int) -> dict:
  """Seconds per accept_step (rejection sampling of K drafts, [B,K+1,V] target probs)."""
  import jax
  import jax.numpy as jnp
  key = ("accept", k, with_draft_probs)
  if key not in _FN_CACHE:
    def run(rng, drafts, q, p, n):
      def body(i, carry):
        d, acc = carry
        emitted, n_acc = accept_step(jax.random.fold_in(rng, i), d, q, p,
                                            jnp.full((d.shape[0],), k, jnp.int32))
        d = (d + jnp.maximum(emitted[:, :k], 0) + n_acc[:, None]) % vocab
        return d, acc + jnp.sum(emitted) + jnp.sum(n_acc)
      return jax.lax.fori_loop(0, n, body, (drafts, jnp.int32(0)))
    _FN_CACHE[key] = jax.jit(run)
  fn = _FN_CACHE[key]
  r = jax.random.key(1)
  s = sj.Sampling(temperature=temperature)
  p = sj.sampling.probs(jax.random.normal(r, (batch, k + 1, vocab)) * 3, s)
  q = sj.sampling.probs(jax.random.normal(jax.random.key(2), (batch, k, vocab)) * 3, s) \
      if with_draft_probs else None
  drafts = jax.random.randint(jax.random.key(3), (batch, k), 0, vocab, jnp.int32)
  return time_calls(lambda n: jax.block_until_ready(fn(r, drafts, q, p, jnp.int32(n))),
                     repeats)


def clear_cache() -> None:
  """Drops the compiled timing loops (bounds the memory of a run over several targets)."""
  _FN_CACHE.clear()
