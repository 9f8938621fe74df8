"""JAX's persistent compilation cache, on by default in spec_jax's command-line tools.

A decode compiles in seconds (about 5 s for SmolLM2-135M on this project's 2-core CPU); the
persistent cache stores every executable on disk, so a second run of the same command, or a
chat session restarted, compiles nothing. The CLI (`python -m spec_jax generate`), the eval
harness and the benchmarks call `enable()` at start-up; library users opt in the same way (or
with JAX's own `jax_compilation_cache_dir` option).

Where: $SPEC_JAX_COMPILE_CACHE, else $XDG_CACHE_HOME/spec_jax/xla (~/.cache by default);
SPEC_JAX_COMPILE_CACHE=off leaves JAX's settings alone.
"""

from __future__ import annotations

import os
import pathlib
from typing import Optional

_OFF = ("", "0", "off", "none", "false")


def default_dir() -> Optional[pathlib.Path]:
  """The cache folder, or None when SPEC_JAX_COMPILE_CACHE turns it off."""
  override = os.environ.get("SPEC_JAX_COMPILE_CACHE")
  if override is not None:
    return None if override.strip().lower() in _OFF else pathlib.Path(override).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "spec_jax" / "xla"


def enable(path=None) -> Optional[pathlib.Path]:
  """Turns on JAX's persistent compilation cache in `path` (default: default_dir()) for every
  executable, however quickly it compiled; returns the folder (None when turned off). A
  cache directory the user already configured for JAX is kept."""
  import jax
  if jax.config.jax_compilation_cache_dir:            # the user's own choice wins
    return pathlib.Path(jax.config.jax_compilation_cache_dir)
  folder = pathlib.Path(path).expanduser() if path is not None else default_dir()
  if folder is None:
    return None
  folder.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", os.fspath(folder))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return folder
