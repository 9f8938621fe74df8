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
from typing import Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA_VERSION = 1


def log(msg: str) -> None:
  """A progress line on stderr (stdout carries the tables)."""
  print(msg, file=sys.stderr, flush=True)


# The instruction-set features that decide which kernels XLA:CPU (and llama.cpp) run, bf16
# products above all. A speedup over plain decoding moves with the host: the same Spec-Bench
# command read 1.60x on one VM host (an Intel Xeon with AMX, unrecorded at the time) and 1.32x
# on another (an AMD EPYC), where plain decoding ran 1.45x faster at the same code speed
# (docs/real_model.md).
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")


def cpu_info(cpuinfo_text: Optional[str] = None) -> dict:
  """{"model": the CPU's model name or None, "features": those of CPU_FEATURES it has}, from
  /proc/cpuinfo (its first "model name" and "flags" (x86) or "Features" (Arm) lines); where
  there is none, platform.processor() and no features. cpuinfo_text: that file's text."""
  if cpuinfo_text is None:
    try:
      cpuinfo_text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
      cpuinfo_text = ""
  model, flags = None, None
  for line in cpuinfo_text.splitlines():
    key, _, value = line.partition(":")
    key = key.strip()
    if key == "model name" and model is None:
      model = value.strip() or None
    elif key in ("flags", "Features") and flags is None:
      flags = set(value.split())
  return {"model": model or platform.processor() or None,
          "features": [f for f in CPU_FEATURES if f in (flags or ())]}


def describe_cpu(machine: dict) -> str:
  """A recorded machine's CPU for a report line: "AMD EPYC; avx2 avx512f avx512_bf16"; runs
  recorded before the field say so."""
  cpu = machine.get("cpu")
  if not cpu:
    return "CPU model not recorded"
  features = " ".join(cpu.get("features") or [])
  return (cpu.get("model") or "unknown CPU") + (f"; {features}" if features else "")


def machine_info() -> dict:
  """Platform, CPU model and features, Python, JAX backend and devices, load average, git
  commit (and dirty files)."""
  import jax
  info = {"platform": platform.platform(), "cpu": cpu_info(), "python": platform.python_version(),
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
