"""Pallas verify-attention kernels against the jnp reference and a naive per-row softmax.

By default both kernels run under the Pallas interpreter on CPU. SPEC_JAX_KERNEL_TEST_BACKEND
chooses what runs instead:
  interpret (default)  both kernels, interpret=True, any backend
  gpu                  the GPU kernel natively (interpret=False) on a CUDA device
  tpu                  the TPU kernel natively on a TPU

Without pytest (e.g. on a bare device machine) `python tests/test_kernels.py` runs the same
comparisons and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

try:
  import pytest
except ImportError:  # the script mode below needs no pytest
  pytest = None

from kernels_pallas import pallas_gpu, pallas_tpu
from kernels_pallas.reference import verify_attention_reference
from tests.numerics import assert_f32_close

MODE = os.environ.get("SPEC_JAX_KERNEL_TEST_BACKEND", "interpret")
if MODE not in ("interpret", "gpu", "tpu"):
  raise ValueError(f"SPEC_JAX_KERNEL_TEST_BACKEND must be interpret, gpu or tpu, got {MODE!r}")
KERNELS = ("gpu", "tpu") if MODE == "interpret" else (MODE,)
INTERPRET = MODE == "interpret"
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


# ---------------------------------------------------------------------------- the naive oracle

def naive_attention(q, k, v, lengths, tree_mask):
  """Per (row, query, head) loop in float64 numpy, straight from the DESIGN.md contract.
  tree_mask: None (causal), bool [B, T, T], or [B, T, W] (W > T) over the last W entries."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  w_mask = t if tree_mask is None else tree_mask.shape[-1]
  out = np.zeros_like(q)
  for bi in range(b):
    length = int(lengths[bi])
    first_new = length - w_mask
    for ti in range(t):
      keys = list(range(first_new))
      for j in range(w_mask):
        allowed = tree_mask[bi, ti, j] if tree_mask is not None else j <= ti
        if allowed:
          keys.append(first_new + j)
      keys = np.array(keys)
      for h in range(hq):
        kh = h // group
        scores = k[bi, keys, kh] @ q[bi, ti, h] / np.sqrt(d)
        w = np.exp(scores - scores.max())
        out[bi, ti, h] = (w / w.sum()) @ v[bi, keys, kh]
  return out


def random_tree_mask(rng, batch, t):
  """bool [B,T,T]: node 0 is the root; node i > 0 has a random parent among 0..i-1; a node
  sees itself and its ancestors."""
  mask = np.zeros((batch, t, t), bool)
  for bi in range(batch):
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    for i in range(t):
      node = i
      while node >= 0:
        mask[bi, i, node] = True
        node = parent[node]
  return mask


# ---------------------------------------------------------------------------- cases

# (B, T, Hq, Hkv, D, S, block_k, dtype, tree, extra GPU kwargs). Hand-picked to cover every pair
# of (B, T, Hq/Hkv, D, dtype, tree-or-causal, S a multiple of block_k or not) at least once,
# instead of the full product: interpret mode compiles each shape anew.
CASES = [
    (1, 1, 8, 8, 64, 64, 32, "float32", False, {}),
    (3, 1, 8, 4, 128, 100, 32, "bfloat16", True, {"num_splits": 3}),
    (3, 1, 8, 1, 64, 72, 64, "float32", True, {}),
    (1, 2, 8, 8, 128, 96, 32, "bfloat16", True, {"num_splits": 2}),
    (3, 2, 8, 4, 64, 128, 64, "float32", False, {}),
    (1, 2, 8, 1, 128, 40, 32, "float32", False, {}),
    (3, 5, 8, 8, 128, 70, 32, "float32", True, {"num_splits": 2}),
    (1, 5, 8, 4, 64, 96, 32, "bfloat16", False, {"num_splits": 4}),
    (3, 5, 8, 1, 128, 130, 64, "bfloat16", True, {"block_rows": 16}),
    (3, 9, 8, 4, 128, 64, 32, "float32", True, {}),
    (1, 9, 8, 8, 64, 200, 64, "float32", True, {"num_splits": 3}),
    (3, 9, 8, 1, 64, 160, 32, "bfloat16", False, {"block_rows": 16, "num_splits": 2}),
    (2, 5, 8, 2, 512, 80, 32, "bfloat16", True, {}),        # Gemma 4 global layers' head_dim
    # Two mask words per row (T > 32: a DDTree of up to 63 nodes and its root).
    (2, 40, 4, 4, 64, 96, 32, "float32", True, {}),
    (1, 64, 8, 4, 64, 80, 32, "bfloat16", True, {"num_splits": 2}),
    (2, 33, 8, 8, 64, 72, 64, "float32", False, {}),
]
CASE_IDS = [f"B{c[0]}-T{c[1]}-{c[2]}/{c[3]}-D{c[4]}-S{c[5]}-bk{c[6]}-{c[7]}"
            f"-{'tree' if c[8] else 'causal'}" for c in CASES]

# Longer caches (many blocks per split, ragged lengths deep inside the cache).
SLOW_CASES = [
    (3, 9, 8, 4, 128, 1000, 64, "bfloat16", True, {"num_splits": 4}),
    (1, 5, 8, 8, 64, 777, 128, "float32", False, {}),
]


def lengths_for(rng, b, t, s):
  """Ragged kv_lengths: the first row has no prefix (== T), the last a full cache (== S)."""
  if b == 1:
    return np.array([int(rng.choice([t, s, int(rng.integers(t, s + 1))]))], np.int32)
  middle = rng.integers(t, s + 1, size=b - 2)
  return np.array([t, *middle, s], np.int32)


def make_inputs(case, seed=0):
  b, t, hq, hkv, d, s, _, dtype, tree, _ = case
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
  k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  lengths = lengths_for(rng, b, t, s)
  mask = random_tree_mask(rng, b, t) if tree else None
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), jnp.asarray(lengths), (None if mask is None
                                                          else jnp.asarray(mask))


def run_kernel(kernel, case, q, k, v, lengths, mask):
  block_k, extra = case[6], case[9]
  if kernel == "gpu":
    return pallas_gpu.verify_attention_pallas_gpu(q, k, v, lengths, mask, block_k=block_k,
                                                  interpret=INTERPRET, **extra)
  return pallas_tpu.verify_attention_pallas_tpu(q, k, v, lengths, mask, block_k=block_k,
                                                interpret=INTERPRET)


_reference = jax.jit(verify_attention_reference)


def check_case(kernel, case, seed=0):
  """Kernel vs reference and vs the naive loop; raises AssertionError on a mismatch."""
  q, k, v, lengths, mask = make_inputs(case, seed)
  out = run_kernel(kernel, case, q, k, v, lengths, mask)
  assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
  out = np.asarray(out.astype(jnp.float32))
  tol = TOLERANCE[case[7]]
  with jax.default_matmul_precision("highest"):   # no TF32 / bf16 passes in the oracle
    ref = np.asarray(_reference(q, k, v, lengths, mask).astype(jnp.float32))
  np.testing.assert_allclose(out, ref, atol=tol, rtol=tol, err_msg=f"{kernel} vs reference")
  naive = naive_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                          v.astype(jnp.float32), np.asarray(lengths),
                          None if mask is None else np.asarray(mask))
  np.testing.assert_allclose(out, naive, atol=tol, rtol=tol, err_msg=f"{kernel} vs naive")


# ---------------------------------------------------------------------------- pytest

if pytest is not None:

  @pytest.fixture(autouse=True)
  def _fast_cpu_compiles():
    """Interpret mode is compile-bound: XLA at -O0 compiles these kernels ~40% faster."""
    if not INTERPRET:
      yield
      return
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
      yield
    finally:
      jax.config.update("jax_disable_most_optimizations", old)

  @pytest.mark.parametrize("kernel", KERNELS)
  @pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
  def test_kernel_matches_reference_and_naive(kernel, case):
    check_case(kernel, case)

  @pytest.mark.slow
  @pytest.mark.parametrize("kernel", KERNELS)
  @pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: f"S{c[5]}-T{c[1]}-{c[7]}")
  def test_kernel_long_cache(kernel, case):
    check_case(kernel, case, seed=1)

  @pytest.mark.parametrize("kernel", KERNELS)
  def test_kernel_under_jit_with_traced_lengths(kernel):
    case = CASES[6]
    q, k, v, lengths, mask = make_inputs(case, seed=2)
    f = jax.jit(lambda lengths, mask: run_kernel(kernel, case, q, k, v, lengths, mask))
    shorter = jnp.maximum(lengths - 7, case[1])
    for n in (lengths, shorter):
      with jax.default_matmul_precision("highest"):
        ref = verify_attention_reference(q, k, v, n, mask)
      assert_f32_close(f(n, mask), ref)

  def test_random_tree_masks_are_valid_trees():
    rng = np.random.default_rng(0)
    for t in (1, 2, 5, 9):
      mask = random_tree_mask(rng, 4, t)
      idx = np.arange(t)
      assert mask[:, idx, idx].all()                  # every node sees itself
      assert not np.triu(mask, k=1).any()             # and only earlier nodes
      assert mask[:, :, 0].all()                      # the root is everyone's ancestor

  def test_reference_wide_tree_mask_matches_naive():
    """A [B, T, W] mask (W > T: a draft tree whose first W-T nodes are already in the cache)
    matches the naive loop, and differs from treating the W-T cached nodes as prefix."""
    rng = np.random.default_rng(3)
    b, t, w, hq, hkv, d, s = 3, 3, 7, 4, 2, 16, 20
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    lengths = np.array([w, 12, s], np.int32)
    mask = random_tree_mask(rng, b, w)[:, w - t:]         # the tree's last T nodes query
    with jax.default_matmul_precision("highest"):
      ref = np.asarray(verify_attention_reference(q, k, v, jnp.asarray(lengths),
                                                  jnp.asarray(mask)))
      square = np.asarray(verify_attention_reference(q, k, v, jnp.asarray(lengths),
                                                     jnp.asarray(mask[:, :, w - t:])))
    assert_f32_close(ref, naive_attention(q, k, v, lengths, mask))
    assert not np.allclose(ref, square, atol=1e-3)      # the hidden cached nodes matter

  def test_naive_matches_reference_on_causal():
    case = (2, 3, 4, 2, 16, 20, 16, "float32", False, {})
    q, k, v, lengths, _ = make_inputs(case)
    with jax.default_matmul_precision("highest"):
      ref = verify_attention_reference(q, k, v, lengths)
    assert_f32_close(ref, naive_attention(q, k, v, np.asarray(lengths), None))

  @pytest.mark.parametrize("t", [1, 4])
  def test_head_major_reference_matches_naive_and_seq_major(t):
    """The reference over a head-major cache [B, Hkv, S, D] (spec_jax's cache on the jnp path)
    equals the naive loop for causal, tree and wide tree masks, and the [B, S, Hkv, D]
    reference under a sliding window."""
    rng = np.random.default_rng(11 + t)
    b, hq, hkv, d, s, w = 3, 6, 2, 16, 24, 7
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    k_hm, v_hm = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    lengths = np.array([w, 13, s], np.int32)
    masks = [None, random_tree_mask(rng, b, t), random_tree_mask(rng, b, w)[:, w - t:]]
    with jax.default_matmul_precision("highest"):
      for mask in masks:
        got = verify_attention_reference(q, k_hm, v_hm, jnp.asarray(lengths),
                                         None if mask is None else jnp.asarray(mask),
                                         head_major=True)
        assert_f32_close(got, naive_attention(q, k, v, lengths, mask))
      got = verify_attention_reference(q, k_hm, v_hm, jnp.asarray(lengths), sliding_window=5,
                                       head_major=True)
      want = verify_attention_reference(q, k, v, jnp.asarray(lengths), sliding_window=5)
      full = verify_attention_reference(q, k, v, jnp.asarray(lengths))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    assert not np.allclose(np.asarray(got), np.asarray(full), atol=1e-3)   # the window bites


# ---------------------------------------------------------------------------- script mode

def main(argv=None) -> int:
  """Runs every case (slow ones with --slow) without pytest; prints one line per case."""
  argv = sys.argv[1:] if argv is None else argv
  cases = CASES + (SLOW_CASES if "--slow" in argv else [])
  print(f"mode={MODE} backend={jax.default_backend()} kernels={KERNELS}", flush=True)
  failures = 0
  for kernel, case in itertools.product(KERNELS, cases):
    start = time.perf_counter()
    try:
      check_case(kernel, case)
      status = "ok"
    except Exception as e:  # report every case, fail at the end
      failures += 1
      status = f"FAIL {type(e).__name__}: {str(e)[:400]}"
    print(f"{kernel} {case[:9]} {case[9]} {time.perf_counter() - start:.2f}s {status}",
          flush=True)
  print(f"{failures} failures")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
