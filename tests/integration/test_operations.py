"""What orchestration relies on: health transitions, drain, rolling restarts, and faults with real kills."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openengine_serve.api.openengine.v1 import error_pb2, generation_pb2, lifecycle_pb2, server_pb2
from openengine_serve.client import Client
from openengine_serve.frontend.supervisor import READY_FILE_VARIABLE

from . import processes
from .conftest import SERVERS
from .processes import Deployment, wait_for
from .conftest import by_output, request

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def small_cluster(d: Deployment, nodes: int = 2, coordinator_port: int | None = None):
    coord = processes.coordinator()
    if coordinator_port:
        coord.port = coordinator_port
    d.add(coord)
    return coord, [d.add(processes.node(coord.target, rank)) for rank in range(nodes)]


class Watcher:
    """Follows grpc.health.v1 Watch for one service in a background thread."""

    def __init__(self, target: str, service: str) -> None:
        self.statuses: list[int] = []
        self._channel = grpc.insecure_channel(target)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=service), wait_for_ready=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for reply in self._call:
                self.statuses.append(reply.status)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


def first_token_then(stream_iter):
    first = next(stream_iter)
    assert first.WhichOneof("event") == "token"
    return first


@pytest.mark.parametrize("server", SERVERS)
def test_frontend_readiness_watch_and_sigterm_finishes_stream(cluster, server, deployment):
    coord, _ = cluster
    fe = processes.frontend(coord.target, server).start()
    deployment.components.append(fe)
    watch = Watcher(fe.target, "readiness")
    liveness = Watcher(fe.target, "liveness")
    fe.wait_ready()
    wait_for(lambda: SERVING in watch.statuses, 10, "readiness SERVING through Watch")
    with Client(fe.target, retries=False) as client:
        stream = client.inference.Generate(request(max_tokens=1000), timeout=60)
        first_token_then(stream)
        fe.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: watch.statuses[-1] == NOT_SERVING, 5, "readiness NOT_SERVING at the start of the drain")
        with Client(fe.target, retries=False) as late:
            with pytest.raises(grpc.RpcError) as refused:
                list(late.inference.Generate(request(max_tokens=5), timeout=10))
        rest = list(stream)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    out = by_output(rest)[0]
    assert out["finished"][0].reason == generation_pb2.FINISH_REASON_LENGTH
    assert len(out["ids"]) == 999 and rest[-1].HasField("usage")
    assert fe.proc.wait(timeout=30) == 0
    assert liveness.statuses and NOT_SERVING not in liveness.statuses
    watch.close()
    liveness.close()


@pytest.mark.parametrize("server", SERVERS)
def test_drain_deadline_ends_stream_with_draining_error(cluster, server, deployment):
    coord, _ = cluster
    fe = deployment.add(processes.frontend(coord.target, server, "--drain-timeout-s", "1"))
    with Client(fe.target, retries=False) as client:
        stream = client.inference.Generate(request(max_tokens=8000), timeout=60)
        first_token_then(stream)
        started = time.monotonic()
        fe.proc.send_signal(signal.SIGTERM)
        rest = list(stream)
    assert time.monotonic() - started < 10
    assert rest[-1].WhichOneof("event") == "error"
    assert rest[-1].error.code == error_pb2.ERROR_CODE_DRAINING and rest[-1].error.retryable
    assert sum(r.WhichOneof("event") == "error" for r in rest) == 1
    assert fe.proc.wait(timeout=30) == 0


@pytest.mark.parametrize("server", SERVERS)
def test_rolling_restart_under_load_loses_nothing(cluster, server, deployment):
    coord, _ = cluster
    port = processes.free_port()
    frontends = []
    for _ in range(2):
        fe = processes.frontend(coord.target, server, "--drain-timeout-s", "5")
        fe.port = port
        frontends.append(deployment.add(fe))
    results = {"ok": 0, "failed": []}
    stop = threading.Event()

    def load():
        with Client(f"127.0.0.1:{port}") as client:
            while not stop.is_set():
                try:
                    responses = list(client.generate(request(max_tokens=50), timeout=30))
                    if responses[-1].HasField("usage") and responses[-1].WhichOneof("event") == "finished":
                        results["ok"] += 1
                    else:
                        results["failed"].append(responses[-1])
                except grpc.RpcError as exc:
                    results["failed"].append(f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        for fe in frontends:  # one at a time, like a rolling update
            assert fe.stop() == 0
            fe.start().wait_ready()
            time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    hung = [t for t in threads if t.is_alive()]
    assert not hung, "a request hung; its thread is at:\n" + "".join(
        "".join(traceback.format_stack(sys._current_frames()[t.ident])) for t in hung)
    assert results["failed"] == []
    assert results["ok"] > 20


def test_node_killed_mid_stream(deployment):
    coord, nodes = small_cluster(deployment)
    fe = deployment.add(processes.frontend(coord.target, "grpcio"))
    with Client(fe.target, retries=False) as client:
        wait_for(lambda: client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
                 .parallelism.data_parallel_size == 2, 10, "two ready nodes")
        stream = client.inference.Generate(request(max_tokens=5000), timeout=60,
                                           metadata=(("openengine-target-dp-rank", "0"),))
        first_token_then(stream)
        workers = processes.engine_worker_pids(nodes[0].proc.pid)
        killed_at = time.monotonic()
        nodes[0].proc.kill()
        rest = list(stream)
        assert time.monotonic() - killed_at < 10
        assert rest[-1].WhichOneof("event") == "error" and rest[-1].error.retryable
        assert sum(r.WhichOneof("event") == "error" for r in rest) == 1
        wait_for(lambda: client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
                 .parallelism.data_parallel_size == 1, 10, "the coordinator to mark the node down")
        for _ in range(3):
            assert list(client.generate(request(max_tokens=5), timeout=30))[-1].HasField("usage")
    wait_for(lambda: not any(map(processes.alive, workers)), 10,
             "the dead node's engine worker to exit too")


def test_engine_worker_killed_node_respawns(deployment):
    coord, nodes = small_cluster(deployment, nodes=1)
    fe = deployment.add(processes.frontend(coord.target, "grpcio"))
    node = nodes[0]
    watch = Watcher(node.target, "readiness")
    wait_for(lambda: watch.statuses and watch.statuses[-1] == SERVING, 10, "node readiness SERVING")
    with Client(fe.target, retries=False) as client:
        stream = client.inference.Generate(request(max_tokens=5000), timeout=60)
        first_token_then(stream)
        worker = processes.engine_worker_pids(node.proc.pid)[0]
        os.kill(worker, signal.SIGKILL)
        rest = list(stream)
        assert rest[-1].WhichOneof("event") == "error" and rest[-1].error.retryable
        wait_for(lambda: NOT_SERVING in watch.statuses and watch.statuses[-1] == SERVING, 60,
                 "node readiness NOT_SERVING then SERVING again")
        assert node.proc.poll() is None
        wait_for(lambda: _generates(client), 20, "a request to succeed after the respawn")
    watch.close()


def _generates(client) -> bool:
    try:
        return list(client.generate(request(max_tokens=3), timeout=10))[-1].HasField("usage")
    except grpc.RpcError:
        return False


def test_coordinator_restart(deployment):
    coord, nodes = small_cluster(deployment, coordinator_port=processes.free_port())
    fe = deployment.add(processes.frontend(coord.target, "grpcio"))
    with Client(fe.target, retries=False) as client:
        stream = client.inference.Generate(request(max_tokens=1500), timeout=60)
        first_token_then(stream)
        coord.proc.kill()
        coord.proc.wait()
        rest = list(stream)
        assert rest[-1].WhichOneof("event") == "finished", "streams in flight continue"

        def degraded():
            h = client.control.Health(lifecycle_pb2.HealthRequest(), timeout=5)
            return h.state == lifecycle_pb2.HEALTH_STATE_DEGRADED and h
        health = wait_for(degraded, 10, "frontend Health DEGRADED")
        assert any(c.name == "coordinator" and "unreachable" in c.message for c in health.checks)
        assert list(client.generate(request(max_tokens=5), timeout=30))[-1].HasField("usage"), \
            "served from the last known node table"
        coord.start().wait_ready()
        wait_for(lambda: client.control.Health(lifecycle_pb2.HealthRequest(), timeout=5).state
                 == lifecycle_pb2.HEALTH_STATE_READY, 10, "Health READY after the coordinator restart")
        wait_for(lambda: len(client.control.GetLoad(server_pb2.GetLoadRequest(include_per_rank=True),
                                                    timeout=5).ranks) == 2, 10, "both nodes re-registered")


def test_frontend_worker_killed_is_restarted(cluster, deployment):
    coord, _ = cluster
    fe = deployment.add(processes.frontend(coord.target, "grpcio", "--workers", "2"))
    workers = wait_for(lambda: [p for p in processes.descendants(fe.proc.pid)
                                if "frontend" in processes.cmdline(p)][:2], 10, "two workers")
    # Only a worker that has served is restarted (one dying during start-up stops the supervisor): kill
    # one once both have written the ready file the supervisor gave them.
    ready_files = [processes.environ(pid)[READY_FILE_VARIABLE] for pid in workers]
    wait_for(lambda: all(os.path.exists(path) for path in ready_files), 30, "both workers ready")
    os.kill(workers[0], signal.SIGKILL)
    wait_for(lambda: len([p for p in processes.descendants(fe.proc.pid)
                          if "frontend" in processes.cmdline(p) and p != workers[0]]) == 2, 30,
             "the supervisor to start a replacement worker")
    fe.wait_ready()
    with Client(fe.target) as client:
        assert list(client.generate(request(max_tokens=3), timeout=10))[-1].HasField("usage")
    assert fe.proc.poll() is None


def test_full_deployment_refuses_with_resource_exhausted(deployment):
    coord = deployment.add(processes.coordinator())
    deployment.add(processes.node(coord.target, 0, "--max-batch", "1", "--max-queue", "0"))
    fe = deployment.add(processes.frontend(coord.target, "grpcio"))
    with Client(fe.target, retries=False) as client:
        stream = client.inference.Generate(request(max_tokens=5000), timeout=60)
        first_token_then(stream)
        with pytest.raises(grpc.RpcError) as full:
            list(client.inference.Generate(request(max_tokens=5), timeout=10))
        stream.cancel()
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "capacity" in full.value.details() or "full" in full.value.details()
