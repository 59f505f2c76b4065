#!/usr/bin/env bash
# A long property-based fuzz run of the public API on both gRPC servers (tests/integration/test_fuzz.py).
# Usage: scripts/fuzz.sh [GENERATE_CALLS_PER_SERVER]   (default 5000; CI runs 300)
set -euo pipefail
cd "$(dirname "$0")/.."
export OPENENGINE_FUZZ_EXAMPLES="${1:-5000}"
exec python -m pytest tests/integration/test_fuzz.py -q -s -p no:cacheprovider --timeout=$(( OPENENGINE_FUZZ_EXAMPLES / 5 + 300 ))
