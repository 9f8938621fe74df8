"""The TPU cache kernels (kernels_pallas.kv_write_tpu), run by the Pallas interpreter on CPU:
writing new slots and moving a tree's accepted path equal the scatters they replace, bit for
bit, at every offset (aligned or not, straddling or past the capacity), alone and shard_mapped;
and a decode lowered for TPU writes its cache only through them (no per-slot scatter, which
made XLA:TPU copy every layer's cache before each attention call: issue 35)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import kv_write_tpu
from spec_jax.models.cache import KVCache, move_kv, write_rows
from tests.test_accelerators import TINY, _lowered, _run


def _scattered(cache, layer, new, offsets):
  """The reference: write_rows' per-slot scatter (what a CPU program runs)."""
  return write_rows(cache, layer, new, offsets, head_major=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t,d", [(1, 128), (5, 64), (17, 128), (32, 128)])
def test_write_kernel_equals_the_scatter(dtype, t, d):
  layers, b, hkv, s = 3, 6, 2, 64
  ks = jax.random.split(jax.random.key(t), 2)
  cache = jax.random.normal(ks[0], (layers, b, hkv, s, d)).astype(dtype)
  new = jax.random.normal(ks[1], (b, t, hkv, d)).astype(dtype)
  # aligned, unaligned, the last window, straddling the end, the last slot, past the end
  offsets = jnp.asarray([0, 3, 16, s - t, s - t + 1, s + 2], jnp.int32)
  want = _scattered(cache, 1, new, offsets)
  got = kv_write_tpu.write_slots_pallas_tpu(cache, 1, new, offsets, interpret=True)
  assert got.dtype == cache.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_write_kernel_refuses_what_it_cannot_write():
  ok = (2, 2, 2, 64, 128)
  assert kv_write_tpu.unsupported_reason(ok, (2, 5, 2, 128), jnp.bfloat16) is None
  assert "multiple of 16" in kv_write_tpu.unsupported_reason((2, 2, 2, 60, 128), (2, 5, 2, 128),
                                                             jnp.bfloat16)
  assert "window" in kv_write_tpu.unsupported_reason((2, 2, 2, 32, 128), (2, 32, 2, 128),
                                                     jnp.bfloat16)
  assert "dtype" in kv_write_tpu.unsupported_reason(ok, (2, 5, 2, 128), jnp.int8)
  assert "rank" in kv_write_tpu.unsupported_reason(ok[1:], (2, 5, 2, 128), jnp.bfloat16)
  assert kv_write_tpu.move_unsupported_reason(ok, jnp.bfloat16, 6) is None
  assert "multiple of 16" in kv_write_tpu.move_unsupported_reason((2, 2, 2, 40, 128),
                                                                  jnp.float32, 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_move_kernel_equals_move_kv(dtype):
  """A tree round's accepted path (nodes of a 31-node tree, depth 5) moved to contiguous
  slots: the kernel equals cache.move_kv's gather-then-scatter in every layer, including
  paths that move a slot onto one another source still needs, and rows at the capacity."""
  layers, b, hkv, s, d, depth, nodes = 2, 5, 2, 64, 128, 5, 31
  rs = np.random.RandomState(0)
  cache = jax.random.normal(jax.random.key(1), (layers, b, hkv, s, d)).astype(dtype)
  lengths = jnp.asarray([1, 17, 20, s - 30, s - 2], jnp.int32)
  path = np.sort(rs.randint(1, nodes + 1, (b, depth)), axis=1)
  path[2] = [2, 1, 4, 3, 5]            # a destination that is another move's source
  n_acc = jnp.asarray([5, 1, 5, 3, 4], jnp.int32)
  path = jnp.where(jnp.arange(depth)[None] < n_acc[:, None], jnp.asarray(path, jnp.int32), -1)
  want = move_kv(KVCache(k=cache, v=cache, head_major=True), lengths, path, n_acc).k
  src = jnp.minimum(lengths[:, None] - 1 + jnp.maximum(path, 0), s - 1)
  got = kv_write_tpu.move_slots_pallas_tpu(cache, lengths, src, n_acc, interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_cache_kernels_shard_mapped_equal_one_device():
  """Under a data=2 x model=2 kernel mesh each device writes and moves its rows and KV heads:
  the same cache as the unsharded scatter."""
  _run("""
    import jax, jax.numpy as jnp, numpy as np
    from kernels_pallas import dispatch, platform
    from spec_jax.models.cache import KVCache, move_kv, write_rows
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ks = jax.random.split(jax.random.key(0), 2)
    cache = jax.random.normal(ks[0], (2, 4, 4, 64, 128)).astype(jnp.bfloat16)
    new = jax.random.normal(ks[1], (4, 5, 4, 128)).astype(jnp.bfloat16)
    offsets = jnp.asarray([0, 7, 40, 61], jnp.int32)
    want = write_rows(cache, 1, new, offsets, head_major=True)
    with platform.kernel_mesh(mesh):
      got = jax.jit(lambda c, n, o: dispatch.write_kv(c, 1, n, o, interpret=True))(
          cache, new, offsets)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    lengths = jnp.asarray([3, 10, 30, 50], jnp.int32)
    path = jnp.asarray([[2, 5, -1], [1, 2, 3], [4, -1, -1], [3, 6, 7]], jnp.int32)
    n_acc = jnp.asarray([2, 3, 1, 3], jnp.int32)
    want = move_kv(KVCache(k=cache, v=cache, head_major=True), lengths, path, n_acc).k
    src = jnp.minimum(lengths[:, None] - 1 + jnp.maximum(path, 0), 63)
    with platform.kernel_mesh(mesh):
      got = jax.jit(lambda c: dispatch.move_kv(c, lengths, src, n_acc, interpret=True))(cache)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    print("OK")
  """, devices=4)


def test_tpu_decode_writes_its_cache_only_through_the_kernels():
  """Lowered for TPU: the target's cache is written by the write kernel (prefill chunks and
  rounds), a tree round's path moved by the move kernel, and no scatter produces a stacked
  cache buffer [L, B, Hkv, S, D] (the per-slot scatter that made XLA:TPU relay the cache out)."""
  import spec_jax as sj
  from spec_jax.aot import shapes
  model = shapes.abstract_model(TINY)
  head = shapes.drafter_from_spec("eagle3", model)
  text = _lowered(model, head, tree=sj.TreeSpec(depth=3, top_k=2, num_nodes=6), batch=2,
                  capacity=640)
  cache_type = "tensor<2x2x2x640x128xbf16>"            # [L, B, Hkv, S, D] of TINY's target
  assert _scatter_types(text) and not [t for t in _scatter_types(text) if cache_type in t]
  assert "kv_write_tpu" in text and "kv_move_tpu" in text


def _scatter_types(text):
  """The type signature line of every stablehlo.scatter in a lowered module's text (the op
  spans several lines: its update region, then `}) : (operands) -> result`)."""
  types = []
  for chunk in text.split('"stablehlo.scatter"')[1:]:
    types.append(next(line for line in chunk.splitlines() if line.strip().startswith("}) :")))
  return types
