"""What a run records: JSON written atomically, the machine and commit it ran on, progress lines.

Shared by `python -m spec_jax.bench` and `python -m spec_jax.eval`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA_VERSION = 1


def log(msg: str) -> None:
  """A progress line on stderr (stdout carries the tables)."""
  print(msg, file=sys.stderr, flush=True)


def _json_default(x):
  if hasattr(x, "tolist"):
    return x.tolist()
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  return str(x)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def atomic_write_text(path, text: str) -> None:
  """Writes `text` to a temporary file beside `path`, then renames it over `path`: a reader (or
  a run killed mid-write) sees the old file or the new one, never half of one."""
  atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path, data: bytes) -> None:
  """atomic_write_text for bytes (PNG plots)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.chmod(tmp, 0o666 & ~_umask())       # mkstemp makes 0600; results are for reading
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def atomic_write_json(path, data) -> None:
  """`data` as indented JSON (arrays via .tolist(), dataclasses as dicts), written atomically."""
  atomic_write_text(path, json.dumps(data, indent=1, default=_json_default) + "\n")


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
