"""The suite's own settings (tests/conftest.py, pyproject.toml): a test marked `optimized`
compiles at LLVM O1 while the rest of the suite compiles at O0, and the long files are handed to
the xdist workers first. If jax renames what the marker patches, the marker silently compiles at
O0 again; if xdist reorders the files or a listed file is renamed, the order silently stops
mattering; these tests say so."""

import pathlib

import pytest
from jax._src import compiler

from .conftest import _LONG_FILES, optimized_compiles


def _overrides() -> dict:
  return dict(compiler.get_compile_options(num_replicas=1, num_partitions=1)
              .env_option_overrides)


def test_unmarked_tests_compile_with_the_flags_alone():
  assert "xla_backend_optimization_level" not in _overrides()
  with optimized_compiles():
    assert _overrides()["xla_backend_optimization_level"] == 1
  assert "xla_backend_optimization_level" not in _overrides()     # restored


@pytest.mark.optimized
def test_a_marked_test_compiles_at_o1():
  assert _overrides()["xla_backend_optimization_level"] == 1


def test_the_longest_first_order_names_real_files_and_xdist_keeps_it(pytestconfig):
  here = pathlib.Path(__file__).parent
  missing = [name for name in _LONG_FILES if not (here / name).is_file()]
  assert not missing, f"tests/conftest.py's _LONG_FILES names files that do not exist: {missing}"
  assert len(set(_LONG_FILES)) == len(_LONG_FILES)
  # addopts is an "args" ini value: pytest gives it split into a list
  assert "--no-loadscope-reorder" in pytestconfig.getini("addopts")   # else xdist sorts by test count


def test_float32_tolerance_ignores_masked_logits_and_still_catches_a_difference():
  """tests/numerics.py scales its tolerance by the reference's largest *finite* magnitude: a
  reduced draft vocabulary's -inf logits once made it infinite, and the comparison of
  test_heads_draft_in_the_cpu_execution_layout[eagle3-reduced] asserted nothing."""
  import numpy as np

  from .numerics import EPS32, MODEL_ULPS, assert_f32_close, f32_atol
  want = np.array([[-np.inf, 2.0, -3.0, -np.inf]], np.float32)
  assert f32_atol(want, MODEL_ULPS) == MODEL_ULPS * EPS32 * 3.0
  assert f32_atol(np.full(3, -np.inf)) == f32_atol(np.zeros(3))     # nothing finite: scale 1
  assert_f32_close(want + np.float32(1e-6) * np.isfinite(want), want, MODEL_ULPS)
  with pytest.raises(AssertionError):
    assert_f32_close(np.where(np.isfinite(want), want + 0.01, want), want, MODEL_ULPS)
  with pytest.raises(AssertionError):     # a masked entry must stay masked
    assert_f32_close(np.nan_to_num(want, neginf=-1e9), want, MODEL_ULPS)
