"""generate() on a mesh of 8 fake CPU devices equals generate() on one device.

XLA's device count is fixed when jax starts, so the check runs in a fresh interpreter with
--xla_force_host_platform_device_count=8."""

import os
import subprocess
import sys
import textwrap

import pytest

import spec_jax as sj

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    import spec_jax as sj
    assert jax.device_count() == 8, jax.devices()
    cfg = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=128)
    target = sj.init_model(cfg, jax.random.key(1))
    target.params["embed"] = target.params["embed"] * 40
    draft = sj.init_model(cfg.replace(num_layers=1), jax.random.key(2))
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5], [1, 9, 9], [1, 4, 4, 4, 2, 1, 4, 4],
               [1], [1, 6, 6], [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    plain = None
    for drafter, k in [(None, 0), (sj.drafters.NGram(), 3), (sj.drafters.DraftModel(draft), 3)]:
      kw = dict(drafter=drafter, num_draft=k, max_new_tokens=16, stop_tokens=[])
      # Greedy speculation on one device equals plain greedy (lossless): plain greedy is the
      # one-device reference of every greedy drafter, as for the heads below (two one-device
      # compiles fewer).
      plain = plain or sj.generate(target, prompts, sampling=sj.Sampling(0.0), **kw)
      many = sj.generate(target, prompts, sampling=sj.Sampling(0.0), mesh=mesh, **kw)
      assert many.tokens == plain.tokens, (k, many.tokens, plain.tokens)
      s1 = sj.generate(target, prompts, sampling=sj.Sampling(1.0), key=jax.random.key(3), **kw)
      s8 = sj.generate(target, prompts, sampling=sj.Sampling(1.0), key=jax.random.key(3),
                       mesh=mesh, **kw)
      assert s8.tokens == s1.tokens, k
    # Every head kind (single-layer 2-D weights, Medusa's per-head LM heads) on the mesh: greedy
    # speculative output equals plain greedy output on one device (lossless), so that is the
    # reference (no extra one-device compile per head).
    from spec_jax.drafters import EAGLE, EAGLE3, MTP, Medusa
    heads = [Medusa.init(target, num_heads=3, key=jax.random.key(4), init_scale=4.0),
             EAGLE.init(target, key=jax.random.key(4), init_std=0.3),
             EAGLE3.init(target, key=jax.random.key(4), init_std=0.3),
             MTP.init(target, key=jax.random.key(4), init_std=0.3)]
    for head in heads:
      kw = dict(drafter=head, num_draft=3, max_new_tokens=16, stop_tokens=[],
                sampling=sj.Sampling(0.0))
      many = sj.generate(target, prompts, mesh=mesh, **kw)
      assert many.tokens == plain.tokens, (type(head).__name__, many.tokens, plain.tokens)
      assert many.stats.drafted > 0
    # The prompt features a drafter keeps ([B, P, D] buffers of a chunked prefill) are split
    # on D over "model" (sharding.constrain_features), with the values of the unsplit run.
    import functools
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec
    from spec_jax import sharding as sharding_lib
    from spec_jax.decoding.target import as_target
    from spec_jax.models.prefill import chunked_prefill
    model_target = as_target(cfg)
    def prefill(params, tokens, lens, mesh):
      params = model_target.prepare(params, mesh)
      forward = lambda x, cache, offsets, last, layers: model_target.forward_last(
          params, x, cache, offsets, last, return_layers=layers)
      return chunked_prefill(forward, tokens, lens, model_target.init_cache(8, 16), chunk=4,
                             return_layers=(0, 1), constrain_features=functools.partial(
                                 sharding_lib.constrain_features, mesh))
    tokens = jax.random.randint(jax.random.key(5), (8, 12), 1, 64)
    lens = jnp.arange(5, 13)
    whole = jax.jit(lambda p, x, n: prefill(p, x, n, None))(target.params, tokens, lens)
    auto = sharding_lib.as_auto(mesh)                # as decode hands it to init_loop
    split = jax.jit(lambda p, x, n: prefill(p, x, n, auto))(target.params, tokens, lens)
    for buf in (split.hidden,) + split.layer_hidden:
      assert buf.sharding.spec == PartitionSpec("data", None, "model"), buf.sharding
    for a, b in zip((split.hidden,) + split.layer_hidden, (whole.hidden,) + whole.layer_hidden):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    try:
      sj.generate(target, prompts[:3], mesh=mesh)
    except ValueError as e:
      assert "does not divide" in str(e)
    else:
      raise AssertionError("a batch of 3 on a data axis of 4 must be refused")
    print("OK")
""")


def test_generate_on_eight_cpu_devices_matches_one_device():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_param_partition_specs_for_stacked_and_single_layers():
  """The "model" axis of a leaf is found from the end of its shape: the target's stacked
  [L, D, H*Dh] layers, a head's single [D, H*Dh] layer and Medusa's [K, D, V] LM heads."""
  from jax.sharding import PartitionSpec as P
  from spec_jax.sharding import MODEL, _spec_for
  assert _spec_for("wq", (2, 32, 64), 2) == P(None, None, MODEL)
  assert _spec_for("wq", (32, 64), 2) == P(None, MODEL)
  assert _spec_for("wo", (2, 64, 32), 2) == P(None, MODEL, None)
  assert _spec_for("wo", (64, 32), 2) == P(MODEL, None)
  assert _spec_for("bq", (64,), 2) == P(MODEL)
  assert _spec_for("lm_head", (3, 32, 64), 2) == P(None, None, MODEL)
  assert _spec_for("embed", (64, 32), 2) == P(MODEL, None)
  assert _spec_for("wq", (32, 63), 2) == P()               # does not divide: replicated
  assert _spec_for("w_down", (7,), 2) == P()               # unexpected rank: replicated
  assert _spec_for("fc", (64, 32), 2) == P()               # not in the table


def test_mesh_without_the_named_axes_is_refused():
  import jax
  mesh = jax.make_mesh((1,), ("batch",))
  cfg = sj.ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=1)
  with pytest.raises(ValueError, match="'data' and 'model'"):
    sj.generate(sj.init_model(cfg), [[1, 2]], mesh=mesh)
