"""Where the test suite's time goes: a pytest plugin that sums, per test, jax's tracing, lowering
and XLA backend-compile events and every XLA compile's name and seconds, then writes them as JSON.

  PYTHONPATH=scripts python -m pytest -p suite_compile_profile [pytest args]
  python scripts/suite_compile_profile.py OUT.json.*      # the summary tables

One JSON per xdist worker (OUT.json.gw0, ...; OUT from SUITE_PROFILE_OUT, default
/tmp/suite_profile.json). A compile of 0.2 s or more counts as a program; the rest are eager ops.
"""

import collections
import glob
import json
import logging
import os
import re
import sys
import time

_PER_TEST: dict = {}
_COMPILES: list = []                      # (test id, compiled function, seconds)
_CURRENT = [None]
_INSTALLED = [False]
_EVENTS = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
_FINISHED = re.compile(r"Finished XLA compilation of (.*) in ([0-9.]+) sec")


def _on_event(event, duration, **_):
  name = event.rsplit("/", 1)[-1]
  if _CURRENT[0] is not None and name in _EVENTS:
    row = _PER_TEST.setdefault(_CURRENT[0], collections.Counter())
    row[name] += duration


class _CompileLog(logging.Handler):
  def emit(self, record):
    m = _FINISHED.search(record.getMessage())
    if m:
      _COMPILES.append((_CURRENT[0], m.group(1), float(m.group(2))))


def _install():
  if _INSTALLED[0]:
    return
  import jax
  jax.monitoring.register_event_duration_secs_listener(_on_event)
  handler = _CompileLog(level=logging.DEBUG)
  for name in ("jax._src.dispatch", "jax._src.interpreters.pxla"):
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
  _INSTALLED[0] = True


def pytest_runtest_protocol(item, nextitem):      # noqa: ARG001 (pytest hook signature)
  _install()
  _CURRENT[0] = item.nodeid
  _PER_TEST.setdefault(item.nodeid, collections.Counter())["start"] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):   # noqa: ARG001
  if _CURRENT[0] != nodeid:            # xdist's controller hears of tests its workers ran
    return
  row = _PER_TEST[nodeid]
  row["wall"] = time.perf_counter() - row.pop("start")
  _CURRENT[0] = None


def pytest_sessionfinish(session):                # noqa: ARG001
  if not _PER_TEST:                    # xdist's controller: its workers write
    return
  out = os.environ.get("SUITE_PROFILE_OUT", "/tmp/suite_profile.json")
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  with open(f"{out}.{worker}", "w") as f:
    json.dump({"per_test": _PER_TEST, "compiles": _COMPILES}, f)


def summarise(paths) -> None:
  per_test, compiles = {}, []
  for path in paths:
    data = json.load(open(path))
    per_test.update(data["per_test"])
    compiles += data["compiles"]
  files = collections.defaultdict(collections.Counter)
  for test, row in per_test.items():
    files[test.split("::")[0]].update(row)
  big = [c for c in compiles if c[2] >= 0.2]
  print(f"worker-seconds {sum(r['wall'] for r in files.values()):.0f}; compiles: {len(big)} programs "
        f"{sum(c[2] for c in big):.0f} s, {len(compiles) - len(big)} eager ops "
        f"{sum(c[2] for c in compiles if c[2] < 0.2):.0f} s")
  print(f"{'wall':>7} {'backend':>7} {'lower':>7} {'trace':>7} {'rest':>7}  file")
  for name, r in sorted(files.items(), key=lambda kv: -kv[1]["wall"])[:30]:
    rest = r["wall"] - sum(r[e] for e in _EVENTS)
    print(f"{r['wall']:7.1f} {r['backend_compile_duration']:7.1f} "
          f"{r['jaxpr_to_mlir_module_duration']:7.1f} {r['jaxpr_trace_duration']:7.1f} "
          f"{rest:7.1f}  {name}")
  by_name = collections.defaultdict(lambda: [0, 0.0])
  for _, name, seconds in compiles:
    by_name[name][0] += 1
    by_name[name][1] += seconds
  print("\nbackend seconds, compiles, compiled function")
  for name, (n, seconds) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"{seconds:7.1f} {n:6d} {name}")


if __name__ == "__main__":
  summarise([p for arg in sys.argv[1:] for p in glob.glob(arg)])
