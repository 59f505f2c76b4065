"""The real-model tests again, on llama.cpp compiled for plain AVX2 (no AVX-512, no AMX, not this machine's own
instruction set): they assert what the model must do, so they hold on any x86-64 CPU.

scripts/bootstrap.sh builds that library once beside the native wheel (.venv/wheels/llama-cpp-avx2);
llama-cpp-python loads it instead of its own through LLAMA_CPP_LIB_PATH, in the test process and in every
process it starts (frontends, nodes, engine workers). Only the tests that run the model are repeated here, and
on one gRPC server (the numerics are the node's; the main run covers both servers).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO

AVX2_LIB = Path(sys.prefix) / "wheels" / "llama-cpp-avx2"
REAL_MODEL_TESTS = [
    "tests/unit/test_llama_engine.py",
    "tests/integration/test_real_model.py",
    "tests/integration/test_guided_and_prefix_cache.py",
]


@pytest.fixture(scope="module")
def avx2_env() -> dict[str, str]:
    built = (AVX2_LIB / "libllama.so").is_file()
    assert built, f"no AVX2 build of llama.cpp in {AVX2_LIB}: run scripts/bootstrap.sh dev"
    return os.environ | {"LLAMA_CPP_LIB_PATH": str(AVX2_LIB)}


def test_the_other_build_is_plain_avx2(avx2_env):
    probe = "import llama_cpp as l; print(l.llama_cpp._lib._name); print(l.llama_print_system_info().decode())"
    out = subprocess.run([sys.executable, "-c", probe], env=avx2_env, capture_output=True, text=True, check=True)
    library, features = out.stdout.split("\n", 1)
    assert Path(library).parent == AVX2_LIB
    assert "AVX2 = 1" in features and "FMA = 1" in features
    assert "AVX512 = 1" not in features and "AMX_INT8 = 1" not in features, features


@pytest.mark.timeout(1800)
def test_the_real_model_tests_pass_on_the_avx2_build(avx2_env):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-k", "not pygrpc-native"]
        + REAL_MODEL_TESTS,
        cwd=REPO,
        env=avx2_env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
