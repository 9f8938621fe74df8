"""JAX's persistent compilation cache, on by default in spec_jax's command-line tools.

A decode compiles in seconds (about 5 s for SmolLM2-135M on this project's 2-core CPU); the
persistent cache stores every executable on disk, so a second run of the same command, or a
chat session restarted, compiles nothing. The CLI (`python -m spec_jax generate`), the eval
harness and the benchmarks call `enable()` at start-up; library users opt in the same way (or
with JAX's own `jax_compilation_cache_dir` option).

Where: $SPEC_JAX_COMPILE_CACHE, else $XDG_CACHE_HOME/spec_jax/xla (~/.cache by default);
SPEC_JAX_COMPILE_CACHE=off leaves JAX's settings alone. A folder that cannot be made (a
read-only or missing home) runs without the cache, with a warning: it only saves time.

One limit, JAX's: its cache writes an entry in place and never replaces an existing one, so a
run killed while writing one leaves it truncated, and every later run warns "Error reading
persistent compilation cache entry" and compiles that program again (the output stays right).
Delete the folder (or that entry) to mend it.
"""

from __future__ import annotations

import os
import pathlib
import sys
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
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError as e:              # the cache only saves time: run without it
    print(f"warning: no compile cache ({folder}: {e.strerror or e}); every run compiles "
          f"anew (set SPEC_JAX_COMPILE_CACHE to a writable folder)", file=sys.stderr)
    return None
  jax.config.update("jax_compilation_cache_dir", os.fspath(folder))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return folder
