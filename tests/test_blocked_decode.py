"""The blocked jnp attention (kernels_pallas.blocked) as the decode step uses it: every row
length from a lone new token to a full cache, causal and tree masks, grouped-query heads, both
cache layouts, bf16, nothing read past the longest row; and the model's jnp path uses it for
large caches without changing a token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from kernels_pallas import blocked
from kernels_pallas.reference import verify_attention_reference
from tests.numerics import assert_f32_close


def _inputs(t, head_major, dtype=jnp.float32, s=512, b=4, hq=6, hkv=2, d=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, hq, d)).astype(dtype)
  shape = (b, hkv, s, d) if head_major else (b, s, hkv, d)
  k = jax.random.normal(ks[1], shape).astype(dtype)
  v = jax.random.normal(ks[2], shape).astype(dtype)
  # a row that is all new tokens, one that ends inside the first block, one on a block
  # boundary and one that fills the cache
  lens = jnp.array([t, 100, 256, s], jnp.int32)
  mask = jax.random.bernoulli(ks[3], 0.5, (b, t, t)) | jnp.eye(t, dtype=bool)[None]
  return q, k, v, lens, mask


@pytest.mark.parametrize("t,head_major,tree", [(1, True, False), (5, True, False),
                                               (5, True, True), (5, False, True)])
def test_blocked_equals_reference(t, head_major, tree):
  q, k, v, lens, mask = _inputs(t, head_major)
  mask = mask if tree else None
  want = verify_attention_reference(q, k, v, lens, mask, head_major=head_major)
  for block in (128, 256):
    got = jax.jit(lambda *a: blocked.verify_attention_blocked(
        *a, head_major=head_major, block=block))(q, k, v, lens, mask)
    assert_f32_close(got, want, err_msg=f"block {block}")


def test_blocked_bf16_matches_reference_to_bf16_rounding():
  q, k, v, lens, mask = _inputs(5, True, jnp.bfloat16)
  want = np.asarray(verify_attention_reference(q, k, v, lens, mask, head_major=True),
                    np.float32)
  got = np.asarray(blocked.verify_attention_blocked(q, k, v, lens, mask, head_major=True,
                                                    block=128), np.float32)
  # Both round the softmax weights to bf16 for the second product (blocked: unnormalised,
  # relative to the running max): a few bf16 ulps of the output's scale.
  assert np.max(np.abs(got - want)) <= 2 ** -6 * np.max(np.abs(want))


def test_blocked_ignores_what_lies_past_the_longest_row():
  """Only blocks below max(kv_lengths) are read: garbage (NaN) past it changes nothing."""
  q, k, v, _, _ = _inputs(3, True)
  lens = jnp.array([3, 40, 200, 250], jnp.int32)
  want = blocked.verify_attention_blocked(q, k, v, lens, head_major=True, block=128)
  poisoned = k.at[:, :, 256:].set(jnp.nan), v.at[:, :, 256:].set(jnp.nan)
  got = blocked.verify_attention_blocked(q, *poisoned, lens, head_major=True, block=128)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_model_decode_with_a_large_cache_equals_a_small_one():
  """Greedy decoding through the blocked path (capacity 1024) gives the tokens of the
  reference path (capacity 256, one block)."""
  cfg = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=2048)
  model = sj.init_model(cfg, jax.random.key(3))
  prompts = [[5, 9, 11, 3] * 20, [7, 8] * 5]
  outs = [sj.generate(model, prompts, max_new_tokens=24, sampling=sj.Sampling(temperature=0.0),
                      stop_tokens=[], capacity=cap).tokens for cap in (256, 1024)]
  assert outs[0] == outs[1]
