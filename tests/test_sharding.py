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
    for drafter, k in [(None, 0), (sj.drafters.NGram(), 3), (sj.drafters.DraftModel(draft), 3)]:
      kw = dict(drafter=drafter, num_draft=k, max_new_tokens=16, stop_tokens=[])
      one = sj.generate(target, prompts, sampling=sj.Sampling(0.0), **kw)
      many = sj.generate(target, prompts, sampling=sj.Sampling(0.0), mesh=mesh, **kw)
      assert many.tokens == one.tokens, (k, many.tokens, one.tokens)
      s1 = sj.generate(target, prompts, sampling=sj.Sampling(1.0), key=jax.random.key(3), **kw)
      s8 = sj.generate(target, prompts, sampling=sj.Sampling(1.0), key=jax.random.key(3),
                       mesh=mesh, **kw)
      assert s8.tokens == s1.tokens, k
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


def test_mesh_without_the_named_axes_is_refused():
  import jax
  mesh = jax.make_mesh((1,), ("batch",))
  cfg = sj.ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=1)
  with pytest.raises(ValueError, match="'data' and 'model'"):
    sj.generate(sj.init_model(cfg), [[1, 2]], mesh=mesh)
