"""python -m spec_jax.launch --processes N --devices-per-process D -- COMMAND ...

Runs COMMAND as N processes on this machine, each with D fake CPU devices, joined into one jax
distributed runtime: the code path of a TPU pod slice or of several GPU hosts, minus the
hardware. For local testing of multi-process runs:

    python -m spec_jax.launch --processes 2 --devices-per-process 4 -- \\
        python -m spec_jax generate --prompt A --prompt B ... --mesh data=8,model=1

Each child gets the environment spec_jax.distributed.initialize() reads (SPEC_JAX_COORDINATOR
= 127.0.0.1 and a free port, SPEC_JAX_NUM_PROCESSES, SPEC_JAX_PROCESS_ID), JAX_PLATFORMS=cpu and
--xla_force_host_platform_device_count=D in XLA_FLAGS; CPU collectives are gloo. The command
lines of spec_jax and train call initialize() themselves; a script of your own calls
spec_jax.distributed.initialize() before anything else in jax.

Output: by default process 0's stdout and stderr pass through unchanged (less gloo's
"[Gloo] Rank I is connected to ..." lines), and the others' are
kept and shown, each line prefixed with [process I], only if that process fails;
--output all shows every process's lines as they come, prefixed. The exit status is 0 when
every process exits 0; otherwise the first failure's (a signal counts as 128 + its number),
and the other processes are stopped (SIGTERM, then SIGKILL) as soon as one fails, since they
would otherwise wait for it in a collective.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from spec_jax import distributed

DEVICE_FLAG = "--xla_force_host_platform_device_count"
# gloo prints "[Gloo] Rank I is connected to N peer ranks. Expected number of connected peer
# ranks is : N" on stdout for every CPU device as its collectives connect, from several threads
# at once, so the pieces of these lines interleave: a line made of nothing but such pieces (and
# digits and spaces) is gloo's, not the command's.
_GLOO_PIECES = (r"\[Gloo\] Rank", r"is connected to", r"peer ranks\.",
                r"Expected number of connected peer ranks is :")
NOISE = re.compile(r"^(?=.*(?:%s))(?:\s|\d|%s)+$" % ("|".join(_GLOO_PIECES),
                                                    "|".join(_GLOO_PIECES)))
_PIECE_OF_A_RANK = re.compile(r"^\s*\d{1,3}\s*$")


class GlooFilter:
  """Drops gloo's connection lines from one output stream (NOISE). Their pieces interleave
  across threads at any boundary, so a line can also be left holding nothing but digits of one
  of them (a lone "7" was seen at the top of a launched command's output): such a line, one
  run of at most 3 digits (a rank number's piece), is dropped too, but only while nothing but
  gloo lines (and blank ones) came since the last gloo line, never once the command's own text
  has started again. A longer one is the command's ("2024 2000", a constrained answer, was
  dropped when every digits-only line counted)."""

  def __init__(self):
    self.after_gloo = False

  def keep(self, line: str) -> bool:
    if NOISE.match(line):
      self.after_gloo = True
      return False
    if not line.strip():
      return True
    if self.after_gloo and _PIECE_OF_A_RANK.match(line):
      return False
    self.after_gloo = False
    return True


KEEP_LINES = 200           # lines of a quiet process's output kept for its failure report
GRACE_SECONDS = 5.0


def free_port() -> int:
  """A TCP port that was free on 127.0.0.1 a moment ago (for the coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(base: dict, process_id: int, processes: int, devices: int, port: int) -> dict:
  """The environment of child `process_id` (module docstring)."""
  env = dict(base)
  flags = re.sub(rf"{DEVICE_FLAG}=\S*", "", env.get("XLA_FLAGS", "")).split()
  env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_FLAG}={devices}"])
  env["JAX_PLATFORMS"] = "cpu"
  env[distributed.COORDINATOR] = f"127.0.0.1:{port}"
  env[distributed.NUM_PROCESSES] = str(processes)
  env[distributed.PROCESS_ID] = str(process_id)
  env.pop(distributed.AUTO, None)
  env["PYTHONUNBUFFERED"] = "1"
  return env


class _Child:
  """One process and the threads that copy its output."""

  def __init__(self, index: int, command: list, env: dict, show_all: bool, lock):
    self.index, self.lock = index, lock
    self.quiet = index != 0 and not show_all
    self.prefix = f"[process {index}] " if show_all else ""
    self.kept = collections.deque(maxlen=KEEP_LINES)
    self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
    self.threads = [threading.Thread(target=self._copy, args=(pipe, sink), daemon=True)
                    for pipe, sink in ((self.proc.stdout, sys.stdout),
                                       (self.proc.stderr, sys.stderr))]
    for t in self.threads:
      t.start()

  def _copy(self, pipe, sink) -> None:
    gloo = GlooFilter()
    for raw in iter(pipe.readline, b""):
      line = raw.decode(errors="replace")
      if not gloo.keep(line):
        continue
      if self.quiet:
        self.kept.append(line)
        continue
      with self.lock:
        sink.write(self.prefix + line)
        sink.flush()
    pipe.close()

  def finish_output(self) -> None:
    for t in self.threads:
      t.join(timeout=GRACE_SECONDS)

  def report(self) -> None:
    """A quiet process failed: its kept lines, prefixed, on stderr."""
    if not self.quiet:
      return
    with self.lock:
      sys.stderr.write(f"[process {self.index}] exited with status {self.proc.returncode}; its "
                       f"last {len(self.kept)} output lines:\n")
      for line in self.kept:
        sys.stderr.write(f"[process {self.index}] {line}")
      sys.stderr.flush()

  def signal(self, sig) -> None:
    """sig to the child's own process group (the session it was started in)."""
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, sig)
      except ProcessLookupError:
        pass


def _status(code: int) -> int:
  return 128 - code if code < 0 else code


def run(command: list, processes: int, devices: int, output: str = "main",
        port: int = 0) -> int:
  """Starts the processes, waits for them, returns the exit status (module docstring)."""
  port = port or free_port()
  lock = threading.Lock()
  children = [_Child(i, command, child_env(os.environ, i, processes, devices, port),
                     output == "all", lock) for i in range(processes)]
  failed = None
  previous = {}

  def forward(sig, _frame):
    for c in children:
      c.signal(sig)
  for sig in (signal.SIGINT, signal.SIGTERM):
    previous[sig] = signal.signal(sig, forward)
  try:
    while True:
      codes = [c.proc.poll() for c in children]
      if failed is None:
        failed = next((c for c, code in zip(children, codes) if code not in (None, 0)), None)
        if failed is not None:
          _stop(children)
      if all(code is not None for code in codes):
        break
      time.sleep(0.05)
  finally:
    _stop(children)
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  for c in children:
    c.finish_output()
  if failed is None:
    return 0
  failed.report()
  with lock:
    sys.stderr.write(f"spec_jax.launch: process {failed.index} failed with status "
                     f"{_status(failed.proc.returncode)}; the other processes were stopped\n")
  return _status(failed.proc.returncode) or 1


def _stop(children) -> None:
  """SIGTERM to every child still running, SIGKILL to those alive after the grace period."""
  alive = [c for c in children if c.proc.poll() is None]
  for c in alive:
    c.signal(signal.SIGTERM)
  deadline = time.time() + GRACE_SECONDS
  for c in alive:
    try:
      c.proc.wait(timeout=max(deadline - time.time(), 0.01))
    except subprocess.TimeoutExpired:
      c.signal(signal.SIGKILL)
      c.proc.wait()


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m spec_jax.launch", usage="%(prog)s --processes N --devices-per-process D "
      "[--output main|all] [--port PORT] -- COMMAND ...",
      description="Runs COMMAND as N processes on this machine, each with D fake CPU devices, "
      "joined into one jax distributed runtime (coordinator on 127.0.0.1, gloo collectives): "
      "the code path of a TPU pod slice or of several GPU hosts.")
  p.add_argument("--processes", type=int, required=True, help="N processes")
  p.add_argument("--devices-per-process", type=int, default=1, help="D fake CPU devices each")
  p.add_argument("--output", choices=("main", "all"), default="main",
                 help="main: process 0's output (the others' only if they fail); all: every "
                 "process's, prefixed (default: %(default)s)")
  p.add_argument("--port", type=int, default=0, help="the coordinator's port (default: a free one)")
  return p


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  cut = argv.index("--") if "--" in argv else len(argv)
  args = build_parser().parse_args(argv[:cut])       # --help, or a usage error, exits here
  command = argv[cut + 1:]
  if not command:
    build_parser().print_usage(sys.stderr)
    print("error: give the command after --, e.g. -- python -m spec_jax generate ...",
          file=sys.stderr)
    return 2
  if args.processes < 1 or args.devices_per_process < 1:
    print(f"error: --processes and --devices-per-process must be >= 1, got {args.processes} "
          f"and {args.devices_per_process}", file=sys.stderr)
    return 2
  if command[0] in ("python", "python3"):   # the interpreter that runs the launcher (its venv)
    command[0] = sys.executable
  return run(command, args.processes, args.devices_per_process, args.output, args.port)


if __name__ == "__main__":
  sys.exit(main())
