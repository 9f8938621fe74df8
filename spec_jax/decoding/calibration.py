"""sj.calibrate: the governor's cost table, measured on the compiled decode and cached on disk
(host side, beside generate, which calls it through `round_costs_for`).

A table holds t(K), seconds per round at each candidate K, for one (device kind, target,
drafter, batch B, capacity bucket, greedy or not), keyed by `fingerprint`, and cached as JSON
under $XDG_CACHE_HOME/spec_jax/governor (default ~/.cache/spec_jax/governor). It times the very
executable generate() then runs (compiled once, shared): decode(num_draft="auto") with K forced
through the cost vector, two lengths per K, differenced so the prefill and per-call work cancel
(measure_round_costs). spec_jax.governor's docstring has the cost model that reads it. Any
strategy that reads a table of per-round seconds at candidate K (Strategy.calibration_ks) gets
it from here; tables depend on the K set, not on which strategy reads them.

    table = sj.calibrate(target, drafter, batch=16)   # cached; generate() does this itself
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
import weakref
from typing import Optional

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from spec_jax import global_batch, sharding as sharding_lib
from spec_jax.decoding.compiled import compiled_decode_call
from spec_jax.files import atomic_write_json
from spec_jax.decoding.strategies import Governed, Strategy
from spec_jax.governor import CostTable, Governor
from spec_jax.governor.options import is_int
from spec_jax.models.chat import default_stop_ids
from spec_jax.sampling import Sampling
from spec_jax.sampling_options import LogitBias
from spec_jax.timing import interleaved_rounds, summarize

COST_MODEL_VERSION = 4          # bump when what a timed round contains changes (3: plain is final;
                                # 4: the entry cost, K = 0 timed from its first round)
DEFAULT_CAPACITY = 256


def cache_dir() -> pathlib.Path:
  """$XDG_CACHE_HOME/spec_jax/governor, or ~/.cache/spec_jax/governor."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "spec_jax" / "governor"


_CHECKSUMS: dict = {}
_TABLES: dict = {}
_CHECKSUM_JIT = None
_HASH_ALL_BYTES = 1 << 26          # leaves up to 64 MiB on the host are hashed byte for byte


def _device_sums(leaves) -> np.ndarray:
  """Per-leaf (sum, position-weighted sum, sum of |x|) computed on the device (one jit)."""
  global _CHECKSUM_JIT
  if _CHECKSUM_JIT is None:
    def stats(xs):
      out = []
      for x in xs:
        x = jnp.ravel(x).astype(jnp.float32)
        w = (jnp.arange(x.shape[0], dtype=jnp.int32) % 1021 + 1).astype(jnp.float32)
        out.append(jnp.stack([jnp.sum(x), jnp.sum(x * w), jnp.sum(jnp.abs(x))]))
      return out
    _CHECKSUM_JIT = jax.jit(stats)
  return np.asarray(jnp.stack(_CHECKSUM_JIT(leaves)), np.float32)


def params_checksum(tree) -> str:
  """A short digest of a param pytree's structure and values. Leaves on the host (CPU) are
  hashed byte for byte up to 64 MiB, larger ones by a strided sample plus their sum; leaves on
  an accelerator by sums computed there (no copy to the host). Memoised per set of leaf
  objects."""
  leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape")]
  if not leaves:
    return "none"
  ids = tuple(id(x) for x in leaves)
  hit = _CHECKSUMS.get(ids)
  if hit is not None and all(r() is x for r, x in zip(hit[0], leaves)):
    return hit[1]
  h = hashlib.sha256()
  h.update(repr([(tuple(x.shape), str(x.dtype)) for x in leaves]).encode())
  h.update(repr(jax.tree.structure(tree)).encode())
  on_host = all(not isinstance(x, jax.Array) or
                all(d.platform == "cpu" for d in x.devices()) for x in leaves)
  if on_host:
    for x in leaves:
      a = np.asarray(x)
      if a.nbytes <= _HASH_ALL_BYTES:
        h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes())
      else:
        flat = a.reshape(-1)
        h.update(np.ascontiguousarray(flat[::max(1, flat.size // (1 << 20))]).tobytes())
        h.update(np.float64(flat.astype(np.float64).sum()).tobytes())
  else:
    h.update(_device_sums(leaves).tobytes())
  digest = h.hexdigest()[:32]
  try:
    _CHECKSUMS[ids] = ([weakref.ref(x) for x in leaves], digest)
    for x in leaves:                            # gone with any of its weights (never pruned)
      weakref.finalize(x, _CHECKSUMS.pop, ids, None)
  except TypeError:                             # leaves without weak references: no memo
    _CHECKSUMS.pop(ids, None)
  return digest


def fingerprint(target, drafter, batch: int, capacity: int, greedy: bool, ks,
                history: bool = False, processors: tuple = ()) -> tuple:
  """-> (hex digest, key dict): what a cost table depends on — device kind, jax version, XLA
  flags, target config + weights checksum, drafter static key + params checksum, B, capacity
  bucket, greedy, the candidate K set, the penalties' history and the logits processors (both
  change the round's program: a history row per verify position, a mask per processor) and
  the cost-model version."""
  dev = jax.devices()[0]
  key = {
      "version": COST_MODEL_VERSION,
      "platform": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
      "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", ""),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "target_config": repr(target.config), "target_weights": params_checksum(target.params),
      "drafter": repr(drafter._static_key()), "drafter_params": params_checksum(drafter.params),
      "batch": int(batch), "capacity": int(capacity), "greedy": bool(greedy),
      "ks": [int(k) for k in ks]}
  if history or processors:          # absent otherwise: the tables cached before stay valid
    key["history"] = bool(history)
    key["processors"] = [repr(p.shape_key() if hasattr(p, "shape_key") else p)
                         for p in processors]
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
  return digest, key


def _text_like_prompts(batch: int, length: int, vocab: int) -> np.ndarray:
  """[B, length] int32 tokens repeating a random 24-token phrase (n-grams match)."""
  base = np.random.default_rng(0).integers(3, max(vocab, 4), size=(batch, 24))
  reps = -(-length // 24)
  return np.tile(base, (1, reps))[:, :length].astype(np.int32)


CALIBRATION_TOKENS = 96          # new tokens of the longer timed decode (the shorter: half)
CALIBRATION_PROMPT = 32          # real prompt tokens per row of the timed decodes


def measure_round_costs(target, drafter, batch: int, capacity: int, greedy: bool, ks,
                        repeats: int = 3, *, strategy: Strategy, prompt_len: int = 16,
                        stop_count: int = 0, mesh=None, history: bool = False,
                        processors: tuple = (), bias_width: int = 0) -> dict:
  """Seconds per loop iteration at each candidate K, timed on the compiled decode that
  generate() runs with `strategy` (bound, e.g. Governed: num_draft="auto") for these shapes
  (the same executable: calibrating compiles nothing extra). K is forced through the cost
  vector (cost 1 for it, 1e30 for the others).
  Per K, one call of n new tokens (text-like prompts of up to CALIBRATION_PROMPT tokens in a
  buffer of prompt_len; stop tokens that
  never occur, so every row runs to its limit); the smallest K >= 1, k1, also runs n/2 tokens,
  and the difference of its two lengths gives the per-call part f (prefill, dispatch, the
  drafter's work on the prompt). Then t(K) = (min over repeats of the call's seconds - f) / its
  loop iterations. K = 0 runs with an acceptance prior, so it decodes plainly from its first
  round (no warm-up, the drafter's prompt work skipped) at both lengths: t(0) and its own
  per-call part f0. The entry cost (what drafting pays once per call) is the difference of
  a one-round call at k1 and one at K = 0 started plain, less t(k1) - t(0). All calls
  run round-robin (spec_jax.timing.interleaved_rounds), `repeats` times; a shared machine
  only ever adds time, so the fastest call is the least disturbed one. (Differencing two
  lengths for every K was tried: with few rounds at large K, a loaded machine's noise swamped
  the difference.)
  -> {K: {'per_iter_s', 'spread_pct', 'samples', 'per_call_s'}, 'entry_s': seconds}."""
  kmax = max(ks)
  # prompt_len is the static prompt buffer (generate() pads to the whole capacity); the rows'
  # real prompts are at most CALIBRATION_PROMPT tokens of it, leaving room to decode.
  buffer = max(1, min(int(prompt_len), capacity))
  p = max(1, min(buffer, capacity - kmax - 4, CALIBRATION_PROMPT))
  n_long = max(2, min(capacity - p - kmax - 1, CALIBRATION_TOKENS))
  n_short = max(1, n_long // 2)
  prompts = _text_like_prompts(batch, buffer, target.config.vocab_size)
  lens = np.full((batch,), p, np.int32)
  sampling = Sampling(temperature=0.0 if greedy else 1.0).as_arrays(batch)
  if bias_width:        # the call's logit_bias width, all zeros: its executable, unbiased
    sampling = sampling.replace(logit_bias=LogitBias(
        ids=np.zeros((batch, bias_width), np.int32),
        values=np.zeros((batch, bias_width), np.float32)))
  stop = np.full((stop_count,), -1, np.int32)           # token ids are >= 0: never stops
  key = jax.random.key(0)

  positive = [i for i, k in enumerate(ks) if k > 0]
  i1 = positive[0] if positive else 0                  # k1: the smallest K >= 1

  i0 = ks.index(0) if 0 in ks else None

  def run(i, n):
    costs = np.full((len(ks) + 1,), 1e30, np.float32)
    costs[i] = 1.0
    costs[-1] = 0.0                                       # no entry cost while measuring it
    # K = 0 with a prior: plain from the first round (no warm-up, no drafter prompt work)
    prior = strategy.acceptance_prior(None if i != i0 else [0.0])   # generate's executable
    compiled, args, kwargs = compiled_decode_call(
        target, drafter, prompts, lens, key, max_new_tokens=n, sampling=sampling, stop=stop,
        capacity=capacity, greedy=greedy, mesh=mesh, strategy=strategy, round_costs=costs,
        acceptance_prior=prior, history=history, processors=processors)
    t0 = time.perf_counter()
    packed = compiled(*args, **kwargs)
    jax.block_until_ready(packed)
    seconds = time.perf_counter() - t0
    res = compiled.unpack(global_batch.to_host(packed, sharding_lib.spans_processes(mesh)))
    return (seconds, int(res.iterations),
            int(np.asarray(res.k_rounds)[ks[i1]]) if i != i1 else 0)

  runs = {(i, n_long): (lambda i=i: run(i, n_long)) for i in range(len(ks))}
  for i in {i1, i0} - {None}:
    runs[(i, n_short)] = lambda i=i: run(i, n_short)
    runs[(i, 2)] = lambda i=i: run(i, 2)                 # the prefill and one round
  for r in runs.values():                                # compile (once) and warm
    r()
  results = interleaved_rounds(runs, repeats)

  def per_call(i):
    """The per-call part of K_i's calls: the intercept of its two lengths."""
    (ts, its, _), (tl, itl, _) = (min(results[(i, n)]) for n in (n_short, n_long))
    per = max(tl - ts, 0.0) / max(itl - its, 1)
    return min(max(ts - its * per, 0.0), ts)

  fixed = {i: per_call(i1) for i in positive}
  if i0 is not None:
    fixed[i0] = per_call(i0)
  out = {}
  for i, k in enumerate(ks):
    samples = [max(t - fixed[i], 1e-9) / it for t, it, _ in results[(i, n_long)]]
    out[k] = {"per_iter_s": min(samples), "spread_pct": summarize(samples)["spread_pct"],
              "samples": samples, "per_call_s": fixed[i]}
  # The entry cost: two calls of one round each, K = k1 against K = 0 started plain, less
  # their rounds' difference (the intercepts above differ by it too, but an intercept
  # extrapolated over ~50 rounds carries ~50 times the slope's noise: 1.3 s against 0.25 s
  # measured directly, in a 1-repeat table at B = 32).
  out["entry_s"] = 0.0
  if positive and i0 is not None:
    one = {i: min(results[(i, 2)])[0] for i in (i1, i0)}
    out["entry_s"] = max(one[i1] - one[i0] - (out[ks[i1]]["per_iter_s"] -
                                              out[0]["per_iter_s"]), 0.0)
  return out


def calibrate(target, drafter, batch: int, *, capacity: Optional[int] = None,
              greedy: bool = True, governor: Optional[Governor] = None, repeats: int = 3,
              cache: bool = True, refresh: bool = False, prompt_len: int = 16,
              stop_count: Optional[int] = None, mesh=None,
              strategy: Optional[Strategy] = None, history: bool = False,
              processors: tuple = (), bias_width: int = 0) -> CostTable:
  """The governor's cost table for (this device, target, drafter, batch, capacity bucket,
  greedy): seconds per round at each candidate K, timed once and cached as JSON under
  cache_dir() (written atomically; keyed by `fingerprint`); a second call reads it (or this
  process's memory) instead of measuring. refresh=True measures again.

  Args:
    target: a Model; drafter: a Drafter; batch: B.
    capacity: the KV-cache capacity S the generation runs with (generate() uses the prompt +
      max_new_tokens + K + 1 rounded up to 64; default 256).
    greedy: time the greedy round (temperature 0: argmax verify) or the sampling round.
    governor: its candidate K set (default Governor()).
    strategy: the bound strategy whose executable is timed, at its calibration_ks (generate
      passes it); default Governed(governor) at the governor's candidates.
    repeats: timed rounds per K (round-robin).
    prompt_len, stop_count, mesh: the padded prompt length, the number of stop tokens and the
      mesh of the generate() call to come, so that the timed executable is the one it runs
      (generate passes them; only the compile is shared, the table does not depend on them).
    history, processors: the penalties' token history and the logits processors of the
      generate() call (generate passes them): part of the timed program and of the key.
    bias_width: the width of the call's logit_bias rows (generate passes it): timed with zero
      biases of that width, the same executable (only the compile is shared).
  """
  t0 = time.perf_counter()
  if strategy is None:
    strategy = Governed(governor).bind(drafter, None)
    ks = strategy.candidates
  else:
    ks = strategy.calibration_ks
  drafter.check_compatible(target)
  if not is_int(batch) or batch < 1:
    raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
  capacity = DEFAULT_CAPACITY if capacity is None else capacity
  if not is_int(capacity) or capacity < max(ks) + 4:
    raise ValueError(f"capacity must be an integer >= max K + 4 = {max(ks) + 4}, got "
                     f"{capacity!r}")
  if not is_int(repeats) or repeats < 1:
    raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
  processors = tuple(processors)
  digest, key = fingerprint(target, drafter, batch, capacity, greedy, ks, history, processors)
  path = cache_dir() / f"{digest}.json"
  if not refresh:
    table = _TABLES.get(digest)
    if table is None and cache and path.is_file():
      try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
          table = CostTable(ks=tuple(data["ks"]), seconds=tuple(data["seconds"]),
                            spread_pct=tuple(data["spread_pct"]), key=key, fingerprint=digest,
                            path=str(path), entry_seconds=float(data["entry_seconds"]))
      except (OSError, ValueError, KeyError, TypeError):
        table = None                            # unreadable: measure again
    if table is not None:
      _TABLES[digest] = table
      return dataclasses.replace(table, from_cache=True,
                                 measure_seconds=time.perf_counter() - t0)
  if stop_count is None:
    stop_count = len(default_stop_ids(target))
  timed = measure_round_costs(target, drafter, batch, capacity, greedy, ks, repeats,
                              strategy=strategy, prompt_len=prompt_len,
                              stop_count=stop_count, mesh=mesh, history=history,
                              processors=processors, bias_width=bias_width)
  table = CostTable(ks=tuple(ks), seconds=tuple(timed[k]["per_iter_s"] for k in ks),
                    spread_pct=tuple(timed[k]["spread_pct"] for k in ks), key=key,
                    fingerprint=digest, path=str(path) if cache else None,
                    entry_seconds=float(timed.get("entry_s", 0.0)))
  table = dataclasses.replace(table, measure_seconds=time.perf_counter() - t0)
  if cache:
    atomic_write_json(path, dict(table.as_dict(), created=time.time()))
  _TABLES[digest] = table
  return table


def round_costs_for(strategy: Strategy, target, drafter, batch: int, capacity: int,
                    greedy: bool, max_new_tokens: int, prompt_len: int = 16, stop_count: int = 0,
                    mesh=None, history: bool = False, processors: tuple = (),
                    bias_width: int = 0):
  """What generate() passes to decode for a bound strategy: None unless it needs a measured
  table (Strategy.calibration_ks: the governor without its own costs or schedule); ones when
  the loop cannot run (max_new_tokens == 1: the prefill's token is the only one); else
  calibrate(...).round_costs (measured once on the executable generate runs, then cached)."""
  ks = strategy.calibration_ks
  if ks is None:
    return None
  if max_new_tokens <= 1:
    return np.append(np.ones((len(ks),), np.float32), np.float32(0.0))
  return calibrate(target, drafter, batch, capacity=capacity, greedy=greedy, strategy=strategy,
                   prompt_len=prompt_len, stop_count=stop_count, mesh=mesh, history=history,
                   processors=processors, bias_width=bias_width).costs_for(ks)


def clear_memory() -> None:
  """Drops this process's cost tables, checksums and compiled timing loops (not the disk
  cache)."""
  _TABLES.clear()
  _CHECKSUMS.clear()
