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

from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

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
  chunks): one dot each, concatenated along out."""
  contract = 1 if transposed else 0
  dims = (((x.ndim - 1,), (contract,)), ((), ()))
  if isinstance(w, (tuple, list)):
    return jnp.concatenate([dot_general(x, c, dims, out_dtype) for c in w], axis=-1)
  return dot_general(x, w, dims, out_dtype)


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
