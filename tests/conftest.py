"""Shared fixtures: paths to ../shared, the shared models' loaders, a module's random target
as a transformers model."""

import os
import pathlib

# Tests run tiny shapes where XLA's compile time dominates: a lower LLVM optimisation level
# compiles ~2.5x faster. On jaxlib 0.10, XLA:CPU's older (non-MLIR) fusion emitters cut the
# backend compile once more (a governed, a tree and two chain generates: 22.9 s -> 11.1 s, the
# same tokens; the 40k-row chi-square tests 134 s -> 99 s; the whole suite's backend compile
# ~1,900 -> 1,561 worker-seconds). Only there: an XLA that does not know a flag aborts. Set
# before jax is imported; subprocesses inherit them; benchmarks never import this file.
_FLAGS = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA's HLO verifier runs after every HLO pass: it checks XLA's own passes, not this project's
# programs. perf: HloVerifier::RunImpl is about a tenth of a decode's backend compile; a
# stories260K + salty279K generate compiled in 3.97 / 3.96 / 4.25 s with it, 3.24-3.70 s
# without, the same tokens; four test files 214 / 205 -> 210 / 197 user CPU-s, alternated
# (2026-12-06). The library never sets it.
_FLAGS += " --xla_disable_hlo_passes=hlo-verifier"
# XLA:CPU splits each program's LLVM module into parts compiled on its thread pool; under -n 2
# on 2 cores there is no idle core for them, and the split itself costs: one part cut
# tests/test_engine.py 31.2 / 28.0 -> 28.2 / 25.4 / 25.4 CPU-s and tests/test_lossless.py 68.8 /
# 67.1 -> 64.5 / 64.8 CPU-s (alone, -n 0, alternated; the same tokens: the code of each
# function is the same, only where it is compiled changes) (2026-12-07).
_FLAGS += " --xla_cpu_parallel_codegen_split_count=1"
try:
  from importlib.metadata import version as _version
  if _version("jaxlib").startswith("0.10."):
    _FLAGS += " --xla_cpu_use_fusion_emitters=false"
except Exception:  # noqa: BLE001 (no jaxlib metadata: the portable flags only)
  pass
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _FLAGS).strip()
# Each xdist worker gets its share of the cores for OpenMP: torch (the transformers references)
# otherwise starts one OpenMP thread per core in every worker, and its threads spin-wait for
# the core the other worker holds. With a busy loop on the second core, SmolLM2's 64 greedy
# tokens against transformers took 45.4 s, 20.8 s with one thread (51 s in a full suite run,
# 17 s alone); the six transformers-parity files under -n 2 ran in 308 -> 264 s (user CPU 519
# -> 467 s), test_tree + test_constraints (no torch) in 178 -> 182 s, within noise. Set before
# torch is imported; subprocesses inherit it. XLA's own thread pool does not spin: its flag
# (--xla_cpu_multi_thread_eigen) changed nothing measurable.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
  os.environ.setdefault("OMP_NUM_THREADS", str(max(
      1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
# No persistent compilation cache in tests: the CLI's compile_cache.enable() (called in-process
# by some tests) would otherwise turn on ~/.cache/spec_jax/xla for the rest of that worker, so
# the suite's time depended on what earlier runs had left there (a warm cache saved 866 s of
# compile here; CI's clean machine starts with none).
os.environ.setdefault("SPEC_JAX_COMPILE_CACHE", "off")
# One compilation cache per test run instead, empty at its start and removed at its end
# (pytest_unconfigure): the xdist workers and every subprocess share it through these
# variables, set by the first process (the controller) before jax is imported. Files
# recompile what earlier files already compiled (_release_compiled_executables drops jax's
# in-memory caches after each file), and the two workers compile many of the same programs.
# Every program is cached, single ops too (a hit: 5.5 ms, a compile: 15.7 ms); a floor of
# 0.1 s (SPEC_JAX_TEST_CACHE_MIN_SECS) ran seven files in 133 s against 124 s.
_TEST_CACHE_VAR = "SPEC_JAX_TEST_XLA_CACHE"
_OWN_TEST_CACHE = _TEST_CACHE_VAR not in os.environ
if _OWN_TEST_CACHE:
  import tempfile
  os.environ[_TEST_CACHE_VAR] = tempfile.mkdtemp(prefix="spec_jax_test_xla_")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ[_TEST_CACHE_VAR])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                      os.environ.get("SPEC_JAX_TEST_CACHE_MIN_SECS", "0"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import contextlib  # noqa: E402
import gc  # noqa: E402

import pytest  # noqa: E402

# Python's cyclic garbage collector scans every live object at each gen-2 pass; jax's tracing
# allocates millions of short-lived objects, so under the default thresholds (700, 10, 10) the
# collector ran thousands of times per file over jax's own long-lived modules and caches. Rarer
# gen-0 passes and the collection-time objects frozen out of the scan (pytest_collection_finish)
# cut test_lossless.py 46.3 -> 41.8 s and test_tree.py 172 -> 165 s (single worker, the same
# peak RSS), and the whole suite 1306 / 1358 s -> 1201 / 1273 s (two runs each, 2 workers, 2
# cores). Tests only: the library never changes a process's collector.
gc.set_threshold(50_000, 20, 100)

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


def load_shared(name: str, **kwargs):
  """sj.load of ../shared/models/NAME (the test skips when it is absent)."""
  import spec_jax as sj
  return sj.load(need_shared("models", name), **kwargs)


def peaky_models(cfg):
  """A random target of `cfg` and a one-layer random draft model, their embeddings scaled by 40
  (peaky logits: a non-trivial argmax path); keys 1 and 3."""
  import jax
  import spec_jax as sj
  target = sj.init_model(cfg, jax.random.key(1))
  target.params["embed"] = target.params["embed"] * 40
  draft = sj.init_model(cfg.replace(num_layers=1), jax.random.key(3))
  draft.params["embed"] = draft.params["embed"] * 40
  return target, draft


@pytest.fixture(scope="module")
def stories260k():
  return load_shared("stories260K")


@pytest.fixture(scope="module")
def salty279k():
  return load_shared("salty279K")


@pytest.fixture(scope="module")
def tinystories656k():
  return load_shared("tinystories656K")


@pytest.fixture(scope="module")
def hf_target(target, tmp_path_factory):
  """The test module's `target` fixture (an sj Model) as a transformers model, read back from
  the Hugging Face folder save_hf writes (eager attention: comparable logits)."""
  import transformers
  from spec_jax.models.hf_export import save_hf
  folder = save_hf(target, tmp_path_factory.mktemp("target") / "t")
  return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")


# The longest files first: with two xdist workers taking whole files (--dist loadfile), a long
# file started last keeps one worker busy while the other idles (longest-first scheduling).
# pyproject's addopts passes --no-loadscope-reorder: without it xdist hands out the files by
# their number of tests, whatever this order says (3.8's default; before 3.8 always), and it
# did here until 2026-12-05: a 1-test, 60 s file ran last while the other worker idled 46 s.
# Worker-seconds per file on the 2-core CI machine (--durations=0 summed, 2026-12-06), every
# file over ~10 s, longest first; the rest follow in collection order.
_LONG_FILES = ("test_tree.py",                 # 231
               "test_multiprocess.py",         # 169 (two processes: both cores)
               "test_constraints.py",          # 143
               "test_dflash.py",               # 140
               "test_governor.py",             # 133
               "test_gemma_assistant.py",      # 101
               "test_gguf.py",                 # 100
               "test_gemma.py",                # 97
               "test_accelerators.py",         # 91
               "test_bench.py",                # 90
               "test_heads.py",                # 87
               "test_real_model_lossless.py",  # 75
               "test_sampling_controls.py",    # 66
               "test_mutants.py",              # 57
               "test_hybrid.py",               # 56
               "test_ddtree.py",               # 50
               "test_lossless.py",             # 50
               "test_dspark.py",               # 44
               "test_hybrid_speculation.py",   # 43
               "test_widen.py",                # 43
               "test_self_generate.py",        # 40
               "test_sharding.py",             # 34
               "test_engine.py",               # 28
               "test_eagle3.py", "test_eval.py", "test_target.py", "test_train.py",   # 22-26
               "test_kernels.py", "test_bf16.py", "test_sampling.py",                   # 17-21
               "test_real_speculative.py", "test_kv_write.py", "test_rejection.py",     # 13-16
               "test_decode.py", "test_transformer.py", "test_strategies.py")           # 9-11


def pytest_unconfigure(config):
  if _OWN_TEST_CACHE:
    import shutil
    shutil.rmtree(os.environ[_TEST_CACHE_VAR], ignore_errors=True)


def pytest_collection_finish(session):
  gc.collect()
  gc.freeze()        # the modules and objects collection loaded: never scanned again


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(_LONG_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: order within a file kept


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
  """After each test file, drop jax's compiled executables and tracing caches: an xdist worker
  runs many files, and with everything they compiled still held (~5 GB RSS) XLA:CPU crashed
  compiling in a late file (a segfault in backend_compile, twice in test_lossless). Within a
  file compiles stay shared."""
  yield
  import gc

  import jax
  jax.clear_caches()
  gc.collect()


# Tests marked `optimized` compile at LLVM O1 instead (their module fixtures do not): they run
# their programs for much longer than they compile them (the statistical tests' tens of
# thousands of rows). A 512-row sampled generate with a draft model ran in 26.8 s at O0 and
# 10.6 s at O1, and compiled in about the same time. The marked tests are those a whole suite
# run at O1 made faster (2 workers; O1 everywhere ran 1613 s against O0's 1165 s): marked, the
# suite's summed test seconds fell 2264 -> 2157 and its wall time 1165 -> 1109 s. Tests that
# compare two programs bit for bit stay unmarked.
_OPTIMIZED_OPTIONS = {"xla_backend_optimization_level": 1}


@contextlib.contextmanager
def optimized_compiles():
  """Inside the block, every XLA compile of this process gets _OPTIMIZED_OPTIONS on top of
  XLA_FLAGS (jax's per-compile option overrides, which also key the compilation cache). A jax
  without compiler.get_compile_options compiles at the flags' level."""
  from jax._src import compiler
  original = getattr(compiler, "get_compile_options", None)
  if original is None:
    yield
    return

  def with_optimized(*args, env_options_overrides=None, **kwargs):
    options = {**_OPTIMIZED_OPTIONS, **(env_options_overrides or {})}
    return original(*args, env_options_overrides=options, **kwargs)

  compiler.get_compile_options = with_optimized
  try:
    yield
  finally:
    compiler.get_compile_options = original


@pytest.fixture(autouse=True)
def _optimized_test(request):
  marked = request.node.get_closest_marker("optimized") is not None
  with optimized_compiles() if marked else contextlib.nullcontext():
    yield


def _lowering_caches():
  """jax's caches of lowered programs (their names in jax 0.10.2; a version without them skips
  them and only loses the speed-up)."""
  from jax._src import pjit
  from jax._src.interpreters import pxla
  caches = (getattr(pjit, "_pjit_lower", None), getattr(pxla, "_cached_lowering_to_hlo", None))
  return [c for c in caches if hasattr(c, "cache_clear")]


@pytest.fixture(autouse=True)
def _release_lowered_modules():
  """After each test, drop jax's caches of lowered programs: each holds an MLIR module and its
  MLIR context, and MLIR's uniquing slows with every live context (perf: StorageUniquer's
  getOrCreate and its thread-local caches, 26 % of the samples). Measured: 400 new single-op
  compiles took 5.2 s in a fresh process, 9.1 s after 4,000 others, 6.8 s once these caches were
  dropped (5.5 s with jax.clear_caches()); test_engine, sampling, strategies, decode and
  rejection, one process, alternated: 74.0 / 76.7 s -> 71.9 / 69.3 s. The compiled executables
  stay: a call that reaches a dropped lowering again finds its executable in the run's
  compilation cache above."""
  yield
  for cache in _lowering_caches():
    cache.cache_clear()
