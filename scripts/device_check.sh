#!/usr/bin/env bash
# Device check of the verify-attention kernels on a lent GPU (or TPU) machine.
#
#   bash scripts/device_check.sh            # from the repository root; writes under $OUT (./out)
#
# Installs nothing (the machine has no network): it uses whatever `python3` is there, with jax,
# and this repository via PYTHONPATH. Steps, each under `timeout`, about 8 minutes in all:
#   1. environment: jax version, devices, nvidia-smi
#   2. kernel tests run natively (SPEC_JAX_KERNEL_TEST_BACKEND=gpu|tpu: interpret=False) against
#      the reference and the naive loop; with pytest when importable, else the test module's own
#      script mode (same comparisons)
#   3. python -m kernels_pallas.bench: full kv_lengths, S 1k..32k, B 1/8/32, T 1/5/9
#   4. the same with ragged kv_lengths on a subset
# Logs and JSON land in $OUT; the exit status is non-zero when the tests failed.
# Budget overrides: TEST_TIMEOUT, BENCH_TIMEOUT, RAGGED_TIMEOUT (seconds).

set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-240}"
RAGGED_TIMEOUT="${RAGGED_TIMEOUT:-75}"
START=$(date +%s)

log() { echo "[device_check +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/summary.log"; }

# ------------------------------------------------------------------ 1. environment
{
  "$PY" -c 'import sys, jax; print("python", sys.version.split()[0]); print("jax", jax.__version__);
print("backend", jax.default_backend()); print("devices", jax.devices())'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
      --format=csv
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
BACKEND=$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo unknown)
case "$BACKEND" in
  gpu|tpu) export SPEC_JAX_KERNEL_TEST_BACKEND="$BACKEND" ;;
  *) log "backend is '$BACKEND', not gpu/tpu: tests run in interpret mode"
     export SPEC_JAX_KERNEL_TEST_BACKEND=interpret ;;
esac
log "backend=$BACKEND SPEC_JAX_KERNEL_TEST_BACKEND=$SPEC_JAX_KERNEL_TEST_BACKEND OUT=$OUT"

# ------------------------------------------------------------------ 2. kernel tests
if "$PY" -c 'import pytest' >/dev/null 2>&1; then
  log "tests: pytest (timeout ${TEST_TIMEOUT}s)"
  timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider \
      tests/test_kernels.py tests/test_kernels_dispatch.py tests/test_kernels_lowering.py \
      --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
  TEST_RC=$?
else
  log "tests: pytest is not importable, running tests/test_kernels.py as a script"
  timeout -k 10 "$TEST_TIMEOUT" "$PY" tests/test_kernels.py --slow > "$OUT/tests.log" 2>&1
  TEST_RC=$?
fi
tail -n 25 "$OUT/tests.log"
log "tests exit status $TEST_RC (124 = timed out)"

# ------------------------------------------------------------------ 3. benchmark, full lengths
log "bench: full kv_lengths (timeout ${BENCH_TIMEOUT}s)"
timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m kernels_pallas.bench \
    --time-budget $(( BENCH_TIMEOUT - 50 )) --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
BENCH_RC=$?
tail -n 45 "$OUT/bench.log"
log "bench exit status $BENCH_RC"

# ------------------------------------------------------------------ 4. benchmark, ragged lengths
log "bench: ragged kv_lengths (timeout ${RAGGED_TIMEOUT}s)"
timeout -k 10 "$RAGGED_TIMEOUT" "$PY" -m kernels_pallas.bench --ragged --sizes 4k,32k \
    --batch 1,8,32 --num-new 5,9 --time-budget $(( RAGGED_TIMEOUT - 35 )) \
    --out "$OUT/bench_ragged.json" > "$OUT/bench_ragged.log" 2>&1
RAGGED_RC=$?
tail -n 15 "$OUT/bench_ragged.log"
log "ragged bench exit status $RAGGED_RC"

log "done: tests=$TEST_RC bench=$BENCH_RC ragged=$RAGGED_RC; logs in $OUT"
[ "$TEST_RC" -eq 0 ]
