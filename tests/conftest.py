"""Shared fixtures: paths to ../shared, small random model configs."""

import os
import pathlib

# Tests run tiny shapes where XLA's compile time dominates: a lower LLVM optimisation level
# compiles ~2.5x faster. Set before jax is imported; benchmarks never import this file.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_backend_optimization_level=0"
                           " --xla_llvm_disable_expensive_passes=true").strip()

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = pathlib.Path(os.environ.get("SPEC_JAX_SHARED", ROOT.parent / "shared"))
MODELS = SHARED / "models"
DATA = SHARED / "data"


def need_shared(*parts):
  """Skips the test with a clear reason when a file of ../shared is absent."""
  path = SHARED.joinpath(*parts)
  if not path.exists():
    pytest.skip(f"{path} is absent (../shared is beside the repository in CI)")
  return path
