"""What bounds c_verify on this CPU: XLA:CPU's dot for T = 1..9 rows against a weights-once C
kernel (scripts/small_gemm.c) on the widened stories260K's 48 projection matrices (fp32,
[out, in], 302 MB: more than the caches, so each pass streams them from memory).

    python scripts/small_gemm_bound.py [--rows 1,2,3,5,9] [--repeats 7]

A measurement, not part of the library (which stays pure JAX): needs gcc with OpenMP and an
AVX2 + FMA CPU; the kernel is compiled into a temporary folder. Per T, the two alternate;
medians over repeats; "x T=1" is each one's time over the same implementation's T = 1.
"""

import argparse
import ctypes
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

import numpy as np

# Projections of one widened layer (hidden 768, F 2048, 12 x 64 heads, 6 kv heads), [out, in]:
# fused q/k/v, o, fused gate/up, down; twelve layers.
LAYER = [(1536, 768), (768, 768), (4096, 768), (768, 2048)]


def build(folder: pathlib.Path):
  # OpenMP's threads must not spin after the kernel returns: XLA's run next on the same cores.
  os.environ.setdefault("OMP_WAIT_POLICY", "passive")
  src = pathlib.Path(__file__).with_name("small_gemm.c")
  lib = folder / "small_gemm.so"
  subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src),
                  "-o", str(lib)], check=True)
  dll = ctypes.CDLL(str(lib))
  fp = ctypes.POINTER(ctypes.c_float)
  dll.small_gemm.argtypes = [fp, fp, fp, ctypes.c_long, ctypes.c_long, ctypes.c_long]
  return lambda x, w, y: dll.small_gemm(x.ctypes.data_as(fp), w.ctypes.data_as(fp),
                                        y.ctypes.data_as(fp), x.shape[0], *w.shape)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", default="1,2,3,5,9")
  ap.add_argument("--repeats", type=int, default=7)
  args = ap.parse_args()
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(0)
  weights = [rng.standard_normal(s, dtype=np.float32) * 0.02 for s in LAYER * 12]
  gigabytes = sum(w.nbytes for w in weights) / 1e9
  device_weights = [jnp.asarray(w) for w in weights]

  @jax.jit
  def xla_pass(ws, x768, x2048):
    return [jax.lax.dot_general(x768 if w.shape[1] == 768 else x2048, w,
                                (((1,), (1,)), ((), ()))) for w in ws]

  with tempfile.TemporaryDirectory() as tmp:
    small_gemm = build(pathlib.Path(tmp))
    base = {}
    print(f"{len(weights)} matrices, {gigabytes * 1e3:.0f} MB fp32; medians of {args.repeats}")
    for t in (int(r) for r in args.rows.split(",")):
      xs = {d: rng.standard_normal((t, d), dtype=np.float32) for d in (768, 2048)}
      ys = [np.empty((t, w.shape[0]), np.float32) for w in weights]
      for w, y in zip(weights[:4], ys):                 # the kernel against numpy
        small_gemm(xs[w.shape[1]], w, y)
        np.testing.assert_allclose(y, xs[w.shape[1]] @ w.T, rtol=1e-4, atol=1e-4)
      jx = (jnp.asarray(xs[768]), jnp.asarray(xs[2048]))
      jax.block_until_ready(xla_pass(device_weights, *jx))
      times = {"C": [], "XLA": []}
      for _ in range(args.repeats):
        start = time.perf_counter()
        for w, y in zip(weights, ys):
          small_gemm(xs[w.shape[1]], w, y)
        middle = time.perf_counter()
        jax.block_until_ready(xla_pass(device_weights, *jx))
        times["C"].append(middle - start)
        times["XLA"].append(time.perf_counter() - middle)
      med = {k: statistics.median(v) for k, v in times.items()}
      if t == 1:
        base = dict(med)
      cells = [f"{k} {med[k] * 1e3:5.1f} ms ({gigabytes / med[k]:4.1f} GB/s"
               + (f", {med[k] / base[k]:.2f}x T=1)" if base else ")") for k in ("XLA", "C")]
      print(f"T={t}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
  main()
