"""kernels_pallas.verify_attention: input validation, impl/kernel resolution, fallback, jit."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import dispatch
from kernels_pallas.reference import verify_attention_reference
from tests.numerics import MODEL_ULPS, assert_f32_close

B, T, HQ, HKV, D, S = 2, 3, 4, 2, 16, 40


def inputs(b=B, t=T, hq=HQ, hkv=HKV, d=D, s=S, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
  k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), dtype)
  lengths = jnp.asarray(rng.integers(t, s + 1, size=b), jnp.int32)
  return q, k, v, lengths


@pytest.fixture(autouse=True)
def _fresh_warnings_exact_reference(monkeypatch):
  """Each test sees first warnings; the reference runs without TF32 / bf16 matmul passes (on
  GPU/TPU the default precision would make it the inexact side of a 1e-5 comparison)."""
  monkeypatch.setattr(dispatch, "_warned", set())
  old = jax.config.read("jax_disable_most_optimizations")
  if jax.default_backend() == "cpu":   # interpret mode is compile-bound: -O0 is ~40% faster
    jax.config.update("jax_disable_most_optimizations", True)
  try:
    with jax.default_matmul_precision("highest"):
      yield
  finally:
    jax.config.update("jax_disable_most_optimizations", old)


# ---------------------------------------------------------------------------- validation

def _bad(**changes):
  q, k, v, lengths = inputs()
  args = dict(q=q, k_cache=k, v_cache=v, kv_lengths=lengths, tree_mask=None)
  args.update(changes)
  return args


BAD_INPUTS = [
    ("q must be rank 4", _bad(q=jnp.zeros((B, T, HQ * D)))),
    ("k_cache must be rank 4", _bad(k_cache=jnp.zeros((B, S, HKV * D)))),
    ("v_cache shape", _bad(v_cache=jnp.zeros((B, S + 1, HKV, D)))),
    ("batch mismatch", _bad(q=jnp.zeros((B + 1, T, HQ, D)))),
    ("head_dim mismatch", _bad(q=jnp.zeros((B, T, HQ, D * 2)))),
    ("multiple of Hkv", _bad(q=jnp.zeros((B, T, 3, D)))),
    ("cannot exceed the cache capacity", _bad(q=jnp.zeros((B, S + 1, HQ, D)))),
    ("floating dtype", _bad(q=jnp.zeros((B, T, HQ, D), jnp.int32))),
    ("k_cache dtype", _bad(v_cache=jnp.zeros((B, S, HKV, D), jnp.bfloat16))),
    ("kv_lengths must have shape", _bad(kv_lengths=jnp.zeros((B, 1), jnp.int32))),
    ("kv_lengths must have shape", _bad(kv_lengths=jnp.zeros((B + 1,), jnp.int32))),
    ("kv_lengths must be an integer", _bad(kv_lengths=jnp.zeros((B,), jnp.float32))),
    ("kv_lengths must be an array", _bad(kv_lengths=[T] * B)),
    ("tree_mask must have shape", _bad(tree_mask=jnp.ones((B, T, T + 1), bool))),
    ("tree_mask must be bool", _bad(tree_mask=jnp.ones((B, T, T), jnp.int32))),
]


@pytest.mark.parametrize("impl", ["auto", "pallas", "reference"])
@pytest.mark.parametrize("match,args", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_inputs_raise_value_error(match, args, impl):
  with pytest.raises(ValueError, match=match):
    kernels_pallas.verify_attention(**args, impl=impl)


HEAD_MAJOR_BAD = [
    ("a cache of rank 4", dict(k_cache=jnp.zeros((B, S, HKV * D)))),
    ("a cache of rank 4", dict(k_cache=jnp.zeros((S, D)))),
    # q's D = 32 against a cache of minor dim 64: not a lane packing (that is 128 = p x D).
    ("head_dim mismatch", dict(q=jnp.zeros((B, T, HQ, 32)), k_cache=jnp.zeros((B, HKV, S, 64)))),
]


@pytest.mark.parametrize("match,args", HEAD_MAJOR_BAD, ids=[m for m, _ in HEAD_MAJOR_BAD])
def test_bad_head_major_inputs_raise_value_error(match, args):
  """head_major reads the cache's packing before the shared checks: a wrong rank was an
  IndexError there, and a head_dim mismatch was taken as a packing and attended."""
  q, k, v, lengths = inputs()
  hm = jnp.swapaxes(k, 1, 2)
  kw = dict(q=q, k_cache=hm, v_cache=hm, kv_lengths=lengths)
  kw.update(args)
  kw["v_cache"] = kw["k_cache"]
  with pytest.raises(ValueError, match=match):
    kernels_pallas.verify_attention(**kw, head_major=True)


def test_bad_inputs_raise_before_compiling_under_jit():
  q, k, v, lengths = inputs()
  f = jax.jit(lambda q, k, v, n: kernels_pallas.verify_attention(q, k, v, n))
  with pytest.raises(ValueError, match="kv_lengths must be an integer"):
    f(q, k, v, lengths.astype(jnp.float32))


def test_unknown_impl_and_kernel():
  q, k, v, lengths = inputs()
  with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'pallas', 'reference'\)"):
    kernels_pallas.verify_attention(q, k, v, lengths, impl="triton")
  with pytest.raises(ValueError, match="kernel must be one of"):
    kernels_pallas.verify_attention(q, k, v, lengths, impl="pallas", kernel="cuda")


# ---------------------------------------------------------------------------- resolution

@pytest.mark.parametrize("impl,kernel,platform,expected", [
    ("auto", None, "cpu", (None, False)),
    ("auto", None, "gpu", ("gpu", False)),
    ("auto", None, "tpu", ("tpu", False)),
    ("auto", "tpu", "cpu", ("tpu", True)),
    ("pallas", None, "cpu", ("gpu", True)),
    ("pallas", "tpu", "cpu", ("tpu", True)),
    ("pallas", None, "gpu", ("gpu", False)),
    ("pallas", None, "tpu", ("tpu", False)),
    ("pallas", "tpu", "gpu", ("tpu", True)),
    ("reference", None, "gpu", (None, False)),
    ("reference", "gpu", "tpu", (None, False)),
])
def test_resolve(impl, kernel, platform, expected):
  assert dispatch.resolve(impl, kernel, platform) == expected


def test_reference_and_auto_on_cpu_are_the_reference():
  q, k, v, lengths = inputs()
  ref = verify_attention_reference(q, k, v, lengths)
  np.testing.assert_array_equal(kernels_pallas.verify_attention(q, k, v, lengths,
                                                                impl="reference"), ref)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(kernels_pallas.verify_attention(q, k, v, lengths), ref)


@pytest.mark.parametrize("kernel", [None, "tpu"])
def test_pallas_on_any_backend_matches_reference(kernel):
  q, k, v, lengths = inputs(d=128, s=64)
  mask = jnp.asarray(np.tril(np.ones((T, T), bool))[None].repeat(B, 0))
  out = kernels_pallas.verify_attention(q, k, v, lengths, mask, impl="pallas", kernel=kernel,
                                        block_k=32)
  assert_f32_close(out, verify_attention_reference(q, k, v, lengths, mask))


def test_pallas_under_jit_with_traced_lengths_and_mask():
  q, k, v, lengths = inputs(d=64, s=48)
  mask = jnp.asarray(np.tril(np.ones((T, T), bool))[None].repeat(B, 0))
  f = jax.jit(lambda n, m: kernels_pallas.verify_attention(q, k, v, n, m, impl="pallas",
                                                           block_k=16))
  for n in (lengths, jnp.full((B,), T, jnp.int32), jnp.full((B,), S, jnp.int32)):
    assert_f32_close(f(n, mask), verify_attention_reference(q, k, v, n, mask))


# ---------------------------------------------------------------------------- fallback

@pytest.mark.parametrize("kernel,shape,why", [
    ("gpu", dict(d=48), "head_dim 48 is not a power of 2"),
    ("tpu", dict(d=48), "head_dim 48 with 2 kv heads"),
    ("gpu", dict(t=65, s=72), "T=65 new tokens"),
    ("tpu", dict(t=30, hq=40, hkv=2, d=128, s=40), "query rows per kv head"),
    ("gpu", dict(s=8, t=2), "cache length 8 < 16"),
])
def test_unsupported_shapes_fall_back_with_one_warning(kernel, shape, why):
  q, k, v, lengths = inputs(**shape)
  with pytest.warns(UserWarning, match=why):
    out = kernels_pallas.verify_attention(q, k, v, lengths, impl="pallas", kernel=kernel)
  np.testing.assert_array_equal(out, verify_attention_reference(q, k, v, lengths))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    kernels_pallas.verify_attention(q, k, v, lengths, impl="pallas", kernel=kernel)


def test_unsupported_dtype_falls_back():
  q, k, v, lengths = inputs(dtype=jnp.float16, d=128)
  with pytest.warns(UserWarning, match="float16 not in"):
    kernels_pallas.verify_attention(q, k, v, lengths, impl="pallas", kernel="tpu")


def test_direct_kernel_call_rejects_unsupported_shapes():
  q, k, v, lengths = inputs(d=48)
  with pytest.raises(ValueError, match="verify_attention_pallas_gpu: head_dim 48"):
    kernels_pallas.verify_attention_pallas_gpu(q, k, v, lengths, interpret=True)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_float32_queries_on_a_bfloat16_cache(kernel):
  q, k, v, lengths = inputs(d=128, s=48)
  k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  out = kernels_pallas.verify_attention(q, k, v, lengths, impl="pallas", kernel=kernel,
                                        block_k=16)
  assert out.dtype == jnp.float32
  assert_f32_close(out, verify_attention_reference(q, k, v, lengths))


def test_model_forward_with_pallas_attention_matches_reference():
  """The transformer's verify pass (T=3 new tokens on a ragged cache) through the kernel."""
  import dataclasses
  import spec_jax as sj
  config = sj.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, attention_impl="reference")
  params = sj.init_model(config, jax.random.key(0)).params
  cache = sj.KVCache.zeros(config, batch=2, capacity=32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)
  run = jax.jit(sj.forward, static_argnums=1)
  prefill = run(params, config, tokens, cache, jnp.zeros((2,), jnp.int32))
  step = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  offsets = jnp.asarray([7, 5], jnp.int32)
  ref = run(params, config, step, prefill.cache, offsets)
  out = run(params, dataclasses.replace(config, attention_impl="pallas"), step, prefill.cache,
            offsets)
  assert_f32_close(out.logits, ref.logits, MODEL_ULPS)
