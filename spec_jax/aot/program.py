"""The whole decode, compiled for a platform that is not here: XLA:TPU through a compile-only
topology (libtpu, no chip), or exported for CUDA (StableHLO with the Triton kernels' calls).

`compile_decode` traces exactly what generate() compiles (decoding.compiled._packed_decode:
prefill + the strategy's rounds in one program), under `kernels_pallas.platform.lowering_for`
so that every backend choice is the target platform's, with the weights in the execution
layout that `models.layout.prepare_model` builds outside the jit, then reads the compiler's
verdict: per-device memory (arguments, temporaries) and how many Pallas kernel calls the
program holds (Mosaic `tpu_custom_call`s / Triton calls).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import tempfile
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kernels_pallas import lanes, platform as platform_lib
from spec_jax import memory, sharding as sharding_lib
from spec_jax.decoding.compiled import _DECODE_STATIC, _packed_decode
from spec_jax.decoding.strategies import strategy_for
from spec_jax.decoding.target import as_target
from spec_jax.models.layout import execution_layout
from spec_jax.sampling import Sampling
from spec_jax.drafters.draft_model import DraftModel

# --platform values: a TPU topology (jax.experimental.topologies name) or cuda.
TPU_TOPOLOGIES = {"tpu:v5e": "v5e:1x1", "tpu:v5e-4": "v5e:2x2", "tpu:v5e-8": "v5e:2x4",
                  "tpu:v6e": "v6e:1x1", "tpu:v6e-4": "v6e:2x2", "tpu:v6e-8": "v6e:2x4",
                  "tpu:v5p": "v5p:2x2x1"}
TPU_MARKER = "tpu_custom_call"
TRITON_MARKER = "xla.gpu.triton"


@dataclasses.dataclass
class Report:
  """One compile: what was asked, the memory per device, the kernels found, the time taken."""
  label: str
  platform: str
  mesh: Optional[str]
  devices: int
  estimate: memory.Estimate
  device_bytes: Optional[int]
  kernel_calls: int
  seconds: float
  cache_dtype: str
  vocab_gathers: Optional[int] = None   # TPU: all-gathers of vocabulary-sized buffers

  @property
  def fits(self) -> bool:
    return memory.fits(self.estimate, self.device_bytes)

  def as_dict(self) -> dict:
    e = self.estimate
    return {"label": self.label, "platform": self.platform, "mesh": self.mesh,
            "devices": self.devices, "weights": e.weights, "drafter_weights": e.drafter_weights,
            "kv_cache": e.kv_cache, "state": e.state, "compiled": e.compiled,
            "peak": e.peak, "overhead": e.overhead, "device_bytes": self.device_bytes,
            "fits": self.fits, "kernel_calls": self.kernel_calls,
            "cache_dtype": self.cache_dtype, "vocab_gathers": self.vocab_gathers,
            "seconds": round(self.seconds, 1)}


def vocab_sized_gathers(hlo_text: str, vocab: int) -> int:
  """How many all-gathers of the optimised HLO produce a buffer with a vocabulary-sized axis:
  an axis of `vocab` elements, or two adjacent axes whose product is `vocab` (the [shards,
  V / shards, rows] form XLA:TPU gathers a vocabulary-sharded [rows, V] in). Under a mesh that
  splits the vocabulary, each is a whole distribution moved between the chips at every draw
  (sampling.sample_layout explains the one that was there)."""
  found = 0
  for line in hlo_text.splitlines():
    op = re.search(r"= (.*?) all-gather(?:-start)?\(", line)
    if not op:
      continue
    for dims in re.findall(r"\[([\d,]+)\]", op.group(1)):
      axes = [int(d) for d in dims.split(",")]
      pairs = [a * b for a, b in zip(axes, axes[1:])]
      if vocab in axes or vocab in pairs:
        found += 1
        break
  return found


def topology_devices(platform: str, count: int) -> list:
  """`count` devices of the compile-only TPU topology named by --platform (tpu:v5e-8, ...;
  also tpu:v5e:2x4 spelled out): needs libtpu (pip install 'spec_jax[aot]')."""
  from jax.experimental import topologies
  name = TPU_TOPOLOGIES.get(platform, platform.partition(":")[2])
  kwargs = {"chips_per_host_bounds": (1, 1, 1)} if name.endswith(":1x1") else {}
  try:
    topo = topologies.get_topology_desc(name, "tpu", **kwargs)
  except Exception as e:  # noqa: BLE001 - no libtpu, or an unknown topology
    raise ValueError(f"cannot make the TPU topology {name!r} ({e}); install libtpu "
                     f"(pip install -e '.[aot]') and name one of {sorted(TPU_TOPOLOGIES)} "
                     f"or tpu:vXX:AxB") from e
  if len(topo.devices) < count:
    raise ValueError(f"--mesh needs {count} devices but {platform} ({name}) has "
                     f"{len(topo.devices)}")
  return list(topo.devices[:count])


def make_mesh(devices: list, data: int, model: int) -> Mesh:
  auto = (jax.sharding.AxisType.Auto,) * 2
  return Mesh(np.array(devices).reshape(data, model), ("data", "model"), axis_types=auto)


def _sds(x, sharding):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_call(model, drafter, *, batch: int, prompt_len: int, capacity: int, mesh,
                  device, num_draft, tree, greedy: bool, stop_count: int = 1,
                  prepared: bool = True):
  """(program, abstract args, static) of one decode as generate() makes it. prepared: the
  weights in their execution layout (prepare_model's, built outside the jit), else canonical."""
  config = model.config
  with_sharding = (lambda tree_, spec: jax.tree.map(
      lambda x: _sds(x, NamedSharding(mesh, spec)), tree_)) if mesh is not None else (
      lambda tree_, spec: jax.tree.map(
          lambda x: _sds(x, jax.sharding.SingleDeviceSharding(device)), tree_))
  params = model.params
  if prepared:
    params = jax.eval_shape(functools.partial(execution_layout, config=config, mesh=mesh),
                            params)
  dparams = None if drafter is None else drafter_layout(drafter, mesh, prepared)
  if mesh is not None:
    params = jax.tree.map(_sds, params, sharding_lib.param_shardings(mesh, params))
    dparams = (None if drafter is None else jax.tree.map(
        _sds, dparams, sharding_lib.param_shardings(mesh, dparams)))
  else:
    params = with_sharding(params, P())
    dparams = None if drafter is None else with_sharding(dparams, P())
  i32 = jnp.int32
  rows = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  prompts = with_sharding(rows((batch, prompt_len), i32), P("data"))
  lens = with_sharding(rows((batch,), i32), P("data"))
  key = with_sharding(jax.eval_shape(lambda: jax.random.key(0)), P())
  sampling = with_sharding(jax.eval_shape(lambda: Sampling().rows(batch)), P("data"))
  max_new = with_sharding(rows((), i32), P())
  stop = with_sharding(rows((stop_count,), i32), P())
  # history=False: generate() compiles without the penalties' token history unless a
  # repetition / presence / frequency penalty is on (Sampling.needs_history), as here.
  static = dict(config=config, drafter=drafter, num_draft=num_draft, capacity=capacity,
                mesh=mesh, greedy=greedy, history=False)
  if tree is not None:
    static["tree"] = tree

  def program(params, prompts, lens, key, dparams, max_new, sampling, stop):
    return _packed_decode([], params, prompts, lens, key, drafter_params=dparams,
                          max_new_tokens=max_new, sampling=sampling, stop_tokens=stop,
                          **static)

  assert set(static) <= set(_DECODE_STATIC)
  return program, (params, prompts, lens, key, dparams, max_new, sampling, stop), static


def drafter_layout(drafter, mesh, prepared: bool = True):
  """The drafter's params as decode receives them: a draft model's in its execution layout
  (prepare_model, outside the jit), other drafters' through their own prepare."""
  if not prepared:
    return drafter.params
  if isinstance(drafter, DraftModel):
    return jax.eval_shape(functools.partial(execution_layout, config=drafter.config, mesh=mesh),
                          drafter.params)
  return jax.eval_shape(drafter.prepare, drafter.params)


def decode_estimate(model, drafter, args, static, mesh) -> memory.Estimate:
  """The shape-only memory estimate of the call (spec_jax.memory.estimate)."""
  params, prompts, lens, _, dparams, _, sampling, _ = args
  strategy = strategy_for(static.get("strategy"), static["drafter"], static["num_draft"],
                          static.get("tree"))
  return memory.estimate(as_target(model.config), params, drafter, dparams,
                         prompt_tokens=prompts, prompt_lens=lens,
                         capacity=static["capacity"], max_new_tokens=8, sampling=sampling,
                         mesh=mesh, strategy=strategy, history=static.get("history", False))


def cache_dtype(model, static, mesh=None) -> str:
  """The KV cache's dtype and layout the traced program uses (defect 3's witness), with the
  lane packing of a head_dim < 128 cache (kernels_pallas.lanes) when a single stacked buffer
  shows it: e.g. "bfloat16 head-major, 2 heads per 128 lanes"."""
  with contextlib.nullcontext() if mesh is None else platform_lib.kernel_mesh(mesh):
    cache = jax.eval_shape(lambda: as_target(model.config).init_cache(2, 8))
  leaf = jax.tree.leaves(cache)[0]
  text = f"{leaf.dtype}{' head-major' if getattr(cache, 'head_major', False) else ''}"
  head_dim = getattr(model.config, "head_dim", None)
  k = getattr(cache, "k", None)
  if getattr(cache, "head_major", False) and hasattr(k, "shape") and head_dim:
    packed = lanes.packing(k.shape[-1], head_dim)
    if packed > 1:
      text += f", {packed} heads per {k.shape[-1]} lanes"
  return text


def compile_decode(model, drafter, *, platform: str, data: int = 1, model_axis: int = 1,
                   use_mesh: bool = True, batch: int = 8, prompt_len: int = 512,
                   capacity: int = 4096, num_draft=4, tree=None, greedy: bool = False,
                   label: str = "", devices: Optional[list] = None) -> Report:
  """Compiles (TPU) or exports (cuda) one decode; returns its Report. use_mesh False: one
  device, no mesh (the single-chip layout). devices: for cuda, the host devices the mesh
  spans (exports need concrete devices; any kind)."""
  start = time.perf_counter()
  target_platform = "gpu" if platform == "cuda" else "tpu"
  count = data * model_axis if use_mesh else 1
  if platform == "cuda":
    devices = list(devices or jax.devices())[:count]
    if len(devices) < count:
      raise ValueError(f"a cuda export over {count} devices needs {count} host devices: run "
                       f"with XLA_FLAGS=--xla_force_host_platform_device_count={count}")
  else:
    devices = topology_devices(platform, count)
  mesh = make_mesh(devices, data, model_axis) if use_mesh else None
  with platform_lib.lowering_for(target_platform):
    program, args, static = abstract_call(
        model, drafter, batch=batch, prompt_len=prompt_len, capacity=capacity, mesh=mesh,
        device=devices[0], num_draft=num_draft, tree=tree, greedy=greedy)
    est = decode_estimate(model, drafter, args, static, mesh)
    kv_dtype = cache_dtype(model, static, mesh)
    if platform == "cuda":
      triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
      exported = jax.export.export(jax.jit(program), platforms=["cuda"],
                                   disabled_checks=[triton])(*args)
      text, device_bytes = exported.mlir_module(), None
      calls = text.count(TRITON_MARKER)
    else:
      lowered = jax.jit(program).trace(*args).lower(lowering_platforms=("tpu",))
      # The buffer assignment XLA dumps splits the temporaries into HBM and on-chip scratch
      # (memory_analysis() sums them: memory.compiled_figures).
      # SPEC_JAX_AOT_DUMP=DIR keeps XLA's dump (buffer reports *memory-usage-report.txt,
      # *live-range.txt) in DIR: the compile option overrides XLA_FLAGS' --xla_dump_to.
      keep = os.environ.get("SPEC_JAX_AOT_DUMP")
      with (contextlib.nullcontext(keep) if keep else
            tempfile.TemporaryDirectory(prefix="spec_jax_aot_")) as dump:
        compiled = lowered.compile({"xla_dump_to": dump})
        est.compiled = memory.compiled_figures(compiled, dump_dir=dump)
      gathers = vocab_sized_gathers(compiled.as_text(), model.config.vocab_size)
      text = lowered.as_text()
      calls = text.count(TPU_MARKER)
      device_bytes = memory.device_memory(devices[0])
  mesh_text = f"data={data},model={model_axis}" if use_mesh else None
  return Report(label=label, platform=platform, mesh=mesh_text, devices=count, estimate=est,
                device_bytes=device_bytes, kernel_calls=calls,
                seconds=time.perf_counter() - start, cache_dtype=kv_dtype,
                vocab_gathers=None if platform == "cuda" else gathers)

