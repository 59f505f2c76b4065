"""Ways to spread clients over frontends added later: a `dns:///` target (a headless Service's name, one
address per frontend) that the client library balances round_robin, and grpcio's maximum connection age."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openengine_serve.api.openengine.v1 import server_pb2
from openengine_serve.client import Client, channel_options, is_serving
from openengine_serve.local import free_port

from . import processes
from .conftest import SERVERS
from .dns import LoopbackDns

NAME = "frontends.openengine.test"
CALLS = 30


def start_frontends(server: str, hosts: list[str], port: int, *extra: str) -> list[processes.Component]:
    """Frontends without a coordinator (Control and liveness answer without one)."""
    frontends = []
    for host in hosts:
        frontend = processes.frontend(f"127.0.0.1:{free_port()}", server, *extra)
        frontend.host, frontend.port = host, port
        frontends.append(frontend.start())
    for frontend in frontends:
        processes.wait_for(lambda: frontend.proc.poll() is None and is_serving(frontend.target, "liveness"), 60,
                           f"{frontend.target} liveness")
    return frontends


@pytest.mark.parametrize("server", SERVERS)
def test_dns_target_spreads_calls_over_every_address(server):
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    port = free_port()
    frontends = start_frontends(server, hosts, port)
    try:
        instance_ids = {processes_id(f.target) for f in frontends}
        assert len(instance_ids) == 3
        with LoopbackDns(NAME, hosts) as dns, Client(dns.target(port)) as client:
            seen = Counter(client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5).instance_id
                           for _ in range(CALLS))
            assert dns.queries >= 1  # the name really was resolved through this server
        assert set(seen) == instance_ids, seen
        # round_robin: each address gets its turn once all three are connected
        assert min(seen.values()) >= CALLS // 3 - 2, seen
    finally:
        for frontend in frontends:
            frontend.stop()


def processes_id(target: str) -> str:
    with Client(target) as client:
        return client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5).instance_id


def test_host_port_targets_keep_pick_first():
    options = dict(channel_options(True, "127.0.0.1:50051"))
    assert "grpc.lb_policy_name" not in options
    assert dict(channel_options(True, "dns:///frontend.ns.svc:50051"))["grpc.lb_policy_name"] == "round_robin"
    assert dict(channel_options(False, "dns://10.0.0.10/frontend:50051"))["grpc.lb_policy_name"] == "round_robin"


def _states(target: str, seconds: float) -> list[tuple[float, str]]:
    channel = grpc.insecure_channel(target, options=channel_options())
    states: list[tuple[float, str]] = []
    started = time.monotonic()
    channel.subscribe(lambda state: states.append((time.monotonic() - started, state.name)), try_to_connect=True)
    time.sleep(seconds)
    channel.close()
    return states


def test_max_connection_age_moves_clients_on_grpcio():
    """With OPENENGINE_MAX_CONNECTION_AGE_S=1 the connection is sent away after about a second (the channel goes
    IDLE and the next call reconnects, possibly elsewhere); a call open at that moment keeps its grace."""
    port = free_port()
    aged, plain = (start_frontends("grpcio", [host], port, *extra) [0] for host, extra in
                   (("127.0.0.1", ("--max-connection-age-s", "1", "--drain-timeout-s", "2")), ("127.0.0.2", ())))
    try:
        watch_end: dict[str, float | str] = {}

        def watch() -> None:
            channel = grpc.insecure_channel(aged.target, options=channel_options(retries=False))
            started = time.monotonic()
            try:
                for _ in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="liveness"),
                                                                   timeout=20):
                    pass
                watch_end["code"] = "OK"
            except grpc.RpcError as exc:
                watch_end["code"] = exc.code().name
            watch_end["after_s"] = time.monotonic() - started
            channel.close()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        aged_states = _states(aged.target, 3.0)
        plain_states = _states(plain.target, 3.0)
        watcher.join(timeout=20)
    finally:
        aged.stop()
        plain.stop()
    ready = [t for t, s in aged_states if s == "READY"]
    idle_after_ready = [t for t, s in aged_states if s == "IDLE" and ready and t > ready[0]]
    assert idle_after_ready and 0.8 < idle_after_ready[0] - ready[0] < 2.0, aged_states
    assert [s for _, s in plain_states][-1] == "READY", plain_states
    # the open stream outlived the age by the grace (OPENENGINE_DRAIN_TIMEOUT_S) and was then cut
    assert watch_end["code"] == "UNAVAILABLE" and 2.5 < watch_end["after_s"] < 8, watch_end


def test_max_connection_age_is_refused_with_pygrpc_native():
    result = subprocess.run([sys.executable, "-m", "openengine_serve", "frontend", "--grpc-server", "pygrpc-native",
                             "--max-connection-age-s", "30", "--port", str(free_port()), "--metrics-port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "OPENENGINE_MAX_CONNECTION_AGE_S is grpcio only" in result.stderr, result.stderr
