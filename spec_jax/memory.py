"""How much device memory a decode needs, before anything is compiled, and whether it fits.

  est = memory.estimate(target_config, params, drafter, drafter_params, batch=8,
                          capacity=4096, prompt_len=512, mesh=mesh)
  print(est.describe(device_bytes))          # weights, KV cache, drafter state per device
  memory.check_fits(est, device_bytes)       # ValueError naming what does not fit

Everything is computed from shapes (jax.eval_shape): the weights as given (per device under
their mesh partition, spec_jax.sharding), and the decode state that `init_loop` builds (the
target's KV cache, the drafter's caches, the token buffer) with the cache's partition. The
compiler's own figure (`compiled.memory_analysis()`: arguments, temporaries; split into HBM
and on-chip scratch by the buffer assignment when the compile dumped one) is added by
`compiled_figures` when an executable exists. Per-chip memory: the device's own `memory_stats()`
where a runtime reports it, else the table below (compile-only TPU topologies report none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import re
from typing import Optional

import jax
import numpy as np

import kernels_pallas
from spec_jax.decoding.loop import init_loop
from spec_jax.decoding.rounds import NoDrafter
from spec_jax.decoding.strategies import Chain, Strategy
from spec_jax.drafters.feature_head import FeatureHeadState
from spec_jax.models.cache import KVCache
from spec_jax.sharding import DATA, MODEL, param_shardings

GiB = 1024 ** 3

# HBM per chip by jax's device_kind (public spec sheets); compile-only topologies report none.
DEVICE_MEMORY = {
  "TPU v4": 32 * GiB,
  "TPU v5 lite": 16 * GiB,          # v5e
  "TPU v5": 95 * 10 ** 9,           # v5p
  "TPU v5p": 95 * 10 ** 9,
  "TPU v6 lite": 32 * GiB,          # v6e (Trillium)
  "NVIDIA H100 80GB HBM3": 80 * 10 ** 9,
  "NVIDIA H200": 141 * 10 ** 9,
  "NVIDIA A100-SXM4-80GB": 80 * 10 ** 9,
}
# What the runtime keeps for itself on a chip (XLA:TPU reserves some HBM; a margin on GPU).
RESERVED_FRACTION = 0.04


def device_memory(device) -> Optional[int]:
  """Bytes of memory one device has: its runtime's bytes_limit, else DEVICE_MEMORY by
  device_kind, else None (a CPU: host memory, not checked)."""
  try:
    stats = device.memory_stats()
  except Exception:          # compile-only devices and CPUs raise or return None
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  return DEVICE_MEMORY.get(getattr(device, "device_kind", None))


def _shards(spec, mesh) -> int:
  """How many pieces a PartitionSpec cuts an array into on mesh."""
  if mesh is None or spec is None:
    return 1
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  n = 1
  for entry in spec:
    for name in (entry if isinstance(entry, tuple) else (entry,)):
      if name is not None:
        n *= sizes[name]
  return n


def leaf_bytes(x) -> int:
  return int(math.prod(x.shape)) * np.dtype(x.dtype).itemsize


def params_bytes(params, mesh=None) -> int:
  """Bytes of a param pytree per device (the model partition of spec_jax.sharding)."""
  if params is None:
    return 0
  leaves = jax.tree.leaves(params)
  if mesh is None:
    return sum(leaf_bytes(x) for x in leaves)
  specs = jax.tree.leaves(param_shardings(mesh, params))
  return sum(leaf_bytes(x) // _shards(s.spec, mesh) for x, s in zip(leaves, specs))


def _axis_sizes(mesh) -> tuple:
  if mesh is None:
    return 1, 1
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  return sizes.get(DATA, 1), sizes.get(MODEL, 1)


def cache_bytes(cache, mesh=None) -> int:
  """Bytes per device of a spec_jax KV cache (KVCache: buffers [L, B, S, Hkv,
  Dh], head-major [L, B, Hkv, S, Dh]) under models.cache.constrain_cache's partition: rows on
  "data", kv heads on "model" where they divide. A family's own cache (the hybrid family's:
  a KVCache plus recurrent buffers [L, B, ...]) counts its KVCaches so and its other buffers
  with their rows (axis 1) on "data", replicated on "model" (its constrain_cache)."""
  if not isinstance(cache, KVCache):
    data, _ = _axis_sizes(mesh)
    parts = jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, KVCache))
    return sum(cache_bytes(x, mesh) if isinstance(x, KVCache) else
               leaf_bytes(x) // (data if x.ndim >= 2 and x.shape[1] % data == 0 else 1)
               for x in parts)
  data, model = _axis_sizes(mesh)
  head_axis = 2 if getattr(cache, "head_major", False) else 3
  total = 0
  for x in jax.tree.leaves(cache):
    n = leaf_bytes(x)
    if x.ndim == 5:
      n //= data if x.shape[1] % data == 0 else 1
      n //= model if x.shape[head_axis] % model == 0 else 1
    total += n
  return total


def rows_bytes(tree, batch: int, mesh=None) -> int:
  """Bytes per device of other decode-state arrays: split on "data" along a leading (or, rank
  5, second) axis of size `batch` when it divides; whole otherwise (an upper bound where the
  compiler splits more)."""
  data, _ = _axis_sizes(mesh)
  total = 0
  for x in jax.tree.leaves(tree):
    n = leaf_bytes(x)
    axis = 1 if x.ndim == 5 else 0
    if x.ndim >= 1 and x.shape[axis] == batch and batch % data == 0:
      n //= data
    total += n
  return total


def state_bytes(tree, batch: int, mesh=None, capacity: Optional[int] = None) -> int:
  """Bytes per device of decode state: the KVCaches in it (a draft model's) split like the
  target's (cache_bytes: the compiler shards them by kv heads on "model" too, e.g. a draft
  model's cache [L, B, Hkv / 4, S, Dh] per device under model=4 in XLA:TPU's program), a
  feature head's one-layer cache (FeatureHeadState k, v: [B, S, Hkv, Dh] or head-major
  [B, Hkv, S, Dh], S = capacity) likewise (XLA:TPU's 8B EAGLE-3 program under model=4 holds
  it as [8, 2, 4096, 128] per device), the other arrays by rows (rows_bytes)."""
  is_cache = lambda x: isinstance(x, (KVCache, FeatureHeadState))
  leaves = jax.tree.leaves(tree, is_leaf=is_cache)
  total = rows_bytes([x for x in leaves if not is_cache(x)], batch, mesh)
  data, model = _axis_sizes(mesh)
  for c in leaves:
    if isinstance(c, KVCache):
      total += cache_bytes(c, mesh)
    elif isinstance(c, FeatureHeadState):
      total += rows_bytes(c.next_feature, batch, mesh)
      for x in (c.k, c.v):
        n = leaf_bytes(x)
        n //= data if x.shape[0] % data == 0 else 1
        heads = x.shape[1] if capacity is not None and x.shape[2] == capacity else x.shape[2]
        n //= model if heads % model == 0 else 1
        total += n
  return total


@dataclasses.dataclass
class Estimate:
  """Bytes per device: weights (target), drafter_weights, kv_cache (the target's), state (the
  rest of the decode state: drafter caches, token buffers); compiled: the compiler's figures
  when known ({"arguments", "outputs", "temporaries", "code"}), else None."""
  weights: int
  drafter_weights: int
  kv_cache: int
  state: int
  compiled: Optional[dict] = None

  @property
  def resident(self) -> int:
    """What must be live whatever the compiler does: weights, caches, state."""
    return self.weights + self.drafter_weights + self.kv_cache + self.state

  @property
  def peak(self) -> int:
    """The compiler's live bytes in device memory (arguments + temporaries + outputs -
    aliased; the HBM temporaries when the buffer assignment is known) when compiled, else the
    resident estimate."""
    if not self.compiled:
      return self.resident
    c = self.compiled
    return c["arguments"] + device_temporaries(c) + c["outputs"] - c.get("aliased", 0)

  @property
  def overhead(self) -> Optional[int]:
    """Compiler live bytes beyond weights + caches + state (None before compiling)."""
    return None if not self.compiled else self.peak - self.resident

  def describe(self, device_bytes: Optional[int] = None) -> str:
    g = human
    parts = [f"weights {g(self.weights)}", f"KV cache {g(self.kv_cache)}"]
    if self.drafter_weights or self.state:
      # the state's largest part is a draft model's KV cache: the label says so
      parts.append(f"drafter {g(self.drafter_weights)} + decode state (drafter caches, "
                   f"token buffers) {g(self.state)}")
    text = "memory per device: " + ", ".join(parts) + f" = {g(self.resident)}"
    if self.compiled:
      c = self.compiled
      temps = f"temporaries {g(c['temporaries'])}"
      if "device_temporaries" in c:
        temps = (f"temporaries {g(c['device_temporaries'])} in device memory (+ "
                 f"{g(c['on_chip_temporaries'])} on-chip scratch)")
      text += f"; compiled: arguments {g(c['arguments'])}, {temps}, peak {g(self.peak)}"
    if device_bytes:
      verdict = "fits" if fits(self, device_bytes) else "DOES NOT FIT"
      text += f"; device {g(device_bytes)}: {verdict}"
    return text


def human(n: int) -> str:
  """Bytes as GiB (>= 0.1 GiB) or MiB."""
  return f"{n / GiB:.2f} GiB" if abs(n) >= GiB // 10 else f"{n / 2 ** 20:.1f} MiB"


def usable(device_bytes: int) -> int:
  return int(device_bytes * (1 - RESERVED_FRACTION))


def fits(est: Estimate, device_bytes: Optional[int]) -> bool:
  return device_bytes is None or est.peak <= usable(device_bytes)


def check_fits(est: Estimate, device_bytes: Optional[int], what: str = "this decode") -> None:
  """ValueError when `est` does not fit a device of device_bytes (None: not checked)."""
  if fits(est, device_bytes):
    return
  raise ValueError(
    f"{what} needs {est.peak / GiB:.2f} GiB per device but a device has "
    f"{usable(device_bytes) / GiB:.2f} GiB usable ({est.describe()}): use a mesh with "
    f"more devices (--mesh data=N,model=M), a smaller batch or capacity, or bfloat16 "
    f"weights")


def compiled_figures(compiled, dump_dir: Optional[str] = None) -> Optional[dict]:
  """The compiler's memory figures of an executable per device, or None when unavailable.

  temporaries: memory_analysis()'s temp size, which on TPU sums every memory space: HBM and
  the core's on-chip scratch (VMEM, SMEM), where XLA:TPU stages weights and activations.
  dump_dir: the folder the compile dumped into (compiler option xla_dump_to); its buffer
  assignment then splits that figure: device_temporaries (HBM, memory space 0: what competes
  with weights and KV cache for the chip's memory) and on_chip_temporaries (the rest)."""
  try:
    m = compiled.memory_analysis()
  except Exception:
    return None
  if m is None:
    return None
  figures = {"arguments": int(m.argument_size_in_bytes),
             "outputs": int(m.output_size_in_bytes),
             "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes),
             "code": int(m.generated_code_size_in_bytes)}
  spaces = buffer_report_temporaries(dump_dir) if dump_dir else None
  if spaces:
    figures["device_temporaries"] = spaces.get(0, 0)
    figures["on_chip_temporaries"] = sum(n for color, n in spaces.items() if color != 0)
  return figures


_TEMP_ALLOCATION = re.compile(r"^allocation \d+: size (\d+)(?:, color (\d+))?, preallocated-temp:",
                              re.M)


def buffer_report_temporaries(dump_dir: str) -> Optional[dict]:
  """{memory space (XLA colour): bytes} of the preallocated temporaries in the buffer
  assignment XLA dumped for the optimised program in dump_dir (the largest such report when
  several modules were dumped), or None when there is none. Colour 0 is the device's main
  memory (HBM); XLA:TPU's other colours are on-chip (1 VMEM, 2 SMEM, ...)."""
  best = None
  for path in pathlib.Path(dump_dir).glob("*after_optimizations-buffer-assignment.txt"):
    spaces = {}
    for size, color in _TEMP_ALLOCATION.findall(path.read_text()):
      spaces[int(color or 0)] = spaces.get(int(color or 0), 0) + int(size)
    if spaces and (best is None or sum(spaces.values()) > sum(best.values())):
      best = spaces
  return best


def device_temporaries(compiled: dict) -> int:
  """The compiler's temporaries in the device's main memory: the buffer assignment's HBM
  figure when known, else memory_analysis()'s (every memory space: an upper bound)."""
  return compiled.get("device_temporaries", compiled["temporaries"])


def estimate(target, params, drafter, drafter_params, *, prompt_tokens, prompt_lens, capacity,
             max_new_tokens, sampling, mesh=None,
             strategy: Strategy = Chain(0), history: bool = False) -> Estimate:
  """The Estimate of one decode from shapes alone (nothing compiled or run): params (the
  target's, any layout) and drafter_params per device, and the decode state init_loop builds
  (jax.eval_shape of it). Arguments as decoding.loop.init_loop takes them (arrays or
  ShapeDtypeStructs; strategy: the call's bound Strategy; history: whether the decode carries
  the penalties' token history, counts and prompt mask [B, V] each: Sampling.needs_history of
  the call's settings, as generate() decides it)."""
  drafter = NoDrafter() if drafter is None else drafter

  def state_of(p, dp, tokens, lens, samp):
    _, st = init_loop(p, tokens, lens, jax.random.key(0), config=target, drafter=drafter,
                      drafter_params=dp, max_new_tokens=max_new_tokens, capacity=capacity,
                      sampling=samp, greedy=False, mesh=None, strategy=strategy,
                      history=history)
    return st

  # Under the mesh's kernel context, as decode runs init_loop: the cache's lane packing
  # (models.cache.default_lane_pack) depends on the "model" axis.
  with contextlib.nullcontext() if mesh is None else kernels_pallas.platform.kernel_mesh(mesh):
    st = jax.eval_shape(state_of, params, drafter_params, prompt_tokens, prompt_lens, sampling)
  batch = prompt_tokens.shape[0]
  kv = cache_bytes(st.cache, mesh)
  rest = state_bytes((st.tokens, st.drafter_state, st.sampling_state), batch, mesh,
                     capacity=capacity)
  return Estimate(weights=params_bytes(params, mesh),
          drafter_weights=params_bytes(drafter_params, mesh),
          kv_cache=kv, state=rest)
