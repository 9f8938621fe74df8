"""Float32 comparison tolerances derived from the computation's scale, not fixed constants.

A float32 result differs from the exact value by a few units in the last place (ulps) of the
magnitudes it sums, and which XLA:CPU kernel a dot or a reduction lowers to (their order of
summation, their vector width) moves it by a few more. A fixed `atol=1e-5` therefore passes or
fails with the machine: a logit of size 2 has ulp 2.4e-7, and 70 of them are 1.7e-5. Here the
tolerance is `ulps` ulps of the reference's largest finite magnitude (at least 1; a
masked -inf logit must match exactly):

    atol = ulps * eps32 * max(1, max |want| over the finite entries)

with `ulps` set per comparison by its depth: 64 for one dot, one attention or one softmax, 256
for a whole model forward (its error grows with the layers and the residual stream). Measured
against float64 references: the native-MTP and transformers-parity forwards here land at 5-20
ulps of their logits' scale, so 256 leaves a margin of more than ten.
Where an independent reference exists (torch, numpy) it runs in float64, so the tolerance
covers only spec_jax's own float32 error. A real bug (a wrong norm, a shifted position, a
dropped term) moves the result by a large fraction of its scale, far outside these bounds.
"""

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)        # 1.19e-7
ONE_OP_ULPS = 64           # one dot, one attention, one softmax: 7.6e-6 of the scale
MODEL_ULPS = 256           # a whole forward (embedding, L layers, LM head): 3.1e-5 of the scale


def f32_atol(want, ulps: int = ONE_OP_ULPS) -> float:
  """The absolute tolerance for a float32 result against reference values `want`, scaled by
  their largest finite magnitude: a masked logit (-inf, a reduced draft vocabulary's tokens
  outside it) would otherwise make the tolerance infinite and the comparison vacuous.
  Non-finite entries are compared exactly by assert_allclose (the same inf, in place)."""
  finite = np.abs(np.asarray(want, np.float64))
  finite = finite[np.isfinite(finite)]
  scale = max(1.0, float(np.max(finite))) if finite.size else 1.0
  return ulps * EPS32 * scale


def assert_f32_close(got, want, ulps: int = ONE_OP_ULPS, err_msg: str = "") -> None:
  """got (a float32 computation) equals want (a float64 or float32 reference) within
  f32_atol(want, ulps), elementwise."""
  want = np.asarray(want, np.float64)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0,
                             atol=f32_atol(want, ulps), err_msg=err_msg)
