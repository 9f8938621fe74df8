"""Several processes, one program: starting jax's distributed runtime and small host collectives.

Every process of a multi-process run (a TPU pod slice: one process per host; several GPU hosts;
or `python -m spec_jax.launch` on one machine) runs the same program. Call `initialize()` first,
before any other jax call; the command lines (python -m spec_jax generate / eval,
python -m train.distill_heads) do.

Where the settings come from, in this order:

  SPEC_JAX_COORDINATOR=HOST:PORT, SPEC_JAX_NUM_PROCESSES=N, SPEC_JAX_PROCESS_ID=I
      set by spec_jax.launch for its children (then CPU collectives are gloo); set them by hand
      on GPU hosts without a cluster manager: the same coordinator (process 0's host and a free
      port) on every host, I = 0 .. N-1.
  SPEC_JAX_DISTRIBUTED=auto
      jax.distributed.initialize() with no arguments: jax detects the cluster itself on Cloud
      TPU (every host of a pod slice), under Slurm and Open MPI (one process per GPU by
      default), and reads JAX_COORDINATOR_ADDRESS when it is set.
  nothing set
      a single process; initialize() does nothing.

The collectives below exchange host data (numpy) through jax: every process must call them in
the same order, like any collective.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Callable, Mapping, Optional

import numpy as np

COORDINATOR = "SPEC_JAX_COORDINATOR"
NUM_PROCESSES = "SPEC_JAX_NUM_PROCESSES"
PROCESS_ID = "SPEC_JAX_PROCESS_ID"
AUTO = "SPEC_JAX_DISTRIBUTED"

_STARTED = False


def settings_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[dict]:
  """The jax.distributed.initialize keyword arguments the environment asks for: {} for
  auto-detection, None for a single process. ValueError on incomplete or malformed settings."""
  env = os.environ if env is None else env
  names = (COORDINATOR, NUM_PROCESSES, PROCESS_ID)
  given = [n for n in names if env.get(n)]
  if not given:
    if env.get(AUTO, "").strip().lower() in ("1", "auto", "true", "yes"):
      return {}
    return None
  if len(given) != len(names):
    missing = sorted(set(names) - set(given))
    raise ValueError(f"multi-process settings are incomplete: {', '.join(given)} set but "
                     f"{', '.join(missing)} missing (spec_jax.launch sets all three)")
  try:
    num, pid = int(env[NUM_PROCESSES]), int(env[PROCESS_ID])
  except ValueError:
    raise ValueError(f"{NUM_PROCESSES} and {PROCESS_ID} must be integers, got "
                     f"{env[NUM_PROCESSES]!r} and {env[PROCESS_ID]!r}") from None
  if num < 1 or not 0 <= pid < num:
    raise ValueError(f"need {NUM_PROCESSES} >= 1 and 0 <= {PROCESS_ID} < {NUM_PROCESSES}, got "
                     f"{num} and {pid}")
  if ":" not in env[COORDINATOR]:
    raise ValueError(f"{COORDINATOR} must be HOST:PORT, got {env[COORDINATOR]!r}")
  return {"coordinator_address": env[COORDINATOR], "num_processes": num, "process_id": pid}


def initialize(env: Optional[Mapping[str, str]] = None) -> bool:
  """Starts jax's distributed runtime when the environment asks for it (module docstring).

  Returns True when this is a multi-process run. Call it once, before any other jax call;
  later calls do nothing."""
  global _STARTED
  settings = settings_from_env(env)
  if settings is None or _STARTED:
    return _STARTED
  import jax
  # CPU processes exchange data through gloo (the default CPU client has no cross-process
  # collectives); GPU and TPU backends ignore the setting.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**settings)
  _STARTED = True
  if jax.process_count() > 1:
    _exit_on_uncaught_exceptions()
  return jax.process_count() > 1


def _exit_on_uncaught_exceptions() -> None:
  """An uncaught exception ends this process at once (status 1): jax's exit handler would
  otherwise wait for every other process to shut down too, and they may be waiting for this
  one in a collective, so the failure would hang every process instead of ending the run."""
  previous = sys.excepthook

  def hook(kind, value, tb):
    previous(kind, value, tb)
    _flush_and_exit(1)
  sys.excepthook = hook


def _flush_and_exit(status: int) -> None:
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(status)


def exit(status) -> None:  # noqa: A001 - the command lines' sys.exit
  """sys.exit for the command lines: a failing process of a multi-process run ends at once
  (see _exit_on_uncaught_exceptions) rather than in jax's shutdown barrier."""
  status = 0 if status is None else status
  if _STARTED and status != 0 and process_count() > 1:
    _flush_and_exit(status if isinstance(status, int) else 1)
  sys.exit(status)


def process_index() -> int:
  import jax
  return jax.process_index()


def process_count() -> int:
  import jax
  return jax.process_count()


def is_main() -> bool:
  """Whether this is process 0, the one that prints results and writes files."""
  return process_index() == 0


def share(items, index: Optional[int] = None, count: Optional[int] = None) -> list:
  """Process `index` of `count`'s contiguous share of items, in order, sizes differing by at
  most one (default: this process's): what each process feeds a multi-process generate()."""
  index = process_index() if index is None else index
  count = process_count() if count is None else count
  n = len(items)
  return list(items[index * n // count:(index + 1) * n // count])


def allgather(tree):
  """Every process's numpy pytree (same shapes and dtypes everywhere), stacked on a new
  leading process axis: leaf [...] -> [P, ...]. Identity-like ([1, ...]) on one process."""
  if process_count() == 1:
    return _map(lambda x: np.asarray(x)[None], tree)
  from jax.experimental import multihost_utils
  return _map(np.asarray, multihost_utils.process_allgather(tree, tiled=False))


def _map(fn, tree):
  import jax
  return jax.tree.map(fn, tree)


def fingerprint(value: Any) -> int:
  """A stable 63-bit hash of a JSON-able value (repr for the rest): equal on every process
  for equal values, unlike hash(), which Python salts per process."""
  blob = json.dumps(value, sort_keys=True, default=repr).encode()
  return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


def agree(fields: Mapping[str, Any], what: str) -> None:
  """Raises ValueError on every process unless every process passed equal `fields` (compared by
  fingerprint): the named fields that differ and the processes whose values differ from
  process 0's. `what` says which call they belong to."""
  if process_count() == 1:
    return
  names = sorted(fields)
  mine = np.asarray([fingerprint(fields[n]) for n in names], np.int64)
  every = allgather(mine)
  differ = [n for i, n in enumerate(names) if np.any(every[:, i] != every[0, i])]
  if differ:
    procs = sorted({int(p) for p in range(every.shape[0])
                    if np.any(every[p] != every[0])})
    raise ValueError(f"processes disagree on {what}: {', '.join(differ)} differ between process "
                     f"0 and process(es) {procs}; every process must make the same call with "
                     "the same options (only its own rows may differ)")


def broadcast_json(value: Any) -> Any:
  """Process 0's JSON-able value, on every process (others pass anything, e.g. None)."""
  if process_count() == 1:
    return value
  from jax.experimental import multihost_utils
  blob = json.dumps(value).encode() if is_main() else b""
  n = int(multihost_utils.broadcast_one_to_all(np.asarray(len(blob), np.int64)))
  size = 1 << max(n - 1, 0).bit_length()       # power-of-two buckets: few compiled shapes
  buf = np.zeros((size,), np.uint8)
  buf[:len(blob)] = np.frombuffer(blob, np.uint8)
  out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return json.loads(out[:n].tobytes().decode())


def on_main(fn: Callable[[], Any]) -> Any:
  """Runs fn on process 0 only (reading or writing files there) and returns its JSON-able
  result on every process; a ValueError raised by fn is raised on every process, so no process
  waits for the others in a collective that will never come."""
  result, error = None, None
  if is_main():
    try:
      result = fn()
    except ValueError as e:
      error = str(e)
  result, error = broadcast_json([result, error]) if process_count() > 1 else (result, error)
  if error is not None:
    raise ValueError(error)
  return result
