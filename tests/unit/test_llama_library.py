"""llama.cpp's CPU backend variants (common/llama_library.py): the best for this CPU by default, the one
OPENENGINE_CPU_VARIANT names when set, a clear error for a name the build lacks. Each case runs in a fresh
interpreter, since a process loads its CPU backend once."""

from __future__ import annotations

import os
import subprocess
import sys

from openengine_serve.common.llama_library import CPU_VARIANT_ENV

PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from openengine_serve.common.llama_library import cpu_backend, llama_cpp
print(cpu_backend())
print(llama_cpp().llama_print_system_info().decode())
"""


def probe(variant: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != CPU_VARIANT_ENV}
    if variant is not None:
        env[CPU_VARIANT_ENV] = variant
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return next(set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags"))


def test_the_best_variant_for_this_cpu_is_loaded_and_logged():
    out = probe(None)
    assert out.returncode == 0, out.stderr[-2000:]
    variant, features = out.stdout.split("\n", 1)
    assert f"openengine_serve.llama_cpp llama.cpp CPU variant: {variant}\n" in out.stderr
    # the variant uses what this CPU has: AVX2 where it has AVX2, AVX-512 where it has AVX-512
    assert ("AVX2 = 1" in features) == ("avx2" in cpu_flags()), (variant, features)
    assert ("AVX512 = 1" in features) == ("avx512f" in cpu_flags()), (variant, features)


def test_a_forced_variant_is_loaded_and_logged_as_forced():
    out = probe("x64")
    assert out.returncode == 0, out.stderr[-2000:]
    variant, features = out.stdout.split("\n", 1)
    assert variant == "x64"
    assert "openengine_serve.llama_cpp llama.cpp CPU variant: x64 (forced)" in out.stderr
    assert "AVX = 1" not in features and "SSE3 = 1" not in features, features


def test_an_unknown_variant_is_refused_naming_the_ones_there_are():
    out = probe("pentium4")
    assert out.returncode != 0
    message = out.stderr.strip().splitlines()[-1]
    assert f"{CPU_VARIANT_ENV}=pentium4 is not a CPU variant of this build" in message
    assert "haswell" in message and "x64" in message, message
