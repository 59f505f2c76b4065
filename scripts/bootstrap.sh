#!/usr/bin/env bash
# Creates ./.venv (once) and installs the project into it with the given extras.
# Used by scripts/up.sh and scripts/test.sh; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-all}
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q -e ".[$extras]"
  touch "$stamp"
fi
# The dev extra's tests also need an outdated pygrpc-native wheel (the frontend must refuse it); fetch it
# here, once, so that no test reaches a package index (tests/integration/test_server_switch.py).
outdated_native=pygrpc-native==0.4.0
if [[ ",$extras," == *,dev,* ]] && ! compgen -G ".venv/wheels/pygrpc_native-0.4.0-*.whl" >/dev/null; then
  .venv/bin/pip download -q --no-deps "$outdated_native" -d .venv/wheels
fi
