#!/usr/bin/env bash
# A long property-based fuzz run of the public API on both gRPC servers (tests/integration/test_fuzz.py).
# Usage: scripts/fuzz.sh [SECONDS_PER_SERVER]   (default 600)
set -euo pipefail
cd "$(dirname "$0")/.."
export OPENENGINE_FUZZ_SECONDS="${1:-600}"
exec python -m pytest tests/integration/test_fuzz.py -q -s -p no:cacheprovider --timeout=$(( ${OPENENGINE_FUZZ_SECONDS%.*} * 2 + 300 ))
