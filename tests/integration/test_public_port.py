"""The public port honest by default and without an oracle, on both gRPC servers: request ids scoped per API key,
reflection of the public services only, errors that name no internal address or component, failed
authentication counted and logged (rate-limited), keys refused over plaintext unless allowed, a warning for a
port without keys, and the metrics port bound to OPENENGINE_METRICS_HOST."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import lifecycle_pb2, lora_pb2, server_pb2
from openengine_serve.client import Client, Credentials
from openengine_serve.frontend import auth

from . import processes
from .conftest import SERVERS

MODEL = "Qwen/Qwen3-0.6B"
KEYS = {"alice": ("user", "k-alice-p0rt"), "bob": ("user", "k-bob-p0rt"), "ops": ("admin", "k-ops-p0rt")}
REFUSED_LINE = "call refused by the API key check"


@pytest.fixture(scope="module", params=SERVERS)
def keyed(request, cluster, tmp_path_factory):
    """One frontend with API keys (plaintext allowed: loopback) serving metrics; (frontend, metrics port)."""
    coord, _nodes = cluster
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text("".join(f"{role} {name} {secret}\n" for name, (role, secret) in KEYS.items()))
    frontend, metrics_port = processes.with_metrics(
        processes.frontend(
            coord.target, request.param, OPENENGINE_API_KEYS_FILE=str(path), OPENENGINE_ALLOW_PLAINTEXT_KEYS="1"
        )
    )
    try:
        frontend.start().wait_ready(60)
        processes.wait_for(lambda: _ready_ranks(frontend.target) == 2, 20, "both nodes ready")
        yield frontend, metrics_port
    finally:
        frontend.stop()


def _ready_ranks(target: str) -> int:
    with client_for(target, "ops") as ops:
        return ops.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=2).parallelism.data_parallel_size


def client_for(target: str, name: str | None = None, secret: str | None = None) -> Client:
    key = secret if secret is not None else (KEYS[name][1] if name else "")
    return Client(target, credentials=Credentials(api_key=key), retries=False)


def generate_request(request_id: str, max_tokens: int) -> G.GenerateRequest:
    return G.GenerateRequest(
        request_id=request_id,
        model=MODEL,
        prompt="Tell a long story",
        stopping=G.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


def refusal_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def log_of(component: processes.Component) -> str:
    return (processes.LOG_DIR / f"{component.name}-{component.port}.log").read_text()


def test_the_same_request_id_under_two_keys_is_two_independent_requests(keyed):
    frontend, _ = keyed
    shared_id = f"shared-{uuid.uuid4()}"
    with client_for(frontend.target, "alice") as alice, client_for(frontend.target, "bob") as bob:
        alices = alice.inference.Generate(generate_request(shared_id, 3000), timeout=60)
        assert next(alices).request_id == shared_id
        # the id is in flight under alice's key: bob's request with it is his own, start to end
        for _ in range(2):  # and the id is free again for bob once his first one ended
            bobs = list(bob.inference.Generate(generate_request(shared_id, 20), timeout=30))
            assert {r.request_id for r in bobs} == {shared_id}
            assert bobs[-1].usage.completion_tokens == 20
        # within one key the id is still unique
        code, details = refusal_of(lambda: list(alice.inference.Generate(generate_request(shared_id, 5), timeout=10)))
        assert code == grpc.StatusCode.ALREADY_EXISTS, details
        assert details == f"request_id {shared_id!r} is already in flight; use an id that is not in flight"
        # bob's Abort of the id reaches his own (finished) request, never alice's running one
        reply = bob.control.Abort(lifecycle_pb2.AbortRequest(request_id=shared_id), timeout=5)
        assert reply.status == lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED, reply
        assert next(alices).HasField("token")
        reply = alice.control.Abort(lifecycle_pb2.AbortRequest(request_id=shared_id), timeout=5)
        assert reply.status == lifecycle_pb2.ABORT_STATUS_ABORTED, reply
        rest = list(alices)
        assert [r.finished.reason for r in rest if r.HasField("finished")] == [G.FINISH_REASON_CANCELLED]
        assert {r.request_id for r in rest} == {shared_id}


def test_failed_authentication_is_counted_and_logged_once_per_reason_and_interval(keyed):
    frontend, metrics_port = keyed
    before = processes.scrape(metrics_port)
    lines_before = log_of(frontend).count(REFUSED_LINE)
    calls = {"unknown_key": 5, "no_key": 3, "wrong_role": 2}
    with (
        client_for(frontend.target, secret="k-guessed") as guesser,
        client_for(frontend.target, secret="") as anonymous,
        client_for(frontend.target, "alice") as alice,
    ):
        for _ in range(calls["unknown_key"]):
            code, _ = refusal_of(lambda: guesser.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        for _ in range(calls["no_key"]):
            code, _ = refusal_of(lambda: list(anonymous.inference.Generate(generate_request("x", 1), timeout=5)))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        for _ in range(calls["wrong_role"]):
            code, _ = refusal_of(lambda: alice.control.ListLoras(lora_pb2.ListLorasRequest(), timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED
    after = processes.scrape(metrics_port)
    name = "openengine_frontend_auth_failures_total"
    counted = {
        reason: processes.metric(after, name, reason=reason) - processes.metric(before, name, reason=reason)
        for reason in calls
    }
    assert counted == calls
    log = log_of(frontend)
    new_lines = log.count(REFUSED_LINE) - lines_before
    # one line per reason: all within AUTH_FAILURE_LOG_INTERVAL_S, and nothing else failed on this frontend
    assert new_lines == len(calls), new_lines
    assert re.search(rf"{REFUSED_LINE}.*reason=unknown_key.*peer=\S*127\.0\.0\.1", log), "the caller's address"
    assert "k-guessed" not in log


def test_reflection_describes_only_the_public_services(stack):
    def ask(**question) -> reflection_pb2.ServerReflectionResponse:
        with grpc.insecure_channel(stack.frontend.target) as channel:
            [reply] = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(**question)]), timeout=5
            )
        return reply

    listed = {s.name for s in ask(list_services="").list_services_response.service}
    assert listed == {"openengine.v1.Inference", "openengine.v1.Control", "grpc.health.v1.Health"}
    assert ask(file_containing_symbol="openengine.v1.Inference").file_descriptor_response.file_descriptor_proto
    for question in (
        {"file_containing_symbol": "openengine_internal.v1.Coordinator"},
        {"file_containing_symbol": "openengine_internal.v1.EngineRequest"},
        {"file_by_filename": "openengine_internal/v1/cluster.proto"},
    ):
        reply = ask(**question)
        assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0], (question, reply)


@pytest.mark.parametrize("server", SERVERS)
def test_no_public_error_names_an_internal_address_or_component(server, deployment):
    """A duplicate id, the node gone mid-stream and after, the coordinator gone: every detail the client gets
    says what happened, and names no host, host:port, node id or frontend id (the logs keep them)."""
    coord = deployment.add(processes.coordinator())
    node = deployment.add(processes.node(coord.target, 0))
    frontend = deployment.add(processes.frontend(coord.target, server), 60)
    details: list[str] = []
    with Client(frontend.target, retries=False) as client:
        processes.wait_for(
            lambda: (
                client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=2).capacity.max_running_requests
            ),
            20,
            "the node ready on the frontend",
        )
        frontend_id = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5).instance_id
        healthy = client.control.Health(lifecycle_pb2.HealthRequest(include_inference_probe=True), timeout=15)
        assert healthy.state == lifecycle_pb2.HEALTH_STATE_READY, healthy
        details += [c.message for c in healthy.checks]
        stream = client.inference.Generate(generate_request("held", 8192), timeout=120)
        assert next(stream).HasField("token")
        code, detail = refusal_of(lambda: list(client.inference.Generate(generate_request("held", 5), timeout=10)))
        assert code == grpc.StatusCode.ALREADY_EXISTS
        details.append(detail)

        node.proc.send_signal(signal.SIGKILL)  # the node gone mid-stream
        [error] = [r.error for r in stream if r.HasField("error")]
        assert error.retryable and "was lost" in error.message, error
        details.append(error.message)
        code, detail = refusal_of(lambda: list(client.inference.Generate(generate_request("after", 5), timeout=10)))
        assert code == grpc.StatusCode.UNAVAILABLE, detail
        details.append(detail)

        coord.stop()  # the coordinator gone
        processes.wait_for(
            lambda: (
                refusal_of(lambda: client.control.Abort(lifecycle_pb2.AbortRequest(request_id="r"), timeout=5))[0]
                == grpc.StatusCode.UNAVAILABLE
            ),
            20,
            "Abort to find the coordinator unreachable",
        )
        details.append(
            refusal_of(lambda: client.control.Abort(lifecycle_pb2.AbortRequest(request_id="r"), timeout=5))[1]
        )
        code, detail = refusal_of(lambda: list(client.inference.Generate(generate_request("later", 5), timeout=10)))
        assert code == grpc.StatusCode.UNAVAILABLE, detail
        details.append(detail)
        health = client.control.Health(lifecycle_pb2.HealthRequest(include_inference_probe=True), timeout=15)
        assert any("unreachable" in c.message for c in health.checks), health
        details += [c.message for c in health.checks]
    internal = [f"-{socket.gethostname()}-", frontend_id, coord.target, node.target, str(coord.port), str(node.port)]
    host_port = re.compile(r"\b[\w.-]+:\d{2,5}\b")
    for detail in details:
        assert detail and not [name for name in internal if name in detail], detail
        assert not host_port.search(detail), detail
    log = log_of(frontend)
    assert node.target in log and frontend_id in log  # the operator still finds them


def run_frontend_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "frontend",
            "--host",
            "127.0.0.1",
            "--port",
            str(processes.free_port()),
            "--metrics-port",
            "0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


def test_keys_over_plaintext_stop_the_start_with_one_line_naming_the_way_out(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("user alice k-plain-1\n")
    result = run_frontend_cli("--api-keys-file", str(keys))
    assert result.returncode == 2
    assert result.stderr.strip() == f"openengine-serve: error: {auth.PLAINTEXT_KEYS}"
    assert "k-plain-1" not in result.stderr
    result = run_frontend_cli("--api-keys-file", str(keys), "--auth", "none")
    assert result.returncode == 2
    assert "OPENENGINE_AUTH=none and OPENENGINE_API_KEYS_FILE are both set" in result.stderr
    result = run_frontend_cli(env={"OPENENGINE_AUTH": "off"})
    assert result.returncode == 2 and "OPENENGINE_AUTH must be none (or unset), got 'off'" in result.stderr


def _start_and_read_log(frontend: processes.Component, listening_lines: int) -> str:
    frontend.start()
    try:
        processes.wait_for(
            lambda: log_of(frontend).count("frontend listening") >= listening_lines, 60, "the frontend listening"
        )
    finally:
        frontend.stop()
    return log_of(frontend)


def test_a_port_without_keys_warns_once_at_start_unless_auth_none(cluster):
    coord, _ = cluster
    warning = auth.OPEN_PORT_WARNING
    open_log = _start_and_read_log(processes.frontend(coord.target, "grpcio", "--workers", "2"), 2)
    assert open_log.count(warning) == 1, "the supervisor warns; its two workers do not"
    assert "level=warning" in next(line for line in open_log.splitlines() if warning in line).lower()
    quiet_log = _start_and_read_log(processes.frontend(coord.target, "grpcio", OPENENGINE_AUTH="none"), 1)
    assert warning not in quiet_log


def test_metrics_bind_the_metrics_host_on_every_component(deployment):
    """OPENENGINE_METRICS_HOST moves the metrics port off the gRPC host; unset, the metrics follow OPENENGINE_HOST."""

    def answers(host: str, port: int) -> bool:
        try:
            return b"openengine_" in urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read()
        except OSError:
            return False

    moved = {"OPENENGINE_METRICS_HOST": "127.0.0.2"}
    coord, coord_metrics = processes.with_metrics(processes.coordinator(**moved))
    deployment.add(coord)
    node, node_metrics = processes.with_metrics(processes.node(coord.target, 0))  # metrics host unset
    deployment.add(node)
    frontend, frontend_metrics = processes.with_metrics(processes.frontend(coord.target, "pygrpc-native", **moved))
    deployment.add(frontend, 60)
    for port in (coord_metrics, frontend_metrics):
        assert answers("127.0.0.2", port) and not answers("127.0.0.1", port)
    assert answers("127.0.0.1", node_metrics) and not answers("127.0.0.2", node_metrics)
