"""python -m kernels_pallas.bench: verify-attention kernel vs the jitted XLA reference.

For each (S, B, T) at Hq/Hkv=32/8, D=128, bfloat16: the median time of the Pallas kernel (through
kernels_pallas.verify_attention, so folding and the split combine are included) and of the
jitted reference, and the achieved bandwidth: the KV bytes the call needs (sum over rows of
kv_lengths * Hkv * D * 2 (k and v) * itemsize) over the time, against the device's copy
bandwidth (a jitted elementwise pass over a large array: read + write bytes / time).

On CPU it runs a small smoke size with the kernel under the Pallas interpreter: those kernel
timings say nothing about the kernel's speed, only that it runs.

  python -m kernels_pallas.bench [--smoke] [--sizes 1k,4k] [--batch 1,8] [--num-new 1,5]
                                 [--ragged] [--repeats 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import dispatch
from kernels_pallas.reference import verify_attention_reference

FULL = dict(sizes=(1024, 4096, 16384, 32768), batch=(1, 8, 32), num_new=(1, 5, 9))
SMOKE = dict(sizes=(256, 1024), batch=(1, 4), num_new=(1, 5))
HQ, HKV, D = 32, 8, 128
INTERPRET_NOTE = ("kernel runs under the Pallas interpreter on this backend: its timings are "
                  "meaningless (correctness smoke only)")


def parse_ints(text: str) -> tuple[int, ...]:
  """'1k,4096,32K' -> (1024, 4096, 32768)."""
  out = []
  for part in text.split(","):
    part = part.strip().lower()
    if not part:
      continue
    scale = 1024 if part.endswith("k") else 1
    out.append(int(part.rstrip("k")) * scale)
  if not out:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
  return tuple(out)


def time_call(fn, args, repeats: int, min_sample_s: float = 2e-3) -> float:
  """Median seconds per call. Each sample runs enough back-to-back calls to last min_sample_s,
  so dispatch overhead does not dominate microsecond kernels."""
  jax.block_until_ready(fn(*args))                      # compile + warm up
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  single = time.perf_counter() - start
  inner = max(1, min(1000, int(min_sample_s / max(single, 1e-9))))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / inner)
  return statistics.median(samples)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
  """Bytes/s of a jitted elementwise pass over a nbytes float32 array (reads + writes)."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda x: x + 1.0)
  seconds = time_call(f, (x,), repeats)
  return 2 * x.size * x.dtype.itemsize / seconds


def make_case(key, s, b, t, ragged: bool, dtype=jnp.bfloat16):
  kq, kk, kv, kl = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, t, HQ, D), dtype)
  k = jax.random.normal(kk, (b, s, HKV, D), dtype)
  v = jax.random.normal(kv, (b, s, HKV, D), dtype)
  if ragged:
    lengths = jax.random.randint(kl, (b,), t, s + 1, jnp.int32)
  else:
    lengths = jnp.full((b,), s, jnp.int32)
  return q, k, v, lengths


def write_json_atomic(path: str, payload) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".bench-", suffix=".json")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(payload, f, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def format_table(rows) -> str:
  head = (f"{'S':>6} {'B':>3} {'T':>2} {'KV MB':>8} {'kernel ms':>10} {'ref ms':>9} "
          f"{'speedup':>7} {'kern GB/s':>9} {'ref GB/s':>8} {'kern/copy':>9} {'max|err|':>9}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(
        f"{r['S']:>6} {r['B']:>3} {r['T']:>2} {r['kv_bytes'] / 1e6:>8.1f} "
        f"{r['kernel_ms']:>10.3f} {r['reference_ms']:>9.3f} {r['speedup']:>7.2f} "
        f"{r['kernel_gbps']:>9.1f} {r['reference_gbps']:>8.1f} "
        f"{r['kernel_fraction_of_copy']:>9.2f} {r['max_abs_err']:>9.2e}")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m kernels_pallas.bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true",
                 help="small sizes (automatic on CPU): S 256,1024; B 1,4; T 1,5")
  p.add_argument("--sizes", type=parse_ints, help="cache sizes S, e.g. 1k,4k,16k,32k")
  p.add_argument("--batch", type=parse_ints, help="batch sizes B, e.g. 1,8,32")
  p.add_argument("--num-new", type=parse_ints, help="new tokens per row T (= K+1), e.g. 1,5,9")
  p.add_argument("--ragged", action="store_true",
                 help="kv_lengths uniform in [T, S] per row (default: all rows full, = S)")
  p.add_argument("--repeats", type=int, default=None, help="timed samples per call (median)")
  p.add_argument("--kernel", choices=dispatch.KERNELS, default=None,
                 help="Pallas flavour (default: the backend's own; gpu on CPU)")
  p.add_argument("--block-k", type=int, default=None, help="override the kernel's block_k")
  p.add_argument("--num-splits", type=int, default=None, help="GPU kernel: cache splits")
  p.add_argument("--time-budget", type=float, default=None,
                 help="stop starting new sizes after this many seconds (results so far kept)")
  p.add_argument("--out", default=None, help="write the results as JSON here (atomically)")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  backend = jax.default_backend()
  smoke = args.smoke or backend == "cpu"
  grid = dict(SMOKE if smoke else FULL)
  for name in ("sizes", "batch", "num_new"):
    if getattr(args, name) is not None:
      grid[name] = getattr(args, name)
  repeats = args.repeats or (3 if smoke else 20)
  kernel, interpret = dispatch.resolve("pallas", args.kernel)
  kernel_kwargs = {}
  if args.block_k is not None:
    kernel_kwargs["block_k"] = args.block_k
  if args.num_splits is not None:
    if kernel != "gpu":
      p.error("--num-splits applies to the gpu kernel only")
    kernel_kwargs["num_splits"] = args.num_splits

  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({backend}), jax {jax.__version__}, kernel: {kernel}"
        f"{' (interpret)' if interpret else ''}, Hq/Hkv={HQ}/{HKV}, D={D}, bfloat16, "
        f"kv_lengths={'ragged' if args.ragged else 'full'}", flush=True)
  if interpret:
    print(f"NOTE: {INTERPRET_NOTE}", flush=True)
  copy_bytes = (64 << 20) if backend == "cpu" else (1 << 30)
  copy_bw = copy_bandwidth(copy_bytes, repeats=max(repeats, 5))
  print(f"copy bandwidth: {copy_bw / 1e9:.1f} GB/s", flush=True)

  kernel_fn = jax.jit(lambda q, k, v, n: dispatch.verify_attention(
      q, k, v, n, impl="pallas", kernel=kernel, **kernel_kwargs))
  reference_fn = jax.jit(verify_attention_reference)
  payload = dict(device=device.device_kind, backend=backend, jax_version=jax.__version__,
                 kernel=kernel, interpret=interpret, note=INTERPRET_NOTE if interpret else None,
                 heads=HQ, kv_heads=HKV, head_dim=D, dtype="bfloat16", ragged=args.ragged,
                 repeats=repeats, kernel_kwargs=kernel_kwargs,
                 copy_bandwidth_gbps=copy_bw / 1e9, results=[], complete=False)
  start = time.perf_counter()
  key = jax.random.key(args.seed)
  stopped_early = False
  for s in grid["sizes"]:
    for b in grid["batch"]:
      if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
        stopped_early = True
        break
      for t in grid["num_new"]:
        key, sub = jax.random.split(key)
        q, k, v, lengths = make_case(sub, s, b, t, args.ragged)
        kv_bytes = int(np.sum(np.asarray(lengths))) * HKV * D * 2 * k.dtype.itemsize
        out = kernel_fn(q, k, v, lengths)
        ref = reference_fn(q, k, v, lengths)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        t_kernel = time_call(kernel_fn, (q, k, v, lengths), repeats)
        t_ref = time_call(reference_fn, (q, k, v, lengths), repeats)
        row = dict(S=s, B=b, T=t, kv_bytes=kv_bytes, kernel_ms=t_kernel * 1e3,
                   reference_ms=t_ref * 1e3, speedup=t_ref / t_kernel,
                   kernel_gbps=kv_bytes / t_kernel / 1e9, reference_gbps=kv_bytes / t_ref / 1e9,
                   kernel_fraction_of_copy=kv_bytes / t_kernel / copy_bw,
                   reference_fraction_of_copy=kv_bytes / t_ref / copy_bw, max_abs_err=err)
        payload["results"].append(row)
        print(format_table([row]).splitlines()[-1] if len(payload["results"]) > 1
              else format_table([row]), flush=True)
        if args.out:
          write_json_atomic(args.out, payload)
        del q, k, v, out, ref
    if stopped_early:
      break
  payload["complete"] = not stopped_early
  payload["seconds"] = time.perf_counter() - start
  print()
  print(format_table(payload["results"]))
  if stopped_early:
    print(f"(stopped after --time-budget {args.time_budget:g}s)")
  if interpret:
    print(f"NOTE: {INTERPRET_NOTE}")
  if args.out:
    write_json_atomic(args.out, payload)
    print(f"wrote {args.out}")
  bad = [r for r in payload["results"] if not math.isfinite(r["max_abs_err"])
         or r["max_abs_err"] > 5e-2]
  if bad:
    print(f"ERROR: {len(bad)} sizes where the kernel and the reference disagree (> 5e-2)")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
