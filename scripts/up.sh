#!/usr/bin/env bash
# Installs (first run only) and starts the whole stack on this machine: `bash scripts/up.sh [--nodes 2] ...`
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh all  # every component: frontend, node (MPI), native gRPC server
export PATH="$PWD/.venv/bin:$PATH"  # MPI's mpiexec lives next to the venv's python
exec openengine-serve up "$@"
