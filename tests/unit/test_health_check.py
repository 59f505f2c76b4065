"""The standard-library health probe: its reading of answers and what `health` imports (its encoding:
test_wire.py)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time

import pytest

from openengine_serve.common import health_check as hp

# Modules a healthcheck must not pay for (each costs tens to hundreds of milliseconds of CPU to import).
HEAVY_MODULES = (
    "grpc",
    "google.protobuf",
    "grpc_health",
    "tiktoken",
    "mpi4py",
    "zmq",
    "prometheus_client",
    "asyncio",
    "openengine_serve.api",
    "openengine_serve.common.config",
    "openengine_serve.common.grpc_server",
    "openengine_serve.client",
)


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "openengine_serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    names = {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    return result, names


def heavy(names: set[str]) -> set[str]:
    return {n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY_MODULES)}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_help_imports_nothing_heavy():
    result, names = imported_modules("health", "--help")
    assert result.returncode == 0 and "--service" in result.stdout
    assert "openengine_serve.cli" in names  # the measurement saw the package at all
    assert not heavy(names), heavy(names)


def test_health_of_an_unreachable_target_imports_nothing_heavy():
    result, names = imported_modules("health", "--target", f"127.0.0.1:{closed_port()}", "--timeout", "2")
    assert result.returncode == 1
    assert result.stdout.startswith("readiness: UNREACHABLE (UNAVAILABLE"), result.stdout
    assert "openengine_serve.common.health_check" in names
    assert not heavy(names), heavy(names)


def test_health_with_an_api_key_stays_on_the_standard_library_probe():
    """grpc.health.v1 needs no key: the flag changes nothing and costs no import."""
    result, names = imported_modules(
        "health", "--target", f"127.0.0.1:{closed_port()}", "--timeout", "2", "--api-key", "k-unused"
    )
    assert result.returncode == 1
    assert result.stdout.startswith("readiness: UNREACHABLE (UNAVAILABLE"), result.stdout
    assert not heavy(names), heavy(names)


def test_health_over_tls_goes_through_grpcio():
    """The standard-library probe speaks h2c only: a TLS flag hands the check to grpcio."""
    result, names = imported_modules("health", "--target", f"127.0.0.1:{closed_port()}", "--timeout", "2", "--tls")
    assert result.returncode == 1
    assert result.stdout.startswith("readiness: UNREACHABLE (UNAVAILABLE"), result.stdout
    assert {"grpc", "openengine_serve.client"} <= names


def test_the_other_commands_still_load_their_configuration():
    result, names = imported_modules("frontend", "--help")
    assert result.returncode == 0 and "OPENENGINE_NATIVE_IO_THREADS" in result.stdout
    assert "openengine_serve.common.config" in names


def test_no_answer_is_a_timeout():
    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            hp.check(f"127.0.0.1:{listener.getsockname()[1]}", "liveness", 0.5)
        assert 0.4 < time.monotonic() - started < 3


@pytest.mark.parametrize(
    "target, expected",
    [
        ("127.0.0.1:50051", ("127.0.0.1", 50051)),
        ("frontend:8080", ("frontend", 8080)),
        ("[::1]:50051", ("::1", 50051)),
        ("dns:///frontend.ns.svc:50051", ("frontend.ns.svc", 50051)),
    ],
)
def test_split_target(target, expected):
    assert hp.split_target(target) == expected


@pytest.mark.parametrize("target", ["unix:/tmp/sock", "localhost", "::1:50051", "dns://8.8.8.8/h:1", "h:port"])
def test_targets_left_to_grpcio(target):
    with pytest.raises(hp.ProbeInconclusive):
        hp.split_target(target)


def grpc_body(message: bytes) -> bytes:
    return struct.pack(">BI", 0, len(message)) + message


@pytest.mark.parametrize(
    "message, status",
    [
        (b"\x08\x01", 1),
        (b"\x08\x02", 2),
        (b"", 0),
        (b"\x08\x03", 3),
        # unknown fields are skipped, the last status wins
        (b"\x12\x02ab\x08\x02\x08\x01\x1d\x00\x00\x00\x00", 1),
    ],
)
def test_serving_status(message, status):
    assert hp._serving_status(grpc_body(message)) == status


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00\x00\x00",
        grpc_body(b"\x08\x01")[:-1],
        b"\x01" + grpc_body(b"")[1:],
        grpc_body(b"\x08"),
        grpc_body(b"\x0b\x01"),
        grpc_body(b"\x12\x05ab"),
    ],
)
def test_no_well_formed_message_is_inconclusive(body):
    with pytest.raises(hp.ProbeInconclusive):
        hp._serving_status(body)


def test_status_names():
    assert [hp.status_name(s) for s in (0, 1, 2, 3, 7)] == ["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", "7"]
