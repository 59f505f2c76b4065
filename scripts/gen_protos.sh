#!/usr/bin/env bash
# Regenerates service/openengine_serve/api/ from protos/. The only way generated
# code changes: tests/unit/test_generated_code.py fails when it drifts.
set -euo pipefail
cd "$(dirname "$0")/.."
out=service/openengine_serve/api
python=${PYTHON:-python}
rm -rf "$out/openengine" "$out/openengine_internal"
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I protos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  $(cd protos && find . -name '*.proto' | sort | sed 's|^\./||')
# protoc writes imports relative to the proto root; make them absolute so the
# generated modules live inside the package instead of on sys.path.
find "$out" -name '*.py' -o -name '*.pyi' | sort | while read -r f; do
  sed -i -E 's/^from (openengine(_internal)?\.v1) import/from openengine_serve.api.\1 import/' "$f"
done
for d in "$out" "$out/openengine" "$out/openengine/v1" "$out/openengine_internal" "$out/openengine_internal/v1"; do
  [ -f "$d/__init__.py" ] || : > "$d/__init__.py"
done
echo "generated into $out"
