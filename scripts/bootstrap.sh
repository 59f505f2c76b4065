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
