#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (and `llama-batched-bench`, the machine's decode limit with no server) from
# the llama.cpp sources vendored in the source distribution of
# the llama-cpp-python version installed in the repo's venv: the same llama.cpp our engine calls, compiled as
# its users compile it from source (llama.cpp's defaults: GGML_NATIVE, i.e. -march=native, and OpenMP), linked
# statically.
# The binary is cached under .venv/llama-server/<version>/ and reused by later runs; the last line printed
# is its path.
#
#   tools/build_llama_server.sh            # build once, print the binary's path
#   LLAMA_CPP_SDIST=/path/llama_cpp_python-X.tar.gz tools/build_llama_server.sh   # use this sdist
#   JOBS=2 PYTHON=/path/python tools/build_llama_server.sh
#
# Needs cmake and a C/C++ compiler; the sdist comes from the package index (`pip download`) when absent.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
jobs="${JOBS:-2}"

version="$("$python" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')"
cache="$repo/.venv/llama-server"
dest="$cache/$version"
binary="$dest/llama-server"
batched_bench="$dest/llama-batched-bench"

if [[ -x "$binary" && -x "$batched_bench" ]]; then
    echo "llama-server for llama-cpp-python $version: cached" >&2
    echo "$binary"
    exit 0
fi

mkdir -p "$cache/sdist"
sdist="${LLAMA_CPP_SDIST:-}"
if [[ -z "$sdist" ]]; then
    sdist="$(ls "$cache"/sdist/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)"
fi
if [[ -z "$sdist" ]]; then
    echo "== downloading the llama-cpp-python $version source distribution" >&2
    "$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$cache/sdist" >&2
    sdist="$(ls "$cache"/sdist/llama_cpp_python-"$version".tar.gz)"
fi
echo "== sdist: $sdist" >&2

work="$dest/work"
rm -rf "$work"
mkdir -p "$work"
echo "== extracting" >&2
tar -xzf "$sdist" -C "$work"
src="$(ls -d "$work"/llama_cpp_python-*/)"
llama="$src/vendor/llama.cpp"

# The sdist carries no git metadata: the llama.cpp commit is the one its changelog names for this version.
commit="$(awk -v v="## [$version]" '$0 == v {found = 1; next} found && /^## \[/ {exit}
                                     found && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART + 10, RLENGTH - 10); exit}' \
          "$src/CHANGELOG.md" 2>/dev/null || true)"
commit="${commit:-unknown}"
echo "== llama.cpp commit (from the sdist's CHANGELOG.md): $commit" >&2

# LLAMA_CURL is deprecated and ignored in this llama.cpp (downloads go through LLAMA_OPENSSL now): both off,
# the server only serves a local file. The web UI would be fetched from a bucket (LLAMA_USE_PREBUILT_UI) or
# built with npm (LLAMA_BUILD_UI): neither, the server then embeds no UI, which the API does not need.
echo "== configuring (cmake)" >&2
cmake -S "$llama" -B "$work/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_COMMIT="$commit" \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    >"$dest/cmake-configure.log" 2>&1 || { tail -40 "$dest/cmake-configure.log" >&2; exit 1; }

echo "== building llama-server and llama-batched-bench with $jobs jobs (several minutes on 2 cores;" \
     "log: $dest/cmake-build.log)" >&2
start=$(date +%s)
cmake --build "$work/build" --target llama-server llama-batched-bench -j "$jobs" >"$dest/cmake-build.log" 2>&1 \
    || { tail -40 "$dest/cmake-build.log" >&2; exit 1; }
echo "== built in $(( $(date +%s) - start )) s" >&2

for tool in "$batched_bench" "$binary"; do
    cp "$work/build/bin/$(basename "$tool")" "$tool.tmp"
    mv "$tool.tmp" "$tool"
done
printf 'llama_cpp_python=%s\nllama_cpp_commit=%s\nsdist=%s\nbuild_seconds=%s\n' \
    "$version" "$commit" "$(basename "$sdist")" "$(( $(date +%s) - start ))" >"$dest/build-info.txt"
rm -rf "$work"
echo "$binary"
