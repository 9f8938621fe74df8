"""The kernels lower for the real hardware: Triton IR for cuda, Mosaic for tpu.

Cross-platform lowering runs on a CPU-only machine: it exercises the Triton / Mosaic lowering
rules and their block-shape checks (what interpret mode skips), not the final device compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import pallas_gpu, pallas_tpu

# (B, T, Hq, Hkv, D, S, q dtype, cache dtype, tree mask)
SHAPES = [
    (8, 9, 32, 8, 128, 4096, jnp.bfloat16, jnp.bfloat16, True),     # the bench shape
    (1, 5, 32, 8, 128, 16384, jnp.bfloat16, jnp.bfloat16, False),   # batch 1, long cache
    (3, 2, 8, 4, 64, 100, jnp.float32, jnp.float32, True),          # D=64, ragged S
    (2, 9, 8, 1, 128, 1000, jnp.float32, jnp.bfloat16, False),       # MQA, mixed dtypes
    (2, 64, 8, 8, 128, 2048, jnp.bfloat16, jnp.bfloat16, True),     # a 63-node tree: 2 mask words
]


def _args(b, t, hq, hkv, d, s, q_dtype, kv_dtype, tree):
  sds = jax.ShapeDtypeStruct
  return (sds((b, t, hq, d), q_dtype), sds((b, s, hkv, d), kv_dtype),
          sds((b, s, hkv, d), kv_dtype), sds((b,), jnp.int32),
          sds((b, t, t), jnp.bool_) if tree else None)


def _lower(fn, args, platform):
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-T{s[1]}-D{s[4]}-S{s[5]}")
def test_gpu_kernel_lowers_to_triton(shape):
  text = _lower(lambda *a: pallas_gpu.verify_attention_pallas_gpu(*a), _args(*shape), "cuda")
  assert "xla.gpu.triton" in text


def test_gpu_kernel_lowers_for_head_dim_512():
  """Gemma 4's global layers (head_dim 512, 4 kv heads): small tiles, still Triton."""
  args = _args(2, 7, 32, 4, 512, 2048, jnp.bfloat16, jnp.bfloat16, True)
  assert pallas_gpu.unsupported_reason(args[0].shape, args[1].shape, jnp.bfloat16,
                                       jnp.bfloat16) is None
  text = _lower(lambda *a: pallas_gpu.verify_attention_pallas_gpu(*a), args, "cuda")
  assert "xla.gpu.triton" in text and "num_warps = 8" in text


def test_gpu_kernel_lowers_with_row_blocks_and_splits():
  args = _args(1, 9, 32, 2, 128, 3000, jnp.bfloat16, jnp.bfloat16, True)   # 144 rows
  text = _lower(lambda *a: pallas_gpu.verify_attention_pallas_gpu(
      *a, block_rows=32, num_splits=7, block_k=128), args, "cuda")
  assert "xla.gpu.triton" in text


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-T{s[1]}-D{s[4]}-S{s[5]}")
def test_tpu_kernel_lowers_to_mosaic(shape):
  text = _lower(lambda *a: pallas_tpu.verify_attention_pallas_tpu(*a), _args(*shape), "tpu")
  assert "tpu_custom_call" in text


def test_tpu_kernel_lowers_with_small_blocks_and_two_heads_per_block():
  args = _args(2, 5, 8, 4, 64, 200, jnp.bfloat16, jnp.bfloat16, True)     # 128 // 64 = 2
  assert pallas_tpu.heads_per_block(4, 64) == 2
  text = _lower(lambda *a: pallas_tpu.verify_attention_pallas_tpu(*a, block_k=64), args, "tpu")
  assert "tpu_custom_call" in text
