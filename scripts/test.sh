#!/usr/bin/env bash
# Installs (first run only) and runs the whole test suite: unit, integration (both gRPC servers),
# helm chart, and container tests (these need a Docker engine; with CI=true a missing engine fails).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh dev  # all components, the benchmark and the test tools
export PATH="$PWD/.venv/bin:$PATH"
exec python -m pytest "$@"
