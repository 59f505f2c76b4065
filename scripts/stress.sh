#!/usr/bin/env bash
# Runs one test (or any pytest selection) N times in a row and prints how many runs failed.
#   bash scripts/stress.sh [-n RUNS] PYTEST_ARGS...
#   bash scripts/stress.sh -n 30 tests/integration/test_operations.py::test_rolling_restart_under_load_loses_nothing -k native
# Each failing run's output is kept in $STRESS_LOG_DIR (default /tmp/openengine-stress); exit 1 when any run failed.
# Nightly fuzz, ten times CI's 300 Generate calls per server, three runs:
#   OPENENGINE_FUZZ_EXAMPLES=3000 bash scripts/stress.sh -n 3 tests/integration/test_fuzz.py
set -uo pipefail
cd "$(dirname "$0")/.."
runs=30
if [[ "${1:-}" == "-n" ]]; then
  runs="$2"
  shift 2
fi
if [[ $# -eq 0 || ! "$runs" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: bash scripts/stress.sh [-n RUNS (a positive integer, default 30)] PYTEST_ARGS..." >&2
  exit 2
fi
python="${PYTHON:-$PWD/.venv/bin/python}"
[[ -x "$python" ]] || { echo "no $python: run bash scripts/bootstrap.sh native,dev first" >&2; exit 2; }
log_dir="${STRESS_LOG_DIR:-/tmp/openengine-stress}"
mkdir -p "$log_dir"
failures=0
started=$SECONDS
for ((i = 1; i <= runs; i++)); do
  log="$log_dir/run-$i.log"
  if "$python" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1; then
    status=pass
    rm -f "$log"
  else
    status="FAIL (see $log)"
    failures=$((failures + 1))
  fi
  echo "run $i/$runs: $status ($((SECONDS - started)) s so far)"
done
echo "runs=$runs failures=$failures seconds=$((SECONDS - started)) args: $*"
[[ $failures -eq 0 ]]
