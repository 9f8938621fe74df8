"""transformer.forward's cached paths against a full forward: tree drafts (tree_mask and
positions) over a cached prefix, with ragged per-row offsets."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from tests.numerics import MODEL_ULPS, ONE_OP_ULPS, assert_f32_close

CFG = sj.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position_embeddings=128)   # head_dim 16

_forward = jax.jit(sj.forward, static_argnums=1, static_argnames=("return_layers",))


@functools.lru_cache(None)
def model():
  m = sj.init_model(CFG, jax.random.key(3))
  m.params["embed"] = m.params["embed"] * 20
  return m


def full_logits(params, config, seq):
  """Logits of one causal forward over seq at offset 0 (no cache reuse): [len(seq), V]."""
  cache = sj.KVCache.zeros(config, 1, 32)
  padded = jnp.asarray([list(seq) + [0] * (32 - len(seq))], jnp.int32)
  logits = _forward(params, config, padded, cache, jnp.zeros(1, jnp.int32)).logits[0]
  return np.asarray(logits)[:len(seq)]


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_tree_forward_over_a_cached_prefix_equals_each_path_forwarded_alone(impl):
  """Tree tokens [r, a, b, c]: a and b are siblings after r, c follows a. With the ancestor
  tree_mask and depth positions, each node's logits equal those of a plain forward of its own
  path (prefix + root .. node). Two rows with different prefix lengths (ragged offsets)."""
  m = model()
  config = CFG.replace(attention_impl=impl)
  prefixes = [[1, 5, 9, 2, 7, 7, 3], [1, 4, 8, 8, 6]]
  trees = [[11, 12, 13, 14], [21, 22, 23, 24]]
  parent = [-1, 0, 0, 1]                                   # r; a <- r; b <- r; c <- a
  depth = np.asarray([0, 1, 1, 2], np.int32)
  mask = np.zeros((4, 4), bool)
  for i in range(4):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parent[j]
  width = max(map(len, prefixes))
  prefix = np.zeros((2, width), np.int32)
  for b, p in enumerate(prefixes):
    prefix[b, :len(p)] = p
  lens = np.asarray([len(p) for p in prefixes], np.int32)
  cache = sj.KVCache.zeros(config, 2, 32)
  # Prefill the padded prefixes, then put the tree right after each row's real prefix (the
  # padding's KV slots are overwritten by the tree's).
  cache = _forward(m.params, config, jnp.asarray(prefix), cache, jnp.zeros(2, jnp.int32)).cache
  out = _forward(m.params, config, jnp.asarray(trees, jnp.int32), cache, jnp.asarray(lens),
                 positions=jnp.asarray(lens[:, None] + depth[None]),
                 tree_mask=jnp.asarray(np.broadcast_to(mask, (2, 4, 4))))
  got = np.asarray(out.logits)
  for b in range(2):
    for node in range(4):
      path, j = [], node
      while j >= 0:
        path.insert(0, trees[b][j])
        j = parent[j]
      want = full_logits(m.params, CFG, prefixes[b] + path)[-1]
      assert_f32_close(got[b, node], want, MODEL_ULPS, err_msg=f"row {b} node {node}")
  # Sanity: the siblings really differ (the mask matters): b's logits are not a's.
  assert np.abs(got[0, 1] - got[0, 2]).max() > 1e-2


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_execution_layouts_give_the_canonical_logits(chunks):
  """fuse_layers (fused q|k|v and gate|up; [out, in] with row blocks) + unstack_layers: the same
  logits and cache as the canonical stacked weights, over a 3-token forward at ragged offsets
  (3 blocks do not divide every projection: fewer are used, still exact)."""
  from spec_jax.models.llama import layout as tr
  m = model()
  layout = dict(m.params)
  layout["layers"] = tr.fuse_layers(m.params["layers"], transpose=True, chunks=chunks)
  layout = tr.unstack_layers(layout)
  if chunks > 1:
    assert isinstance(layout["layers"][0]["w_gu_t"], tuple)
  tokens = jnp.asarray([[5, 9, 1], [7, 2, 30]], jnp.int32)
  offsets = jnp.asarray([0, 4], jnp.int32)
  cache = sj.KVCache.zeros(CFG, 2, 16)
  want = sj.forward(m.params, CFG, tokens, cache, offsets)
  got = sj.forward(layout, CFG, tokens, cache, offsets)
  assert_f32_close(got.logits, want.logits, MODEL_ULPS)
  assert_f32_close(got.cache.k, want.cache.k, MODEL_ULPS)


@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding-window"])
def test_head_major_cache_gives_the_seq_major_logits_and_entries(window):
  """A prefill then a ragged 3-token verify step: the head-major cache (the jnp path's layout)
  gives the [L, B, S, Hkv, Dh] cache's logits and, transposed back, its entries."""
  import dataclasses
  config = dataclasses.replace(CFG, sliding_window=window, attention_impl="reference")
  params = model().params
  prompt = jnp.asarray([[5, 9, 1, 7, 2, 30, 8], [7, 2, 30, 3, 0, 0, 0]], jnp.int32)
  step = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  offsets = jnp.asarray([7, 4], jnp.int32)
  outs = {}
  for head_major in (False, True):
    cache = sj.KVCache.zeros(config, 2, 16, head_major=head_major)
    assert cache.k.shape[2 if head_major else 3] == config.num_kv_heads
    pre = _forward(params, config, prompt, cache, jnp.zeros(2, jnp.int32))
    out = _forward(params, config, step, pre.cache, offsets)
    assert out.cache.head_major == head_major
    outs[head_major] = (pre.logits, out.logits, out.cache.seq_major())
  assert_f32_close(outs[True][0], outs[False][0], MODEL_ULPS)
  assert_f32_close(outs[True][1], outs[False][1], MODEL_ULPS)
  # The entries are one projection and the rotary away from the same inputs: bit-identical at
  # the suite's LLVM O0, within a few ULPs where LLVM contracts the two layouts' multiply-adds
  # differently (O1, or XLA's default flags: 7e-9 and 3e-7 apart here).
  assert_f32_close(outs[True][2].k, outs[False][2].k, ONE_OP_ULPS)
  assert_f32_close(outs[True][2].v, outs[False][2].v, ONE_OP_ULPS)


def test_cache_layout_follows_the_attention_impl():
  """Head-major where the jnp attention runs (the reference; "auto" on CPU), the kernels'
  [L, B, S, Hkv, Dh] where a Pallas kernel runs."""
  import dataclasses
  shape = lambda impl: sj.KVCache.zeros(dataclasses.replace(CFG, attention_impl=impl), 1, 8).k.shape
  assert shape("reference") == (2, 1, 2, 8, 16)
  assert shape("pallas") == (2, 1, 8, 2, 16)
  if jax.default_backend() == "cpu":
    assert shape("auto") == (2, 1, 2, 8, 16)


def test_lane_packed_head_major_cache_gives_the_same_logits_and_entries():
  """The TPU kernel's layout for head_dim < 128 (kernels_pallas.lanes): 4 heads of 32 packed
  into 128 lanes, [L, B, 1, S, 128]. A prefill over more than one key block (the blocked jnp
  path) and a ragged verify step, through the jnp reference and the Pallas kernel (which get
  the slab unpacked): the unpacked head-major cache's logits, and its entries once unpacked."""
  import dataclasses
  from spec_jax.models.cache import KVCache
  config = sj.ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_layers=2,
                          num_heads=8, num_kv_heads=4, head_dim=32, attention_impl="reference",
                          max_position_embeddings=1024)
  params = sj.init_model(config, jax.random.key(5)).params
  prompt = jax.random.randint(jax.random.key(6), (2, 300), 1, 64)
  step = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  offsets = jnp.asarray([300, 120], jnp.int32)
  groups = [(config.num_layers, config.num_kv_heads, config.head_dim)]
  outs = {}
  for impl in ("reference", "pallas"):
    cfg = dataclasses.replace(config, attention_impl=impl)
    for packed in (False, True):
      cache = KVCache.of_groups(cfg, 2, 320, groups, head_major=True, stacked=True,
                                lane_pack=packed)
      assert cache.k.shape == ((2, 2, 1, 320, 128) if packed else (2, 2, 4, 320, 32))
      pre = _forward(params, cfg, prompt, cache, jnp.zeros(2, jnp.int32))
      out = _forward(params, cfg, step, pre.cache, offsets)
      assert out.cache.k.shape == cache.k.shape
      outs[impl, packed] = (pre.logits, out.logits, out.cache.seq_major(head_dims=32))
  for impl in ("reference", "pallas"):
    want, got = outs[impl, False], outs[impl, True]
    # The same products over the same entries (bit-identical at the suite's LLVM O0); another
    # CPU's dot kernels may order a transposed operand's sums differently, and LLVM at O1 or
    # XLA's default flags contracts the rotary's multiply-adds differently per layout (1 ULP of
    # an entry here), hence the ULP bounds.
    assert_f32_close(got[0], want[0], MODEL_ULPS)
    assert_f32_close(got[1], want[1], MODEL_ULPS)
    assert_f32_close(got[2].k, want[2].k, ONE_OP_ULPS)
    assert_f32_close(got[2].v, want[2].v, ONE_OP_ULPS)


def test_a_forward_past_the_cache_is_refused_when_the_offsets_are_known():
  """Writes past S were dropped and those positions attended without their own key and value
  (logits off by up to 20 on a windowed Gemma): concrete offsets are checked; a jit's traced
  ones are the caller's (decode checks its capacity itself)."""
  params = sj.init_model(CFG, jax.random.key(0)).params
  cache = sj.KVCache.zeros(CFG, 2, 16)
  tokens = jnp.ones((2, 10), jnp.int32)
  sj.forward(params, CFG, tokens, cache, jnp.asarray([6, 0]))          # fits exactly
  for offsets in ([10, 0], [0, -1]):
    with pytest.raises(ValueError, match="write outside the cache of 16 slots"):
      sj.forward(params, CFG, tokens, cache, jnp.asarray(offsets))


def _configs_to_count():
  """Configs whose parameter count has an extra term: q/k/v biases, q/k norms, Gemma 4's
  layer_scalar and KV-shared layers (no k_norm), a hybrid."""
  from tests.hybrid_helpers import TINY_QWEN3_NEXT
  base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
              num_kv_heads=2)
  out = {"qwen2-bias": sj.ModelConfig(**base, qkv_bias=True, model_type="qwen2"),
         "qwen3-norms-bias": sj.ModelConfig(**base, qkv_bias=True, qk_norm=True,
                                            model_type="qwen3"),
         "llama": sj.ModelConfig(**base),
         "qwen3-next": sj.ModelConfig(**TINY_QWEN3_NEXT)}
  transformers = pytest.importorskip("transformers")
  del transformers
  from spec_jax.models.hf import config_from_hf
  from tests import gemma_helpers as gh
  for name in ("gemma3_text_config", "gemma4_dense_config", "gemma4_e2b_config"):
    out[name] = config_from_hf(getattr(gh, name)())
  return out


def test_num_params_counts_every_param_the_model_holds():
  """config.num_params (the eval's results.json, the bench tables) left out q/k/v biases and
  q/k norms, counted k_norm on Gemma 4's KV-shared layers and left out its layer_scalar."""
  for name, config in _configs_to_count().items():
    shapes = jax.eval_shape(lambda c=config: sj.init_model(c, jax.random.key(0)).params)
    held = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert config.num_params == held, (name, config.num_params, held)
