"""How spec_jax times things: calibrated loops, differencing, interleaved (round-robin) repeats.

A timer is a `call(n)` that runs n inner iterations (a jitted fori_loop) and blocks. Per
iteration, time_interleaved takes (t(2n) - t(n)) / n, which cancels what a call pays once
(dispatch, work XLA hoists out of the loop), as the engine's long while_loop amortises it; all
timers of one measurement run round-robin, so a slow phase of a shared machine hits all of them
alike, and ratios are taken per round (ratio_of). Whole generate() calls are interleaved the
same way by the suites and the eval harness (interleaved_rounds).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Hashable, Sequence


def summarize(values: Sequence[float]) -> dict:
  """-> {'median', 'min', 'max', 'n', 'spread_pct' = 100 (max - min) / median}."""
  vals = [float(v) for v in values]
  med = statistics.median(vals)
  return {"median": med, "min": min(vals), "max": max(vals), "n": len(vals),
          "spread_pct": 100.0 * (max(vals) - min(vals)) / med if med else 0.0}


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> dict:
  """-> {'p50': ..., 'p90': ..., 'p99': ...}: linear interpolation between order statistics
  (numpy's default), so p50 of [1, 2, 3, 4] is 2.5 and p99 of 2 values lies near the larger."""
  vals = sorted(float(v) for v in values)
  if not vals:
    raise ValueError("percentiles of an empty list")
  out = {}
  for q in qs:
    pos = (len(vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    out[f"p{q:g}"] = vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
  return out


def calibrate(call, min_loop_s: float = 0.03, max_inner: int = 512) -> int:
  """Compiles and warms call, then picks n so that the loop part of call(n) is long against
  both timer noise (n * per_iteration >= min_loop_s) and the per-call part (>= 2x what a call
  pays once, e.g. the engine-like unstacking of the weights): per_iteration and the per-call
  part are estimated from the fastest of 3 calls at n=1 and 2 at n=4. Warms call(2n)."""
  def fastest(n, reps):
    best = float("inf")
    for _ in range(reps):
      t0 = time.perf_counter()
      call(n)
      best = min(best, time.perf_counter() - t0)
    return best
  call(1)                                   # compile + warm
  t1 = fastest(1, 3)
  t4 = fastest(4, 2)
  per_iter = max((t4 - t1) / 3, t1 / 50, 1e-7)
  fixed = max(t1 - per_iter, 0.0)
  n = int(min(max_inner, max(1, math.ceil(max(min_loop_s, 2 * fixed) / per_iter))))
  call(2 * n)
  return n


def _timer_result(samples: list, n_inner: int, repeats: int, method: str) -> dict:
  s = summarize(samples)
  return {"samples": samples, "per_iter_s": s["median"], "min_s": s["min"], "max_s": s["max"],
          "spread_pct": s["spread_pct"], "n_inner": n_inner, "repeats": repeats,
          "method": method}


def time_interleaved(calls: dict, repeats: int) -> dict:
  """Per-iteration times of several timers measured round-robin (see the module docstring).

  calls: name -> call(n). -> name -> {'samples': [seconds per iteration, one per round],
  'per_iter_s' (median), 'min_s', 'max_s', 'spread_pct', 'n_inner', 'repeats', 'method'}.
  """
  ns = {name: calibrate(c) for name, c in calls.items()}
  samples = {name: [] for name in calls}
  for _ in range(repeats):
    for name, c in calls.items():
      n = ns[name]
      t0 = time.perf_counter()
      c(n)
      t_n = time.perf_counter() - t0
      t0 = time.perf_counter()
      c(2 * n)
      t_2n = time.perf_counter() - t0
      samples[name].append(max(t_2n - t_n, 1e-9) / n)
  return {name: _timer_result(vals, ns[name], repeats, "(t(2n) - t(n)) / n, round-robin")
          for name, vals in samples.items()}


def time_single_calls(calls: dict, repeats: int, warm: bool = True) -> dict:
  """Timers called once per round (n = 1, per-call overheads included), round-robin.
  -> name -> the same dict as time_interleaved, method 'single call'."""
  if warm:
    for c in calls.values():
      c(1)
  samples = {name: [] for name in calls}
  for _ in range(repeats):
    for name, c in calls.items():
      t0 = time.perf_counter()
      c(1)
      samples[name].append(time.perf_counter() - t0)
  return {name: _timer_result(vals, 1, repeats, "single call") for name, vals in samples.items()}


def ratio_of(a: dict, b: dict, scale: float = 1.0) -> float:
  """Median over rounds of a/b (both from one time_interleaved call), divided by scale."""
  return statistics.median(x / y for x, y in zip(a["samples"], b["samples"])) / scale


def time_calls(call, repeats: int, single_call: bool = False) -> dict:
  """One timer: time_interleaved({call}), or, with single_call, `repeats` single calls."""
  if single_call:
    return time_single_calls({"t": call}, repeats)["t"]
  return time_interleaved({"t": call}, repeats)["t"]


def interleaved_rounds(runs: dict, repeats: int, baseline: Hashable = None,
                       on_round: Callable = None) -> dict:
  """Runs every entry of `runs` (name -> a no-argument function returning a result) once per
  round, `repeats` rounds, round-robin; the `baseline` entry (if given) runs at the start AND at
  the end of every round, so it brackets the others against drifts of a shared machine.
  on_round(round_index, results) is called after every round.
  -> name -> [results in order of measurement]."""
  names = list(runs)
  order = names
  if baseline is not None:
    if baseline not in runs:
      raise ValueError(f"baseline {baseline!r} is not one of the runs {names}")
    order = [baseline] + [n for n in names if n != baseline] + [baseline]
  results = {n: [] for n in names}
  for rep in range(repeats):
    for n in order:
      results[n].append(runs[n]())
    if on_round is not None:
      on_round(rep, results)
  return results


def memory_bandwidth(n_bytes: int = 512 << 20, repeats: int = 7) -> dict:
  """The machine's measured memory bandwidth in bytes/s, the denominator of a decode roofline.

  read: a jitted sum over an n_bytes float32 array (reads every byte once, writes nothing: what
  streaming the weights does); copy: an in-place update of it (donated, so no fresh pages are
  touched), counted as 2 n_bytes moved (read + write). Medians of `repeats` calls after a
  warm-up; the array is far larger than any cache.
  """
  import jax
  import jax.numpy as jnp
  x = jnp.arange(n_bytes // 4, dtype=jnp.float32)
  read = jax.jit(jnp.sum)
  update = jax.jit(lambda a: a + 1.0, donate_argnums=0)
  out = {}
  jax.block_until_ready(read(x))
  secs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(read(x))
    secs.append(time.perf_counter() - t0)
  out["read_bytes_per_s"] = n_bytes / statistics.median(secs)
  x = jax.block_until_ready(update(x))
  secs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    x = jax.block_until_ready(update(x))
    secs.append(time.perf_counter() - t0)
  out["copy_bytes_per_s"] = 2 * n_bytes / statistics.median(secs)
  out["n_bytes"] = n_bytes
  return out


def decode_roofline(config, batch: int, fill: int, bandwidth: float) -> float:
  """Tokens/s of plain decoding if a step took only the time to read its bytes: every weight
  once (the step's batch shares them) plus each row's KV cache up to `fill` positions, at
  `bandwidth` bytes/s. Everything else (compute, overheads) is assumed free: an upper bound."""
  import numpy as np
  itemsize = np.dtype(config.dtype).itemsize
  weight_bytes = config.num_params * itemsize
  kv_bytes = 2 * config.num_layers * batch * fill * config.num_kv_heads * config.head_dim * itemsize
  return batch * bandwidth / (weight_bytes + kv_bytes)
