"""Matrix products that accumulate in float32, whatever the dtype of their operands.

Every product in spec_jax (projections, LM heads, drafter heads, attention) goes through these,
so that bfloat16 weights compute the way GPU and TPU users run them: bf16 operands, a float32
accumulator (`preferred_element_type=float32`), the result cast back to the dtype the consumer
wants. A bf16 dot with a bf16 result rounds every partial sum to 8 bits of mantissa, and on
XLA:CPU it is also the slow path: with AVX-512-BF16, 48 bf16 768x2048 weights read by 5 rows
cost 21.5 ms with a bf16 result and 11.0 ms with a float32 one (the bf16 issue's
microbenchmark; `scripts/bf16_dots.py` measures it). tests/test_bf16.py walks the jaxpr of a
bf16 decode and fails on any dot with low-precision operands that does not accumulate in f32.

Mixed operands (a float32 activation against bfloat16 weights) are computed in the weights'
dtype: the activation is rounded to bf16 (cheap: it is [T, in]), never the weights widened to
f32 (a full copy of every weight, per call).
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

from kernels_pallas import platform

LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def is_low_precision(dtype) -> bool:
  """bfloat16 or float16: dots over them accumulate in float32."""
  return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in LOW_PRECISION)


def _operands(a, b):
  """(a, b, preferred element type): both in the lower precision of the two when one is
  low-precision (the other is rounded to it), with a float32 accumulator; else unchanged."""
  if is_low_precision(b.dtype) and a.dtype != b.dtype:
    a = a.astype(b.dtype)
  elif is_low_precision(a.dtype) and a.dtype != b.dtype:
    b = b.astype(a.dtype)
  preferred = jnp.float32 if is_low_precision(a.dtype) else None
  return a, b, preferred


def dot_general(a, b, dimension_numbers, out_dtype=None):
  """lax.dot_general with a float32 accumulator for low-precision operands; the result in
  out_dtype (default: a's dtype as given)."""
  out_dtype = a.dtype if out_dtype is None else out_dtype
  a, b, preferred = _operands(a, b)
  y = jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=preferred)
  return y.astype(out_dtype)


def dense(x, w: Union[jax.Array, Sequence[jax.Array]], transposed: bool = False,
          out_dtype=None):
  """x [..., in] times a weight stored [in, out] (transposed False) or [out, in] (True)
  -> [..., out] in out_dtype (default x's dtype), accumulated in float32 for bf16.

  With transposed, w may be a tuple of row chunks [out_i, in] (models.layout.fuse_layers'
  chunks): one dot each, concatenated along out. The product is one rank-2 dot over x's rows
  (XLA:CPU hands a rank-2 bf16 dot to YNNPACK's GEMM, a rank-3 one [B, T, in] to a path ~2x
  slower: docs/speed.md), and on CPU a one-row product with low-precision weights is
  computed as two rows (two_rows_for_one)."""
  lead = x.shape[:-1]
  rows = x.reshape(-1, x.shape[-1])          # [rows, in]: a rank-2 dot (see below)
  pad = rows.shape[0] == 1 and two_rows_for_one(w)
  if pad:
    rows = jnp.concatenate([rows, rows], axis=0)
  dims = (((1,), (1 if transposed else 0,)), ((), ()))
  if isinstance(w, (tuple, list)):
    y = jnp.concatenate([dot_general(rows, c, dims, out_dtype) for c in w], axis=-1)
  else:
    y = dot_general(rows, w, dims, out_dtype)
  return (y[:1] if pad else y).reshape(lead + y.shape[-1:])


def two_rows_for_one(w) -> bool:
  """Whether a one-row product with weight(s) w runs as two rows: for bf16 / f16 weights on
  XLA:CPU, which lowers a one-row bf16 dot to a convert of the whole weight to f32 (a copy,
  every call) and an f32 GEMV, while two rows take YNNPACK's bf16 GEMM: 48 bf16 768x2048
  weights cost ~72 ms for one row, ~12 ms for two (scripts/bf16_dots.py; docs/speed.md). The
  second row is thrown away."""
  first = w[0] if isinstance(w, (tuple, list)) else w
  return is_low_precision(first.dtype) and platform.is_cpu()


def einsum(subscripts: str, a, b, out_dtype=None):
  """jnp.einsum of two operands with a float32 accumulator for low-precision ones; the result
  in out_dtype (default a's dtype as given)."""
  out_dtype = a.dtype if out_dtype is None else out_dtype
  a, b, preferred = _operands(a, b)
  return jnp.einsum(subscripts, a, b, preferred_element_type=preferred).astype(out_dtype)


def accumulation_dtype(dtype) -> Optional[jnp.dtype]:
  """float32 for low-precision dtypes, else None (the dot's default): for callers that build
  their own dot_general (the Pallas kernels)."""
  return jnp.dtype(jnp.float32) if is_low_precision(dtype) else None


def pick_weight(lp, name: str, rows: int):
  """(weight, transposed) of projection `name` in layer params lp for a product over `rows`
  rows (B*T): the [out, in] copy `name_t` when it is the only one or rows > 1, the [in, out]
  copy `name` when it is the only one or rows == 1; None when neither is there."""
  plain, flipped = lp.get(name), lp.get(name + "_t")
  if flipped is not None and (plain is None or rows > 1):
    return flipped, True
  if plain is not None:
    return plain, False
  return None


def dense_named(x, params, name: str, out_dtype=None):
  """x times the 2-D weight `name` of params, stored [in, out] as `name` or [out, in] as
  `name_t` (the CPU execution layout: models.llama.layout.dense_layout); pick_weight's rule
  when both are there."""
  picked = pick_weight(params, name, math.prod(x.shape[:-1]))
  if picked is None:
    raise KeyError(f"no weight {name!r} or {name + '_t'!r} in these params")
  return dense(x, *picked, out_dtype=out_dtype)


def activation_dtype(config) -> str:
  """The dtype of the residual stream, the activations and the KV cache: config.dtype, except
  bf16 models on CPU (the platform being lowered for: kernels_pallas.platform), which keep them in float32 ($SPEC_JAX_CPU_ACTIVATIONS=model keeps bf16).
  Their weights stay bf16 and every dot takes bf16 operands with f32 accumulation, as on GPU
  and TPU; XLA:CPU's bf16 elementwise work (norms, RoPE, residual adds and the casts between)
  cost a bf16 forward of the 78M widened model 1.5-5 ms of 15-24 (scripts/step_layouts.py
  --dtypes bfloat16 bf16-weights; docs/speed.md)."""
  if (config.dtype == "bfloat16" and platform.is_cpu()
      and os.environ.get("SPEC_JAX_CPU_ACTIVATIONS", "float32") != "model"):
    return "float32"
  return config.dtype
