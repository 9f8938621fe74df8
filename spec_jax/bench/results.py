"""What a run records: the machine and commit it ran on, progress lines (JSON is written
atomically by spec_jax.files).

Shared by `python -m spec_jax.bench` and `python -m spec_jax.eval`.
"""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA_VERSION = 1


def log(msg: str) -> None:
  """A progress line on stderr (stdout carries the tables)."""
  print(msg, file=sys.stderr, flush=True)


def machine_info() -> dict:
  """Platform, Python, JAX backend and devices, load average, git commit (and dirty files)."""
  import jax
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "cpu_count": os.cpu_count(), "jax": jax.__version__,
          "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}
  device_kinds = sorted({getattr(d, "device_kind", "") for d in jax.devices()} - {""})
  if device_kinds:
    info["device_kind"] = device_kinds
  try:
    info["loadavg_start"] = os.getloadavg()
  except OSError:
    pass
  try:
    info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                        capture_output=True, timeout=10).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "spec_jax", "kernels_pallas"], cwd=ROOT,
        text=True, capture_output=True, timeout=10).stdout.split("\n")
    info["git_dirty"] = [x for x in dirty if x.strip()]
  except (OSError, subprocess.SubprocessError):
    pass
  return info
