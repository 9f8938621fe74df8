"""The platform a program is being lowered for, and the mesh its kernels are partitioned over.

Every backend-dependent choice in spec_jax (which verify-attention kernel runs, the KV-cache
layout, the weights' execution layout, the activation dtype) asks `current()` here, never
`jax.default_backend()` directly: the backend of the running process is the default, but an
ahead-of-time lowering for another platform (`jax.export(..., platforms=["tpu"])` or a TPU
compile-only topology from a CPU host: `python -m spec_jax.aot`) sets it with

    with kernels_pallas.platform.lowering_for("tpu"):
      exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*abstract_args)

so that the traced program is the accelerator's, not the host's.

`kernel_mesh` is the second piece of trace-time context: the ("data", "model") mesh a decode
runs under. A Pallas kernel is an opaque custom call that XLA cannot partition (Mosaic refuses,
Triton's operands would be all-gathered), so under a mesh the dispatcher wraps it in a
`shard_map` over that mesh (rows on "data", KV heads on "model"); `spec_jax.decode` sets it from
its `mesh` argument. Both contexts are read at trace time only (static Python state): they
change what is traced, never a traced value.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
# jax's names for lowering platforms -> the backend family the kernels know.
_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}

_PLATFORM: contextvars.ContextVar = contextvars.ContextVar("spec_jax_platform", default=None)
_MESH: contextvars.ContextVar = contextvars.ContextVar("spec_jax_kernel_mesh", default=None)


def normalize(platform: str) -> str:
  """'cuda' / 'rocm' / 'gpu' -> 'gpu'; 'tpu', 'cpu' as they are; ValueError otherwise."""
  key = str(platform).lower()
  if key not in _ALIASES:
    raise ValueError(f"platform must be one of {sorted(_ALIASES)}, got {platform!r}")
  return _ALIASES[key]


def current() -> str:
  """'cpu', 'gpu' or 'tpu': the platform set by lowering_for, else this process's backend."""
  chosen = _PLATFORM.get()
  return chosen if chosen is not None else normalize(jax.default_backend())


def is_cpu() -> bool:
  """Whether the program being traced runs on XLA:CPU (the CPU-specific layouts apply)."""
  return current() == "cpu"


@contextlib.contextmanager
def lowering_for(platform: Optional[str]):
  """Within the block, current() is `platform` (None: the process's backend again)."""
  token = _PLATFORM.set(None if platform is None else normalize(platform))
  try:
    yield
  finally:
    _PLATFORM.reset(token)


def mesh():
  """The mesh set by kernel_mesh (None: the kernels run whole, unpartitioned)."""
  return _MESH.get()


def mesh_axis_size(name: str) -> int:
  """The size of axis `name` of the kernel mesh (1 without a mesh or without that axis)."""
  m = _MESH.get()
  if m is None or name not in m.axis_names:
    return 1
  return dict(zip(m.axis_names, m.devices.shape))[name]


@contextlib.contextmanager
def kernel_mesh(mesh_):
  """Within the block, verify-attention kernels are shard_mapped over `mesh_` (a Mesh with
  axes "data" and "model", or None for none)."""
  token = _MESH.set(mesh_)
  try:
    yield
  finally:
    _MESH.reset(token)
