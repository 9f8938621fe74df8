"""decode: the whole generation as one pure function of arrays — the prefill, then the rounds of
one round strategy (decoding.strategies: a chain, a tree, the governor) in `lax.while_loop`s.
Jittable: research code calls it inside its own `jax.jit`; generate (decoding.generate) is a
host wrapper."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import platform as kernel_platform
from spec_jax import processors as processors_lib, sampling as sampling_lib
from spec_jax import sharding as sharding_lib
from spec_jax.decoding.checks import as_token_ids, check_capacity, check_key, is_static_int
from spec_jax.decoding.rounds import NoDrafter, row_keys
from spec_jax.decoding.state import DecodeResult, DecodeState, LoopEnv, RowCounts
from spec_jax.decoding.strategies import Strategy, strategy_for
from spec_jax.decoding.target import as_target, model_config
from spec_jax.drafters.base import Drafter, PrefillInfo
from spec_jax.models.prefill import PREFILL_CHUNK, chunked_prefill
from spec_jax.sampling import Sampling


def decode(target_params, prompt_tokens, prompt_lens, key, *, config,
           drafter: Optional[Drafter] = None, drafter_params=None, num_draft=4,
           max_new_tokens, capacity: int, sampling: Sampling, stop_tokens=(),
           tree=None, mesh=None, greedy: Optional[bool] = None, cache=None,
           governor=None, round_costs=None, acceptance_prior=None,
           prefill_chunk: int = PREFILL_CHUNK, strategy=None,
           history: Optional[bool] = None, processors=(),
           processor_params=None) -> DecodeResult:
  """The whole speculative generation as one pure function of arrays: prefill + rounds in one
  `lax.while_loop`. Jittable; call it inside your own `jax.jit` next to other work (called
  eagerly it traces and compiles the loop again on every call; sj.generate compiles once).

  Args (arrays, traced):
    target_params: the target's param pytree (`model.params`).
    prompt_tokens: int32 [B, P] right-padded prompts (any valid id as padding).
    prompt_lens: int32 [B] real prompt lengths, >= 1.
    key: a jax PRNG key (the only source of randomness; same key -> same tokens).
    processor_params: the processors' arrays, a tuple with one pytree per processor (a grammar's
      tables); None takes each processor's own `params` (then compile-time constants of your
      jit: pass them as an argument instead).
    drafter_params: the drafter's params (`drafter.params`); None uses `drafter.params`, which
      then become compile-time constants of your jit — pass them as an argument instead.
    sampling: Sampling with scalars or per-row [B] arrays.
    stop_tokens: a tuple of ints or an int32 [N] array; () never stops early.
    max_new_tokens: int, or a traced int32 scalar (then capacity is not checked against it).
    cache: optional cache to decode into (a KVCache [L, B, S, Hkv, Dh] for spec_jax.models);
      default target.init_cache(B, S). Passing one saves no memory: the decode does not return
      the cache, so a donated one cannot be aliased, and on XLA:TPU a cache donated and
      returned made the program's peak larger, not smaller (docs/accelerators.md).
    round_costs: for a strategy that chooses its rounds by cost (num_draft="auto": the
      governor), float [len(governor.ks)] seconds (or any common unit) of one round at each
      candidate K, in the order of `governor.candidates(drafter)` —
      `sj.calibrate(...).round_costs`; None takes the governor's own `costs` table (or, with a
      `schedule`, needs none).
    acceptance_prior: with num_draft="auto", float [W] per-position acceptance learned from
      earlier calls of the same pair (their DecodeResult.position_acceptance; W = the largest
      candidate K): the governor starts from it instead of its guess and skips its warm-up
      rounds (spec_jax.governor). None, or any entry < 0: no prior. Ignored by other
      strategies.
  Static (hashable; mark them static in your jit, e.g. with functools.partial):
    config: the target's ModelConfig, or any spec_jax.Target (the target protocol,
      spec_jax.decoding.target: a JAX model of your own, wrapped in a few lines).
    drafter: a Drafter or None (plain decoding, K = 0).
    strategy: how the rounds run (sj.strategies): Chain(K), Tree(spec), Governed(governor),
      "auto" (the governor with its defaults), or a Strategy of your own. None: num_draft,
      tree and governor say it (the sugar: Chain(num_draft), Tree(tree), "auto").
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
    history: carry each row's token history (sampling.History) and apply the repetition,
      presence and frequency penalties. None: unless they are concretely off
      (Sampling.needs_history; traced values: True). False with a penalty on ignores it.
    processors: a tuple of spec_jax.processors.LogitsProcessor (a compiled grammar constraint,
      sj.constraints; your own): applied in order after the penalties to the target's
      distribution at every position (each verify position with its own drafted prefix), and
      by the draft model to its drafts; () none.

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
  target = as_target(config)
  strategy = strategy_for(strategy, drafter, num_draft, tree, governor, target)
  if drafter is not None and model_config(target) is not None:
    # generate() checks against the Model (tokenizers too); here only the config is known
    drafter.check_compatible(types.SimpleNamespace(config=model_config(target), tokenizer=None))
  processors = processors_lib.check_processors(processors)
  if processor_params is None:
    processor_params = tuple(p.params for p in processors)
  processor_params = tuple(processor_params)
  if len(processor_params) != len(processors):
    raise ValueError(f"processor_params must hold one entry per processor: {len(processors)} "
                     f"processors, {len(processor_params)} params")
  if drafter is None:
    drafter = NoDrafter()
  if drafter_params is None:
    drafter_params = drafter.params
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
  if prompt_tokens.ndim != 2 or prompt_lens.shape != prompt_tokens.shape[:1]:
    raise ValueError(f"prompt_tokens must be int32 [B, P] and prompt_lens [B]; got shapes "
                     f"{prompt_tokens.shape} and {prompt_lens.shape}")
  p = prompt_tokens.shape[1]
  extent = strategy.extent
  if is_static_int(max_new_tokens):
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_capacity(capacity, p, int(max_new_tokens), extent)
  elif not is_static_int(capacity) or capacity < max(p, extent + 2):
    raise ValueError(f"capacity must be an integer >= max(P, K + 2) = {max(p, extent + 2)}, "
                     f"got {capacity!r}")
  if not is_static_int(prefill_chunk) or prefill_chunk < 1:
    raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a spec_jax.Sampling, got {type(sampling).__name__}")
  if all(opt.is_concrete(getattr(sampling, n)) for n, opt in sampling_lib.OPTIONS.items()):
    sampling.check(batch_size=prompt_tokens.shape[0], vocab_size=target.vocab_size)
  check_concrete_inputs(prompt_tokens, prompt_lens, key, stop_tokens, target.vocab_size)
  costs = strategy.round_costs(drafter, round_costs)          # ValueError on a bad table
  # Under a mesh the verify-attention kernels run per device (kernels_pallas.platform).
  with contextlib.nullcontext() if mesh is None else kernel_platform.kernel_mesh(mesh):
    env, state = init_loop(target_params, prompt_tokens, prompt_lens, key, config=target,
                           drafter=drafter, drafter_params=drafter_params,
                           max_new_tokens=max_new_tokens, capacity=capacity, sampling=sampling,
                           stop_tokens=stop_tokens, greedy=greedy, mesh=mesh, cache=cache,
                           strategy=strategy, prefill_chunk=prefill_chunk, history=history,
                           processors=processors, processor_params=processor_params,
                           round_costs=costs, acceptance_prior=acceptance_prior)
    final = strategy.run(env, state.replace(strategy=strategy.init(env, state)))
  return DecodeResult.of(final, prompt_lens, strategy.k_rounds(final),
                         strategy.position_acceptance(final), strategy.row_acceptance(final))


def _on_host(x) -> bool:
  """Whether this process can read x's values: not traced, not spread over other processes."""
  return not isinstance(x, jax.core.Tracer) and getattr(x, "is_fully_addressable", True)


def check_concrete_inputs(prompt_tokens, prompt_lens, key, stop_tokens, vocab_size: int):
  """decode's checks of the values it can see (ValueError); traced values are the caller's:
  the key is one jax.random.key; where this process holds them, every prompt length in
  [1, P], every prompt id and stop id in [0, V) (stop ids may be -1: padding)."""
  check_key(key)
  p = prompt_tokens.shape[1]
  if _on_host(prompt_lens):
    lens = np.asarray(prompt_lens)
    if lens.size and (lens.min() < 1 or lens.max() > p):
      raise ValueError(f"prompt_lens must lie in [1, P={p}], got values from {lens.min()} to "
                       f"{lens.max()}")
    if _on_host(prompt_tokens):
      ids = np.asarray(prompt_tokens)
      real = np.arange(p)[None, :] < lens[:, None]          # the padding may hold anything
      bad = ids[real & ((ids < 0) | (ids >= vocab_size))]
      if bad.size:
        raise ValueError(f"prompt token ids outside the vocabulary [0, {vocab_size}): "
                         f"{bad[:5].tolist()}")
  if stop_tokens is None:
    raise ValueError("decode's stop_tokens is a tuple of ids or an int32 [N] array (() never "
                     "stops early); None, the model's defaults, is generate()'s: pass "
                     "spec_jax.models.chat.default_stop_ids(model)")
  if _on_host(stop_tokens):
    stops = np.asarray(stop_tokens).reshape(-1)
    if stops.size:
      as_token_ids(stops, "stop_tokens")            # ValueError on non-integral ids (21.5)
    bad = stops[(stops >= vocab_size) | (stops < -1)]    # -1 pads (prompts.padded_stops)
    if bad.size:
      raise ValueError(f"stop_tokens outside the vocabulary [0, {vocab_size}): "
                       f"{bad[:5].tolist()}")


def init_loop(target_params, prompt_tokens, prompt_lens, key, *, config,
              drafter: Drafter, drafter_params, max_new_tokens, capacity: int,
              sampling: Sampling, stop_tokens=(), greedy: Optional[bool] = None, mesh=None,
              cache=None, strategy: Strategy, prefill_chunk: int = PREFILL_CHUNK,
              history: Optional[bool] = None, processors: tuple = (),
              processor_params: tuple = (), round_costs=None, acceptance_prior=None) -> tuple:
  """Everything before the loop (inputs already checked by `decode`): the execution layout of
  the weights, the prefill, the first token, the drafter's state -> (LoopEnv, DecodeState)
  with accepted_at [B, strategy.width] and no strategy state yet. config: a Target or a
  ModelConfig. strategy: a bound Strategy; its extent bounds the rows' lengths, and with
  lazy_drafter the loop calls drafter.catch_up before drafting (PrefillInfo.lazy).
  history: the penalties' token counts; processors (checked) with their params: the History
  carries their states too (LoopEnv.history: either). round_costs, acceptance_prior: the
  strategy's checked cost table and prior (LoopEnv), read by Strategy.init_drafter (the
  governor skips the drafter's prefill work when its first round is plain and final)."""
  target = as_target(config)
  b, p = prompt_tokens.shape
  extent = strategy.extent
  if greedy is None:
    greedy = _concretely_greedy(sampling)
  if history is None:
    history = sampling.needs_history
  penalties = bool(history)
  history = penalties or bool(processors)        # the loop carries a History
  sampling = sampling.rows(b)
  stop_tokens = jnp.asarray(stop_tokens, jnp.int32).reshape(-1)
  s = int(capacity)
  layers = tuple(drafter.target_layers)
  # Max committed length per row; never past the cache (a round writes width + 1 slots from
  # lengths - 1), so a prompt too long for `capacity` stops its row instead of writing out of
  # bounds (generate checks the real lengths on the host first).
  limit = jnp.minimum(prompt_lens + jnp.asarray(max_new_tokens, jnp.int32), s - extent - 1)
  # Loop-invariant work on the weights, once per call, outside the loop (the execution layout:
  # see models.layout.prepare_params).
  target_params = target.prepare(target_params, mesh)
  drafter_params = drafter.prepare(drafter_params)

  # Prefill: the right-padded prompts at offset 0 (padding sits after each row's prompt, is
  # never attended by real tokens, and its KV slots are overwritten by generated tokens).
  if cache is None:
    cache = target.init_cache(b, s)
  else:
    target.check_cache(cache, b, s)
  cache = target.constrain_cache(mesh, cache)
  pre = chunked_prefill(
      lambda tok, cache, offsets, last, layers: target.forward_last(
          target_params, tok, cache, offsets, last, return_layers=layers),
      prompt_tokens, prompt_lens, cache, chunk=prefill_chunk,
      keep_hidden=drafter.reads_prompt_hidden, return_layers=layers,
      constrain_features=functools.partial(sharding_lib.constrain_features, mesh))
  last_logits = pre.last_logits
  key, first_key = jax.random.split(key)
  # The penalties' and processors' history: the prompt, then every committed output token (the
  # first one now).
  hist = sampling_lib.History.of_prompt(
      prompt_tokens, prompt_lens, last_logits.shape[-1], penalties=penalties,
      processors=processors, params=processor_params) if history else None
  if greedy:
    first = sampling_lib.greedy_tokens(last_logits, sampling, hist)
  else:
    first = jax.vmap(sampling_lib.sample)(row_keys(first_key, b),
                                          sampling_lib.probs(last_logits, sampling, hist))
  tokens = jnp.zeros((b, s), jnp.int32).at[:, :p].set(
      jnp.where(jnp.arange(p)[None] < prompt_lens[:, None], prompt_tokens, 0))
  tokens = tokens.at[jnp.arange(b), prompt_lens].set(first)
  lengths = prompt_lens + 1
  done = jnp.any(first[:, None] == stop_tokens[None, :], axis=1) | (lengths >= limit)
  zeros = jnp.zeros((b,), jnp.int32)
  counts = RowCounts(rounds=zeros, drafted=zeros, accepted=zeros,
                     accepted_at=jnp.zeros((b, strategy.width), jnp.int32),
                     finished_at_round=jnp.where(done, 0, -1).astype(jnp.int32),
                     rejected=zeros)
  state = DecodeState(tokens=tokens, lengths=lengths, done=done, cache=pre.cache,
                      drafter_state=None, key=key, counts=counts,
                      iterations=jnp.zeros((), jnp.int32),
                      sampling_state=() if hist is None else hist.add(
                          first[:, None], jnp.ones((b,), jnp.int32)))
  env = LoopEnv(target=target, drafter=drafter, drafter_params=drafter_params,
                target_params=target_params, sampling=sampling, stop_tokens=stop_tokens,
                limit=limit, greedy=greedy, layers=layers, history=history,
                round_costs=round_costs, acceptance_prior=acceptance_prior,
                rolled=rolls_draft_steps(drafter))
  init_drafter = lambda: drafter.init_state(drafter_params, PrefillInfo(
      tokens=tokens, prompt_tokens=prompt_tokens, prompt_lens=prompt_lens, hidden=pre.hidden,
      layer_hidden=pre.layer_hidden, target_params=target_params,
      sampling=sampling.for_drafts(), lazy=strategy.lazy_drafter))
  return env, state.replace(drafter_state=strategy.init_drafter(env, state, init_drafter))


def rolls_draft_steps(drafter: Drafter) -> bool:
  """Whether `drafter` runs its later draft steps in this decode as a `lax.fori_loop`
  (DraftContext.rolled: the same drafts and q, two copies of its layers in the program instead
  of K): when the platform being lowered for is one the drafter names
  (Drafter.rolls_steps_on). A draft model rolls on TPU, where its unrolled steps held 21 MiB
  more HBM per chip (1B draft model beside an 8B target, K = 4, v5e 2x2 `model=4`: each step's
  weights take their own async slices into VMEM), and on CPU, where the loop ran at the
  unrolled program's speed (0.98-1.01x) and compiles faster. Feature heads do not: on TPU an
  EAGLE-3 head's loop measured 56 MiB more (docs/accelerators.md). Nothing rolls on GPU, where
  no loop was measured (XLA:GPU may sync with the host at every iteration). The governor
  rolls every drafter's rounds on every platform (many K, one program)."""
  return kernel_platform.current() in drafter.rolls_steps_on


def _concretely_greedy(sampling: Sampling) -> bool:
  """True when every temperature is a concrete 0 (known at trace time)."""
  t = sampling.temperature
  if isinstance(t, jax.core.Tracer):
    return False
  try:
    return bool(np.all(np.asarray(t) == 0))
  except (TypeError, jax.errors.ConcretizationTypeError):
    return False
