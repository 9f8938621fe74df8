"""Accelerator readiness checked on this CPU host (issue 35), with no chip and no libtpu:

- every backend choice follows the platform being lowered for (kernels_pallas.platform), so a
  decode lowered for TPU from a CPU host holds the Mosaic kernel calls and a bf16 KV cache;
- under a mesh the kernels are shard_mapped: the decode lowers for TPU (Mosaic refuses to be
  partitioned automatically) at every call site, and on CPU (interpret mode) it gives the same
  tokens as one device;
- no program-sized temporaries: no in-jit fused copy of the weights on an accelerator, no
  [B, P, V] prefill logits, no float32 [.., P, S] prefill scores;
- the weights' execution layout is built once outside the jit (prepare_model), donated.

The full compiles through XLA:TPU (libtpu) run in CI's AOT step: python -m spec_jax.aot.check.
"""

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spec_jax as sj
from kernels_pallas import platform
from spec_jax import memory
from spec_jax.aot import program, shapes
from spec_jax.models import layout
from spec_jax.models.cache import KVCache
from spec_jax.models.matmul import activation_dtype
from tests.conftest import ROOT

TINY = sj.ModelConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                      max_position_embeddings=2048)


def _run(script: str, devices: int):
  # The suite's XLA_FLAGS (conftest: O0, no HLO verifier) kept, the device count added: the
  # script compiled at XLA's default level before, its programs' tokens compared among
  # themselves (both sides compiled alike).
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  env = dict(os.environ, XLA_FLAGS=flags.strip(), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-3000:] + out.stderr[-6000:]
  return out.stdout


def test_backend_choices_follow_the_lowering_platform():
  assert platform.current() == "cpu"
  cpu = jax.eval_shape(lambda: KVCache.zeros(TINY, 2, 64))
  assert cpu.head_major and cpu.k.dtype == jnp.float32 and activation_dtype(TINY) == "float32"
  for name in ("tpu", "cuda"):
    with platform.lowering_for(name):
      assert platform.current() == ("gpu" if name == "cuda" else name)
      acc = jax.eval_shape(lambda: KVCache.zeros(TINY, 2, 64))
      # head-major where the TPU kernel reads it in place; [S, Hkv, Dh] for the GPU kernel
      assert acc.head_major == (name == "tpu") and acc.k.dtype == jnp.bfloat16
      assert activation_dtype(TINY) == "bfloat16"
  assert platform.current() == "cpu"
  with pytest.raises(ValueError, match="platform must be one of"):
    with platform.lowering_for("metal"):
      pass


def _lowered(model, drafter=None, mesh=None, tree=None, num_draft=4, batch=4, prompt_len=32,
             capacity=640, prepared=True):
  with platform.lowering_for("tpu"):
    prog, args, _ = program.abstract_call(
        model, drafter, batch=batch, prompt_len=prompt_len, capacity=capacity, mesh=mesh,
        device=jax.devices()[0], num_draft=num_draft, tree=tree, greedy=False, prepared=prepared)
    return jax.jit(prog).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def test_tpu_decode_has_no_program_sized_temporaries():
  """Lowered for TPU from this CPU, one device: the Mosaic kernels are there, and the three
  memory defects of issue 35 are not (shapes named in the StableHLO text). The weights come
  canonical, as sj.decode inside a user's jit gets them."""
  model = shapes.abstract_model(TINY)
  text = _lowered(model, batch=2, prompt_len=32, capacity=640, prepared=False)
  assert "tpu_custom_call" in text                       # the kernel, not the CPU's reference
  assert "tensor<2x256x1024xbf16>" not in text           # no in-jit w_gate|w_up [L, D, 2F]
  assert "tensor<2x32x384xf32>" not in text              # no [B, P, V] prefill logits
  assert "x32x640xf32>" not in text                      # no f32 [.., P, S] prefill scores
  assert "tensor<2x384xf32>" in text                     # the last position's logits


def test_tpu_cache_packs_head_dim_64_heads_into_the_lanes():
  """Lowered for TPU, a head_dim-64 cache is [L, B, Hkv / 2, S, 128] (kernels_pallas.lanes):
  [S, 64] slabs would be padded to 128 lanes in HBM, twice the cache. Not under a mesh whose
  "model" axis the packed groups would not divide."""
  from kernels_pallas import lanes
  cfg = TINY.replace(num_heads=4, num_kv_heads=2, head_dim=64)
  text = _lowered(shapes.abstract_model(cfg), batch=2, prompt_len=32, capacity=640)
  assert "tensor<2x2x1x640x128xbf16>" in text            # k, v [L, B, 1, S, 2 x 64]
  assert "tensor<2x2x2x640x64xbf16>" not in text          # not [L, B, Hkv, S, 64]
  assert text.count("tpu_custom_call") >= 1
  assert [lanes.lane_pack(h, d, m) for h, d, m in
          ((8, 64, 1), (8, 64, 4), (8, 64, 8), (2, 32, 1), (8, 128, 1), (3, 64, 1))] == \
      [2, 2, 1, 1, 1, 1]


def test_a_lane_packed_cache_decodes_the_same_tokens(monkeypatch):
  """The whole engine on lane-packed caches (target and draft model, forced on this CPU: the
  writes pack the rows, the jnp attention unpacks the slab, a tree round moves packed slots):
  the same tokens as the head-major cache, greedy chain and sampled tree."""
  from spec_jax.models import cache as cache_lib
  cfg = sj.ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_layers=2,
                       num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=256)
  target = sj.init_model(cfg, jax.random.key(1))
  target.params["embed"] = target.params["embed"] * 40
  draft = sj.drafters.DraftModel(sj.init_model(cfg.replace(num_layers=1), jax.random.key(2)))
  prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5]]
  runs = {"chain": dict(num_draft=3, sampling=sj.Sampling(0.0)),
          "tree": dict(tree=sj.TreeSpec(depth=3, top_k=2, num_nodes=6),
                       sampling=sj.Sampling(1.0))}
  kw = dict(drafter=draft, max_new_tokens=10, stop_tokens=[], key=jax.random.key(3))
  want = {name: sj.generate(target, prompts, **run, **kw).tokens for name, run in runs.items()}
  calls = []
  monkeypatch.setattr(cache_lib, "default_lane_pack", lambda config: calls.append(1) or True)
  assert KVCache.zeros(cfg, 1, 8).k.shape == (2, 1, 1, 8, 128)
  from spec_jax.decoding.compiled import clear_compiled
  clear_compiled()                                         # retrace with the packed caches
  for name, run in runs.items():
    assert sj.generate(target, prompts, **run, **kw).tokens == want[name], name
  assert len(calls) > 1


def test_drafters_roll_their_steps_where_it_pays_to_the_same_tokens(monkeypatch):
  """A chain runs its later draft steps as a loop (loop.rolls_draft_steps) where the drafter
  says it pays: a draft model for TPU (XLA:TPU keeps HBM buffers per unrolled layer's weight
  slices) and CPU, an EAGLE-3 head (whose loop measured more HBM on TPU) nowhere, nothing for
  GPU. The rolled chain draws the same tokens as the unrolled one at T = 1 (the drafts and
  their q alike): a draft model (the target itself, so a wrong draft shows in the tokens) and
  an EAGLE-3 head (random: its q shows in the corrections), K = 4."""
  from spec_jax.decoding import loop
  from spec_jax.decoding.compiled import clear_compiled
  from spec_jax.drafters import EAGLE3
  cfg = sj.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
  target = sj.init_model(cfg, jax.random.key(1))
  drafters = {"draft model": sj.drafters.DraftModel(target),      # q = p: every draft accepted
              "EAGLE-3": EAGLE3.init(target, key=jax.random.key(5), init_std=0.5)}
  unrolled_model = drafters["draft model"].replace(rolls_steps_on=())   # to time both on a chip
  assert drafters["draft model"].replace(rolls_steps_on="cuda").rolls_steps_on == ("gpu",)
  with pytest.raises(ValueError, match="rolls_steps_on must name platforms among"):
    drafters["draft model"].replace(rolls_steps_on=("tpu", "metal"))
  for name, rolls in (("cpu", (True, False)), ("tpu", (True, False)), ("cuda", (False, False))):
    with platform.lowering_for(name):
      assert tuple(map(loop.rolls_draft_steps, drafters.values())) == rolls, name
      assert not loop.rolls_draft_steps(unrolled_model)
  prompts = [[1, 5, 7, 9, 5, 7], [1, 3]]
  kw = dict(num_draft=4, sampling=sj.Sampling(1.0), max_new_tokens=12, stop_tokens=[],
            key=jax.random.key(3))
  for rolled in (False, True):
    monkeypatch.setattr(loop, "rolls_draft_steps", lambda drafter: rolled)
    clear_compiled()                                       # retrace with the other steps
    out = {n: sj.generate(target, prompts, drafter=d, **kw) for n, d in drafters.items()}
    if not rolled:
      unrolled = out
  for n in drafters:
    assert out[n].tokens == unrolled[n].tokens, n
    assert out[n].stats.accepted == unrolled[n].stats.accepted, n
  clear_compiled()


def test_tpu_sampled_verify_filters_the_vocabulary_without_sorting_or_reversing_it():
  """The top-k / top-p / min-p filter of a sampled verify ([B, K+1, V] logits) sorts nothing
  along V and reverses nothing (its cut-offs are bisected thresholds, sums over V): under
  `model=4` XLA:TPU all-to-alled the rows of the sort so that each chip held whole
  vocabularies (~60 MiB of sort buffers per chip for an 8B EAGLE-3 round), laid 3-D nucleus
  suffix sums out with the K+1 axis minor (18x padding, 250 MiB per chip) and turned each
  reverse into a collective permute (docs/accelerators.md)."""
  model = shapes.abstract_model(TINY)
  head = shapes.drafter_from_spec("eagle3", model)
  text = _lowered(model, head, num_draft=3)
  vocab = TINY.vocab_size
  assert "stablehlo.reverse" not in text
  sorted_types = [re.search(r"\}\) : \((tensor<[^>]*>)", text[m.start():m.start() + 3000])
                  for m in re.finditer(r'"stablehlo.sort"', text)]
  over_vocab = [t.group(1) for t in sorted_types if t and f"x{vocab}x" in t.group(1)]
  assert not over_vocab, over_vocab              # main before: three, tensor<N x 384 x f32>
  assert not re.findall(rf"window_dimensions = array<i64: [\d, ]*{vocab}>", text)


def test_tpu_decode_lowers_under_a_mesh_at_every_call_site():
  """Mosaic kernels cannot be partitioned by XLA: without the shard_map this raises
  NotImplementedError while lowering (main before issue 35). Target, draft model, EAGLE-3
  head, tree, on model=2 x data=2 and data=4, and a Gemma 4 target's two layer kinds."""
  out = _run("""
    import jax, numpy as np
    import spec_jax as sj
    from spec_jax.aot import program, shapes
    from tests.test_accelerators import TINY, _lowered
    model = shapes.abstract_model(TINY)
    draft = sj.drafters.DraftModel(shapes.abstract_model(TINY.replace(num_layers=1)))
    head = shapes.drafter_from_spec("eagle3", model)
    runs = [(None, None), (draft, None), (head, None), (draft, sj.TreeSpec(depth=3, top_k=2, num_nodes=6))]
    for data, model_axis in ((2, 2), (4, 1)):
      mesh = program.make_mesh(jax.devices()[:4], data, model_axis)
      for drafter, tree in runs:
        text = _lowered(model, drafter, mesh=mesh, tree=tree, num_draft=3)
        assert text.count("tpu_custom_call") >= 1 + (drafter is not None), (data, drafter)
    from spec_jax.models.hf import config_from_hf
    from tests.gemma_helpers import gemma4_dense_config
    hf = gemma4_dense_config(head_dim=128, global_head_dim=256, num_attention_heads=4,
                             num_key_value_heads=2, hidden_size=256, vocab_size=384,
                             sliding_window=64)
    gemma = shapes.abstract_model(config_from_hf(hf, dtype="bfloat16"))
    mesh = program.make_mesh(jax.devices()[:4], 2, 2)
    text = _lowered(gemma, mesh=mesh, capacity=128)   # sliding layers (window < S): jnp path
    assert text.count("tpu_custom_call") >= 1, text.count("tpu_custom_call")
    print("OK")
  """, devices=4)
  assert "OK" in out


@pytest.mark.slow
def test_shard_mapped_kernels_give_one_devices_tokens():
  """On CPU the Pallas kernels run interpreted: under a data=2 x model=2 mesh (each device its
  rows and KV heads) greedy and sampled tokens equal one device's."""
  _run("""
    import jax
    import spec_jax as sj
    cfg = sj.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, attention_impl="pallas",
                         max_position_embeddings=128)
    target = sj.init_model(cfg, jax.random.key(1))
    target.params["embed"] = target.params["embed"] * 40
    draft = sj.drafters.DraftModel(sj.init_model(cfg.replace(num_layers=1), jax.random.key(2)))
    prompts = [[1, 5, 7, 9, 5, 7], [1, 3], [1, 2, 3, 4, 5], [1, 9, 9]]
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    for sampling in (sj.Sampling(0.0), sj.Sampling(1.0)):
      kw = dict(drafter=draft, num_draft=3, max_new_tokens=8, stop_tokens=[],
                sampling=sampling, key=jax.random.key(3))
      one = sj.generate(target, prompts, **kw)
      many = sj.generate(target, prompts, mesh=mesh, **kw)
      assert many.tokens == one.tokens, (many.tokens, one.tokens)
    print("OK")
  """, devices=4)


def test_cuda_export_holds_the_triton_calls():
  report = program.compile_decode(shapes.abstract_model(TINY), None, platform="cuda",
                                  use_mesh=False, batch=2, prompt_len=32, capacity=128)
  assert report.kernel_calls >= 1 and report.cache_dtype == "bfloat16"   # [B, S, Hkv, D]


def test_prepare_model_fuses_and_unstacks_outside_the_jit():
  model = sj.init_model(TINY.replace(dtype="float32"), jax.random.key(0))
  tokens = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
  run = lambda p: sj.forward(p, model.config, tokens, KVCache.zeros(model.config, 2, 16),
                             jnp.zeros((2,), jnp.int32)).logits
  want = run(model.params)
  with platform.lowering_for("tpu"):
    prepared = layout.prepare_model(model)
    assert layout.prepare_params(model.params, model.config) is model.params   # no in-jit copy
  layers = prepared.params["layers"]                     # one dict per layer, fused
  assert len(layers) == TINY.num_layers
  assert {"wqkv", "w_gu"} <= set(layers[0]) and not {"wq", "w_gate"} & set(layers[0])
  np.testing.assert_allclose(run(prepared.params), want, atol=2e-5, rtol=2e-5)
  assert layout.prepare_model(prepared) is prepared


def test_memory_estimate_counts_weights_and_cache_per_device():
  cfg = TINY
  model = shapes.abstract_model(cfg)
  prompts = jax.ShapeDtypeStruct((4, 16), jnp.int32)
  lens = jax.ShapeDtypeStruct((4,), jnp.int32)
  samp = sj.Sampling(temperature=jax.ShapeDtypeStruct((4,), jnp.float32),
                     top_k=jax.ShapeDtypeStruct((4,), jnp.int32),
                     top_p=jax.ShapeDtypeStruct((4,), jnp.float32))
  with platform.lowering_for("tpu"):
    est = memory.estimate(sj.ModelTarget(cfg), model.params, None, None, prompt_tokens=prompts,
                          prompt_lens=lens, capacity=64, max_new_tokens=8, sampling=samp)
  assert est.weights == cfg.num_params * 2
  assert est.kv_cache == 2 * cfg.num_layers * 4 * 64 * cfg.num_kv_heads * cfg.head_dim * 2
  assert memory.fits(est, 10 ** 9) and not memory.fits(est, est.resident // 2)
  with pytest.raises(ValueError, match="GiB per device"):
    memory.check_fits(est, est.resident // 2)
  # A penalty on: the decode also carries each row's token history (int32 counts and a bool
  # prompt mask, [B, V] each).
  with platform.lowering_for("tpu"):
    with_history = memory.estimate(sj.ModelTarget(cfg), model.params, None, None,
                                   prompt_tokens=prompts, prompt_lens=lens, capacity=64,
                                   max_new_tokens=8, sampling=samp, history=True)
  assert with_history.state - est.state == 4 * cfg.vocab_size * (4 + 1)


def test_memory_estimate_splits_a_drafters_cache_by_heads_on_model():
  """A draft model's KV cache in the decode state counts one model shard per device, as the
  compiler splits it (its kv heads on "model"), and the other state by rows on "data"."""
  import types
  cache = jax.eval_shape(lambda: KVCache.zeros(TINY, 4, 64, head_major=True))
  tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)
  whole = memory.state_bytes((tokens, {"cache": cache}), 4)
  mesh = types.SimpleNamespace(axis_names=("data", "model"), devices=np.empty((2, 2)))
  split = memory.state_bytes((tokens, {"cache": cache}), 4, mesh)
  cache_whole = memory.cache_bytes(cache)
  assert TINY.num_kv_heads % 2 == 0
  assert whole == cache_whole + 4 * 64 * 4
  assert split == cache_whole // 4 + 4 * 64 * 4 // 2


def test_memory_estimate_splits_a_feature_heads_cache_by_heads_on_model():
  """A feature head's one-layer cache (FeatureHeadState k, v) counts one model shard per
  device, in either layout, as XLA:TPU holds it ([8, 2, 4096, 128] per device for an 8B
  EAGLE-3 head under model=4); its next_feature by rows."""
  import types
  from spec_jax.drafters.feature_head import FeatureHeadState
  mesh = types.SimpleNamespace(axis_names=("data", "model"), devices=np.empty((2, 2)))
  sds = jax.ShapeDtypeStruct
  feature = sds((4, 32), jnp.float32)
  for shape in ((4, 64, 2, 16), (4, 2, 64, 16)):           # [B, S, Hkv, Dh], head-major
    state = FeatureHeadState(k=sds(shape, jnp.bfloat16), v=sds(shape, jnp.bfloat16),
                             next_feature=feature)
    cache = 2 * 4 * 64 * 2 * 16 * 2
    assert memory.state_bytes(state, 4, capacity=64) == cache + 4 * 32 * 4
    assert memory.state_bytes(state, 4, mesh, capacity=64) == cache // 4 + 4 * 32 * 4 // 2


def test_memory_estimate_splits_a_hybrid_cache_as_its_family_does():
  """The hybrid family's cache: its KV split like every KVCache, its recurrent buffers (state,
  conv and their per-step copies, [L, B, ...]) by rows on "data" and replicated on "model"
  (qwen3_next.cache.constrain_cache). Counted as KV buffers before, a data=8 estimate was 3.7x
  the bytes a device holds."""
  import types
  from tests.hybrid_helpers import TINY_QWEN3_NEXT
  cfg = sj.ModelConfig(**TINY_QWEN3_NEXT)
  cache = jax.eval_shape(lambda: sj.KVCache.zeros(cfg, 8, 64))
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  kv, rest = nbytes(cache.kv), nbytes(cache) - nbytes(cache.kv)
  assert kv and rest
  for data, model in ((8, 1), (2, 2), (1, 2)):
    mesh = types.SimpleNamespace(axis_names=("data", "model"), devices=np.empty((data, model)))
    assert memory.cache_bytes(cache, mesh) == kv // (data * model) + rest // data, (data, model)


_BUFFER_REPORT = """\
allocation 0: size 1024, parameter 0, shape |f32[256]| at ShapeIndex {}:
allocation 1: size 4096, maybe-live-out:
allocation 2: size 3000, preallocated-temp:
 value: <1 fusion @0> (size=3000,offset=0): f32[750]{0}
allocation 3: size 700, color 1, preallocated-temp:
allocation 4: size 20, color 2, preallocated-temp:
allocation 5: size 512, thread-local:
"""


def test_compiled_temporaries_split_into_device_memory_and_on_chip_scratch(tmp_path):
  """memory_analysis() sums the temporaries of every memory space (on TPU the core's VMEM and
  SMEM scratch beside HBM); the dumped buffer assignment splits them, and the peak and the
  fit count device memory only. On CPU (one memory space) the split changes nothing."""
  (tmp_path / "module_0003.jit_program.x.after_optimizations-buffer-assignment.txt").write_text(
      _BUFFER_REPORT)
  (tmp_path / "module_0001.jit_small.x.after_optimizations-buffer-assignment.txt").write_text(
      "allocation 0: size 8, preallocated-temp:\n")
  assert memory.buffer_report_temporaries(str(tmp_path)) == {0: 3000, 1: 700, 2: 20}
  assert memory.buffer_report_temporaries(str(tmp_path / "none")) is None

  class Stats:      # the compiled executable's memory_analysis(), as XLA:TPU reports it
    argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 1024, 4096, 0
    temp_size_in_bytes, generated_code_size_in_bytes = 3720, 0

  compiled = type("Compiled", (), {"memory_analysis": lambda self: Stats()})()
  figures = memory.compiled_figures(compiled, dump_dir=str(tmp_path))
  assert figures["temporaries"] == 3720
  assert (figures["device_temporaries"], figures["on_chip_temporaries"]) == (3000, 720)
  est = memory.Estimate(weights=1024, drafter_weights=0, kv_cache=0, state=0, compiled=figures)
  assert est.peak == 1024 + 3000 + 4096
  assert "in device memory" in est.describe() and "on-chip scratch" in est.describe()
  est.compiled = memory.compiled_figures(compiled)           # no dump: the sum, as before
  assert est.peak == 1024 + 3720 + 4096 and "device_temporaries" not in est.compiled

  f = jax.jit(lambda x: jnp.sin(x @ x.T).sum(0))
  dump = tmp_path / "cpu"
  cpu = memory.compiled_figures(f.lower(jnp.ones((64, 64))).compile({"xla_dump_to": str(dump)}),
                                dump_dir=str(dump))
  assert cpu["device_temporaries"] == cpu["temporaries"] > 0
  assert cpu["on_chip_temporaries"] == 0


def test_aot_cli_refuses_bad_arguments(capsys):
  from spec_jax.aot.cli import main
  assert main(["--model", "no-such-config", "--platform", "cuda"]) == 2
  assert "not a config.json, a folder holding one, or one of" in capsys.readouterr().err
  assert main(["--model", "llama-3.2-1b", "--platform", "cuda", "--mesh", "rows=2"]) == 2
  assert main(["--model", "llama-3.2-1b", "--platform", "cuda", "--drafter", "medusa"]) == 2
  capsys.readouterr()
  # The command line's own checks (these reached libtpu or the compile before).
  for argv, said in ((["--platform", "rocm"], "--platform 'rocm': use cuda, one of"),
                     (["--platform", "cuda", "--batch", "0"], "--batch must be >= 1"),
                     (["--platform", "cuda", "--capacity", "16", "--prompt-len", "64"],
                      "--prompt-len 64 must be below --capacity 16")):
    assert main(["--model", "llama-3.2-1b", *argv]) == 2
    assert said in capsys.readouterr().err
  from spec_jax.aot.cli import check_arguments, parser
  check_arguments(parser().parse_args(["--model", "m", "--platform", "tpu:v6e:2x4"]))


@pytest.mark.parametrize("kernel,head_major", [("gpu", False), ("tpu", False), ("tpu", True),
                                               ("gpu", True)])
def test_kernels_read_a_stacked_caches_layer_in_place(kernel, head_major):
  """layer=: the kernel reads slab `layer` of [L, B, S, Hkv, D] (no per-call copy of the layer's
  cache, issue 35) and equals the reference on that slab."""
  import kernels_pallas
  from kernels_pallas.reference import verify_attention_reference
  ks = jax.random.split(jax.random.key(7), 4)
  b, t, hq, hkv, d, s, layers = 2, 3, 4, 2, 128, 64, 3
  q = jax.random.normal(ks[0], (b, t, hq, d))
  k = jax.random.normal(ks[1], (layers, b, s, hkv, d))
  v = jax.random.normal(ks[2], (layers, b, s, hkv, d))
  lengths = jnp.asarray([10, 64], jnp.int32)
  mask = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0).at[1, 2, 1].set(False)
  want = verify_attention_reference(q, k[1], v[1], lengths, mask)
  if head_major:                       # [L, B, Hkv, S, D]: the TPU kernel's own layout
    k, v = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)
  got = kernels_pallas.verify_attention(q, k, v, lengths, mask, impl="pallas", kernel=kernel,
                                        layer=1, block_k=16, head_major=head_major)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  with pytest.raises(ValueError, match="layer must be a static int"):
    kernels_pallas.verify_attention(q, k, v, lengths, impl="pallas", layer=3)


def test_vocab_sized_gathers_reads_the_shapes_xla_tpu_gathers_a_vocabulary_in():
  """The AOT check's count: an axis of V or two adjacent axes multiplying to V, in a sync or
  an async all-gather; activations and small gathers are not counted."""
  hlo = "\n".join([
      "  %all-gather.97 = f32[4,32064,8]{1,2,0:T(8,128)} all-gather(%p), dimensions={0}",
      "  %all-gather.3 = f32[8,1,128256]{2,1,0} all-gather(%q), dimensions={2}",
      "  %ags = (f32[8,32064]{1,0}, f32[8,128256]{1,0}) all-gather-start(%r), dimensions={1}",
      "  %all-gather.4 = f32[8,1,128]{2,1,0} all-gather(%s), dimensions={2}",
      "  %all-gather.5 = bf16[8,128,2048]{2,1,0} all-gather(%t), dimensions={2}",
      "  %fusion.1 = f32[4,32064,8]{1,2,0} fusion(%all-gather.97), kind=kLoop",
  ])
  assert program.vocab_sized_gathers(hlo, 128_256) == 3
  assert program.vocab_sized_gathers(hlo, 32_000) == 0


def test_a_vocabulary_sharded_four_ways_is_drawn_without_gathering_it():
  """sampling.sample over weights [8, 128256] sharded on the vocabulary across 4 CPU devices:
  the compiled draw has no vocabulary-sized all-gather (the AOT check's counter) and draws the
  one-device tokens. With one part (blocks from token 0 across the shard boundaries, the
  layout before sampling.sample_layout) the same script finds the gathers: the check can fail."""
  _run("""
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import spec_jax as sj
    from spec_jax import sampling_draw
    from spec_jax.aot.program import vocab_sized_gathers
    V = 128_256
    mesh = Mesh(np.array(jax.devices()), ("model",))
    w = jax.random.uniform(jax.random.key(0), (8, V)) ** 16
    keys = jax.random.split(jax.random.key(1), 8)
    sharded = jax.device_put(w, NamedSharding(mesh, P(None, "model")))

    def draw(parts):
      sampling_draw.SAMPLE_PARTS = parts           # where sample_layout reads it
      fn = jax.jit(jax.vmap(sj.sampling.sample))
      gathers = vocab_sized_gathers(fn.lower(keys, sharded).compile().as_text(), V)
      return gathers, np.asarray(fn(keys, sharded)), np.asarray(fn(keys, w))

    gathers, on_mesh, on_one = draw(16)
    assert gathers == 0, gathers
    assert np.array_equal(on_mesh, on_one), (on_mesh, on_one)
    gathers_before, _, _ = draw(1)
    assert gathers_before > 0, "the counter should see the one-part layout's gathers"
    print("OK", gathers_before)
  """, devices=4)
