"""The suite's own compile settings (tests/conftest.py): a test marked `optimized` compiles at
LLVM O1 while the rest of the suite compiles at O0. If jax renames what the marker patches, the
marker silently compiles at O0 again and these tests say so."""

import pytest
from jax._src import compiler

from .conftest import optimized_compiles


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
