"""`openengine-serve health` (the standard-library probe) answers what grpcio's Check answers, on both servers,
without importing grpcio when the server gives a status."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from openengine_serve.client import check_health, is_serving
from openengine_serve.common import health_check
from openengine_serve.local import free_port

from ..unit.test_health_check import heavy, imported_modules
from . import processes
from .conftest import SERVERS


@pytest.fixture(scope="module", params=SERVERS)
def lone_frontend(request):
    """A frontend without a coordinator: liveness SERVING, readiness NOT_SERVING."""
    frontend = processes.frontend(f"127.0.0.1:{free_port()}", request.param).start()
    try:
        processes.wait_for(
            lambda: frontend.proc.poll() is None and is_serving(frontend.target, "liveness"), 60, "frontend liveness"
        )
        yield frontend
    finally:
        frontend.stop()


@pytest.mark.parametrize("service", ["liveness", "readiness", "", "openengine.v1.Inference"])
def test_probe_agrees_with_grpcio(lone_frontend, service):
    assert health_check.check(lone_frontend.target, service, 5) == check_health(lone_frontend.target, service, 5)


def test_unknown_service_is_left_to_grpcio(lone_frontend):
    with pytest.raises(health_check.ProbeInconclusive):
        health_check.check(lone_frontend.target, "no-such-service", 5)
    with pytest.raises(grpc.RpcError) as refused:
        check_health(lone_frontend.target, "no-such-service", 5)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "health",
            "--target",
            lone_frontend.target,
            "--service",
            "no-such-service",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1 and cli.stdout == "no-such-service: UNREACHABLE (NOT_FOUND: )\n", cli


@pytest.mark.parametrize(
    "service, code, printed", [("liveness", 0, "liveness: SERVING\n"), ("readiness", 1, "readiness: NOT_SERVING\n")]
)
def test_cli_answers_without_grpcio(lone_frontend, service, code, printed):
    result, names = imported_modules("health", "--target", lone_frontend.target, "--service", service)
    assert (result.returncode, result.stdout) == (code, printed), result.stderr[-2000:]
    assert not heavy(names), heavy(names)


def test_serving_readiness_on_the_stack(stack):
    """A deployment with nodes: readiness SERVING through the probe, as through grpcio."""
    assert health_check.check(stack.frontend.target, "readiness", 5) == health_check.SERVING
    assert check_health(stack.frontend.target, "readiness", 5) == health_check.SERVING
