"""The real-model tests again, on llama.cpp's CPU backend for plain AVX2 (the `haswell` variant: no AVX-512, no
AMX, not this machine's own instruction set): they assert what the model must do, so they hold on any x86-64 CPU.

The wheel scripts/bootstrap.sh builds holds every x86-64 variant of the CPU backend; OPENENGINE_CPU_VARIANT makes
every process the test starts (frontends, nodes, engine workers) load the AVX2 one instead of the best for this
CPU. Only the tests that run the model are repeated here, and on one gRPC server (the numerics are the node's;
the main run covers both servers).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from openengine_serve.common.llama_library import CPU_VARIANT_ENV
from openengine_serve.common.net import free_port

from ..conftest import REPO
from ..unit.test_llama_library import probe

AVX2 = "haswell"
REAL_MODEL_TESTS = [
    "tests/unit/test_llama_engine.py",
    "tests/integration/test_real_model.py",
    "tests/integration/test_guided_and_prefix_cache.py",
]


@pytest.fixture(scope="module")
def avx2_env() -> dict[str, str]:
    return os.environ | {CPU_VARIANT_ENV: AVX2}


def test_the_forced_variant_is_plain_avx2():
    out = probe(AVX2)
    assert out.returncode == 0, f"{out.stderr[-2000:]}\n(the wheel must be scripts/bootstrap.sh's default build)"
    variant, features = out.stdout.split("\n", 1)
    assert variant == AVX2
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


def test_a_node_given_a_variant_the_build_lacks_stops_at_start_naming_the_variants():
    result = subprocess.run(
        [sys.executable, "-m", "openengine_serve", "node", "--engine", "llama.cpp", "--cpu-variant", "pentium4",
         "--coordinator-address", f"127.0.0.1:{free_port()}", "--metrics-port", "0"],
        env={k: v for k, v in os.environ.items() if k != CPU_VARIANT_ENV}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{CPU_VARIANT_ENV}=pentium4 is not a CPU variant of this build" in result.stderr, result.stderr[-2000:]
    assert "haswell" in result.stderr and "x64" in result.stderr
