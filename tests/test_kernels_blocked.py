"""kernels_pallas.blocked: the prefill's verify attention in key blocks equals the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.blocked import verify_attention_blocked
from kernels_pallas.reference import verify_attention_reference

# (B, T, Hq, Hkv, D, S, block, window, tree width extra or None, head_major, dtype)
CASES = [
    (2, 40, 4, 2, 16, 100, 32, None, None, False, jnp.float32),    # ragged S, GQA
    (3, 20, 4, 1, 8, 70, 16, 9, None, True, jnp.float32),          # window, MQA, head-major
    (2, 5, 2, 2, 8, 50, 16, None, 3, False, jnp.float32),          # wide tree mask (W = T + 3)
    (2, 33, 4, 2, 16, 128, 64, None, None, False, jnp.bfloat16),   # bf16, S a multiple
    (1, 17, 2, 2, 8, 40, 64, None, None, True, jnp.float32),       # block > S: one block
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}-S{c[5]}-blk{c[6]}")
def test_blocked_equals_reference(case):
  b, t, hq, hkv, d, s, block, window, extra, head_major, dtype = case
  ks = jax.random.split(jax.random.key(sum(case[:7])), 4)
  q = jax.random.normal(ks[0], (b, t, hq, d)).astype(dtype)
  shape = (b, hkv, s, d) if head_major else (b, s, hkv, d)
  k = jax.random.normal(ks[1], shape).astype(dtype)
  v = jax.random.normal(ks[2], shape).astype(dtype)
  lengths = jnp.asarray(np.random.RandomState(b * t).randint(t, s + 1, size=b), jnp.int32)
  mask = None
  if extra is not None:
    w = t + extra
    own = jnp.arange(w)[None, None, :] == (jnp.arange(t) + extra)[None, :, None]
    mask = jax.random.bernoulli(ks[3], 0.5, (b, t, w)) | own      # every query sees itself
  want = verify_attention_reference(q, k, v, lengths, mask, window, head_major=head_major)
  got = verify_attention_blocked(q, k, v, lengths, mask, window, head_major=head_major,
                                 block=block)
  tol = 1e-2 if dtype == jnp.bfloat16 else 2e-6
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=tol, rtol=tol)


def test_blocked_never_builds_full_width_scores():
  """The point of it: no [.., T, S] float32 array in the program, only [.., block] ones."""
  b, t, hq, hkv, d, s, block = 2, 64, 4, 2, 16, 2048, 256
  args = (jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((b,), jnp.int32))
  text = jax.jit(lambda *a: verify_attention_blocked(*a, block=block)).lower(*args).as_text()
  assert f"x{s}xf32>" not in text
  assert f"x{block}xf32>" in text
  full = jax.jit(verify_attention_reference).lower(*args).as_text()
  assert f"x{s}xf32>" in full           # the witness: the reference does build them


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_stale_non_finite_slots_change_nothing(bad):
  """Slots past a row's length are invisible, whatever they hold: a non-finite K/V left there
  (a rejected draft's) must not turn 0 * inf into NaN. The Pallas kernels zeroed such V; the
  reference (both layouts) and the blocked path returned all NaN before."""
  rng = np.random.default_rng(0)
  b, t, hq, hkv, d, s = 2, 2, 2, 1, 16, 32
  q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
  k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
  lengths = jnp.asarray([10, 20], jnp.int32)
  clean = np.asarray(verify_attention_reference(q, jnp.asarray(k), jnp.asarray(v), lengths))
  k[0, 12:], v[0, 12:], k[1, 20:], v[1, 20:] = bad, bad, bad, bad
  k, v = jnp.asarray(k), jnp.asarray(v)
  hm = lambda c: jnp.swapaxes(c, 1, 2)
  for name, got in [
      ("reference", verify_attention_reference(q, k, v, lengths)),
      ("head-major reference", verify_attention_reference(q, hm(k), hm(v), lengths,
                                                          head_major=True)),
      ("blocked", verify_attention_blocked(q, k, v, lengths, block=8))]:
    np.testing.assert_allclose(np.asarray(got), clean, atol=1e-6, err_msg=name)
