"""Shared fixtures: paths to ../shared, small random model configs."""

import os
import pathlib

import pytest

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
