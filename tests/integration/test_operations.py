"""What orchestration relies on: health transitions, drain, rolling restarts, and faults with real kills."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openengine_serve.api.openengine.v1 import error_pb2, generation_pb2, lifecycle_pb2, server_pb2
from openengine_serve.client import Client, is_serving
from openengine_serve.frontend.supervisor import READY_FILE_VARIABLE

from . import processes
from .conftest import SERVERS, by_output, request
from .processes import Deployment, wait_for
from .reference import Case, mismatch
from .test_generate import served_by

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
            health_pb2.HealthCheckRequest(service=service), wait_for_ready=True
        )
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
        first = first_token_then(stream)
        fe.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: watch.statuses[-1] == NOT_SERVING, 5, "readiness NOT_SERVING at the start of the drain")
        with Client(fe.target, retries=False) as late:
            with pytest.raises(grpc.RpcError) as refused:
                list(late.inference.Generate(request(max_tokens=5), timeout=10))
        rest = list(stream)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    out = by_output(rest)[0]
    assert out["finished"][0].reason == generation_pb2.FINISH_REASON_LENGTH
    # Every token arrives once; the first message may carry several (steps coalesced while the stream was behind).
    assert len(first.token.tokens) + len(out["ids"]) == 1000 == rest[-1].usage.completion_tokens
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


ROLLING_MAX_TOKENS = 50
ROLLING_MIN_SERVED = 5  # requests each frontend process must have finished before it stops
ROLLING_LOG = processes.LOG_DIR / "rolling-restart.jsonl"  # one line per run: what the clients saw


class LoadLedger:
    """Every request of the rolling-restart load, accounted for under one lock. Each request is a case of its
    own (prompt, sampling), and what it streamed is compared with the model's reference token for token."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._cases = random.Random("rolling-restart")
        self.finished = 0
        self.failed: list[str] = []  # a stream that did not match its reference to the end (a loss)
        self.raised: list[str] = []  # anything a load thread did not expect, with its traceback
        # what a client without retries sees: "OK" (every token right) or the gRPC code of a refusal
        self.no_retry: dict[str, collections.Counter] = {
            "persistent": collections.Counter(),
            "fresh": collections.Counter(),
        }
        self.no_retry_wrong: list[str] = []  # a no-retry call that was neither right nor refused before any message

    def next_case(self) -> Case:
        with self.lock:
            return Case.random(self._cases, ROLLING_MAX_TOKENS)

    def retrying_call(self, client: Client) -> None:
        """The project's client: nothing may be lost."""
        case = self.next_case()
        try:
            responses = list(client.generate(case.request(), timeout=30))
        except grpc.RpcError as exc:
            with self.lock:
                self.failed.append(f"{exc.code().name}: {exc.details()}")
            return
        difference = mismatch(case, responses)
        with self.lock:
            if difference is None:
                self.finished += 1
            else:
                self.failed.append(f"{case}: {difference}")

    def no_retry_call(self, client: Client, kind: str) -> None:
        """A plain gRPC call without retries: it streams every token right, or it is refused UNAVAILABLE (the
        frontend stopping or gone) before its first message; anything else is a loss."""
        case = self.next_case()
        responses = []
        try:
            for response in client.inference.Generate(case.request(), timeout=30):
                responses.append(response)
            difference = mismatch(case, responses)
            code = "OK" if difference is None else "OK but wrong"
        except grpc.RpcError as exc:
            code, difference = exc.code().name, f"{exc.code().name} after {len(responses)} messages: {exc.details()}"
        with self.lock:
            self.no_retry[kind][code] += 1
            if not (code == "OK" or (code == "UNAVAILABLE" and not responses)):
                self.no_retry_wrong.append(f"{kind} {case}: {difference}")
        if code != "OK":
            time.sleep(0.05)  # a refused client backs off a little, as any would


def _load(port: int, stop: threading.Event, ledger: LoadLedger, *, retries: bool, fresh_connection: bool) -> None:
    """One client thread until `stop`. A fresh connection per request spreads load over the processes (and
    reaches replacements); a persistent one meets pygrpc-native's stopping listener. Whatever it did not
    expect is recorded with its traceback: a thread never dies silently."""
    client = None
    kind = "fresh" if fresh_connection else "persistent"
    try:
        while not stop.is_set():
            if client is None or fresh_connection:
                if client is not None:
                    client.close()
                client = Client(f"127.0.0.1:{port}", retries=retries)
            if retries:
                ledger.retrying_call(client)
            else:
                ledger.no_retry_call(client, kind)
    except BaseException:
        with ledger.lock:
            ledger.raised.append(traceback.format_exc())
    finally:
        if client is not None:
            client.close()


def finished_on(metrics_port: int) -> float:
    return processes.metric(
        processes.scrape(metrics_port), "openengine_frontend_requests_total", status="finished", code="OK", key="-"
    )


def wait_instance_ready(fe: processes.Component, instance_id: str, timeout: float = 60.0) -> None:
    """Readiness of one process among several sharing a port: fresh connections until one lands on it
    (ServerInfo.instance_id), then grpc.health readiness over that same connection."""

    def ready() -> bool:
        if fe.proc.poll() is not None:
            raise AssertionError(f"{instance_id} exited with {fe.proc.returncode}")
        try:
            with Client(fe.target, retries=False) as client:
                info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=2)
                return (
                    info.instance_id == instance_id
                    and client.health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2).status
                    == SERVING
                )
        except grpc.RpcError:
            return False

    wait_for(ready, timeout, f"{instance_id} readiness on its own connection", interval=0.02)


@pytest.mark.parametrize("server", SERVERS)
def test_rolling_restart_under_load_loses_nothing(cluster, server, deployment):
    coord, _ = cluster
    port = processes.free_port()

    def start_frontend(name: str):
        instance_id = f"rolling-{server}-{name}"
        fe, metrics_port = processes.with_metrics(
            processes.frontend(coord.target, server, "--drain-timeout-s", "5", "--frontend-id", instance_id)
        )
        fe.name, fe.port = instance_id, port
        deployment.components.append(fe.start())
        wait_instance_ready(fe, instance_id)
        return fe, name, metrics_port

    originals = [start_frontend("a"), start_frontend("b")]
    ledger = LoadLedger()
    stop = threading.Event()
    threads = [
        threading.Thread(
            target=_load, args=(port, stop, ledger), daemon=True, kwargs={"retries": retries, "fresh_connection": fresh}
        )
        for retries, fresh in ((True, False), (True, False), (True, True), (True, True), (False, False), (False, True))
    ]
    served = {}
    for t in threads:
        t.start()
    try:
        replacements = []
        for fe, name, metrics_port in originals:  # one at a time, like a rolling update
            served[name] = wait_for(
                lambda: (n := finished_on(metrics_port)) >= ROLLING_MIN_SERVED and n,
                30,
                f"load to reach frontend {name} before it stops",
            )
            assert fe.stop() == 0
            replacements.append(start_frontend(name + "2"))
        for _fe, name, metrics_port in replacements:
            served[name] = wait_for(
                lambda: (n := finished_on(metrics_port)) >= ROLLING_MIN_SERVED and n,
                30,
                f"load to reach replacement {name}",
            )
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    hung = [t for t in threads if t.is_alive()]
    assert not hung, "a request hung; its thread is at:\n" + "".join(
        "".join(traceback.format_stack(sys._current_frames()[t.ident])) for t in hung
    )
    with ledger.lock:
        no_retry = {kind: dict(codes) for kind, codes in ledger.no_retry.items()}
        figures = {
            "server": server,
            "finished": ledger.finished,
            "finished_per_process": served,
            "no_retry_client": no_retry,
            "failed": len(ledger.failed),
            "no_retry_wrong": len(ledger.no_retry_wrong),
            "raised": len(ledger.raised),
        }
    with ROLLING_LOG.open("a") as log:
        log.write(json.dumps(figures) + "\n")
    print(f"\nrolling restart: {figures}")
    with ledger.lock:
        assert ledger.raised == [], "a load thread raised:\n" + "\n".join(ledger.raised)
        assert ledger.failed == [], "a retrying client's stream differs from its reference"
        assert ledger.no_retry_wrong == [], "a no-retry call neither matched its reference nor was refused"
        assert ledger.finished > 20
        assert all(codes["OK"] > 0 for codes in ledger.no_retry.values()), no_retry


def test_node_killed_mid_stream(deployment):
    coord, nodes = small_cluster(deployment)
    fe = deployment.add(processes.frontend(coord.target, "grpcio"))
    with Client(fe.target, retries=False) as client:
        wait_for(
            lambda: (
                client.control.GetServerInfo(
                    server_pb2.GetServerInfoRequest(), timeout=5
                ).parallelism.data_parallel_size
                == 2
            ),
            10,
            "two ready nodes",
        )
        stream = client.inference.Generate(
            request(max_tokens=5000), timeout=60, metadata=(("openengine-target-dp-rank", "0"),)
        )
        first_token_then(stream)
        workers = processes.engine_worker_pids(nodes[0].proc.pid)
        killed_at = time.monotonic()
        nodes[0].proc.kill()
        rest = list(stream)
        assert time.monotonic() - killed_at < 10
        assert rest[-1].WhichOneof("event") == "error" and rest[-1].error.retryable
        assert sum(r.WhichOneof("event") == "error" for r in rest) == 1
        wait_for(
            lambda: (
                client.control.GetServerInfo(
                    server_pb2.GetServerInfoRequest(), timeout=5
                ).parallelism.data_parallel_size
                == 1
            ),
            10,
            "the coordinator to mark the node down",
        )
        for _ in range(3):
            assert list(client.generate(request(max_tokens=5), timeout=30))[-1].HasField("usage")
    wait_for(lambda: not any(map(processes.alive, workers)), 10, "the dead node's engine worker to exit too")


def test_engine_worker_killed_node_respawns(deployment):
    coord = deployment.add(processes.coordinator())
    node, node_metrics = processes.with_metrics(processes.node(coord.target, 0))
    deployment.add(node)
    fe, fe_metrics = processes.with_metrics(processes.frontend(coord.target, "grpcio"))
    deployment.add(fe)
    restarts = "openengine_node_worker_restarts"
    assert processes.metric(processes.scrape(node_metrics), restarts) == 0
    watch = Watcher(node.target, "readiness")
    wait_for(lambda: watch.statuses and watch.statuses[-1] == SERVING, 10, "node readiness SERVING")
    with Client(fe.target, retries=False) as client:
        stream = client.inference.Generate(request(max_tokens=5000), timeout=60)
        first_token_then(stream)
        worker = processes.engine_worker_pids(node.proc.pid)[0]
        os.kill(worker, signal.SIGKILL)
        rest = list(stream)
        assert rest[-1].WhichOneof("event") == "error" and rest[-1].error.retryable
        wait_for(
            lambda: NOT_SERVING in watch.statuses and watch.statuses[-1] == SERVING,
            60,
            "node readiness NOT_SERVING then SERVING again",
        )
        assert node.proc.poll() is None
        wait_for(lambda: _generates(client), 20, "a request to succeed after the respawn")
    watch.close()
    assert processes.metric(processes.scrape(node_metrics), restarts) == 1
    assert (
        processes.metric(
            processes.scrape(fe_metrics), "openengine_frontend_requests_total", status="failed", code="OK", key="-"
        )
        == 1
    ), "the stream that ended with an EngineError"


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
        assert list(client.generate(request(max_tokens=5), timeout=30))[-1].HasField("usage"), (
            "served from the last known node table"
        )
        coord.start().wait_ready()
        wait_for(
            lambda: (
                client.control.Health(lifecycle_pb2.HealthRequest(), timeout=5).state
                == lifecycle_pb2.HEALTH_STATE_READY
            ),
            10,
            "Health READY after the coordinator restart",
        )
        wait_for(
            lambda: len(client.control.GetLoad(server_pb2.GetLoadRequest(include_per_rank=True), timeout=5).ranks) == 2,
            10,
            "both nodes re-registered",
        )


def test_after_a_long_coordinator_outage_its_node_and_frontend_register_within_seconds(deployment):
    """gRPC's default reconnection backoff would leave them away for up to 120 s after such an outage (8-12 s
    after this one); internal channels cap it (common/tls.py : INTERNAL_CHANNEL_OPTIONS)."""
    coord, _ = small_cluster(deployment, nodes=1)
    deployment.add(processes.frontend(coord.target, "grpcio"))
    log = processes.LOG_DIR / f"{coord.name}-{coord.port}.log"
    wait_for(lambda: 'event="frontend registered"' in log.read_text(errors="replace"), 10, "the frontend registered")
    coord.stop()
    time.sleep(30)
    text = log.read_text(errors="replace")
    before = {peer: text.count(f'event="{peer} registered"') for peer in ("node", "frontend")}
    coord.start().wait_ready()
    for peer, count in before.items():
        wait_for(
            lambda peer=peer, count=count: log.read_text(errors="replace").count(f'event="{peer} registered"') > count,
            6,
            f"the {peer} registered again",
        )


def test_frontend_worker_killed_is_restarted(cluster, deployment):
    coord, _ = cluster
    fe = deployment.add(processes.frontend(coord.target, "grpcio", "--workers", "2"))
    workers = wait_for(
        lambda: [p for p in processes.descendants(fe.proc.pid) if "frontend" in processes.cmdline(p)][:2],
        10,
        "two workers",
    )
    # Only a worker that has served is restarted (one dying during start-up stops the supervisor): kill
    # one once both have written the ready file the supervisor gave them.
    ready_files = [processes.environ(pid)[READY_FILE_VARIABLE] for pid in workers]
    wait_for(lambda: all(os.path.exists(path) for path in ready_files), 30, "both workers ready")
    os.kill(workers[0], signal.SIGKILL)
    wait_for(
        lambda: (
            len(
                [
                    p
                    for p in processes.descendants(fe.proc.pid)
                    if "frontend" in processes.cmdline(p) and p != workers[0]
                ]
            )
            == 2
        ),
        30,
        "the supervisor to start a replacement worker",
    )
    fe.wait_ready()
    with Client(fe.target) as client:
        assert list(client.generate(request(max_tokens=3), timeout=10))[-1].HasField("usage")
    assert fe.proc.poll() is None


def test_full_deployment_refuses_with_resource_exhausted(deployment):
    """A node with room for one request: a second is refused, counted by the coordinator, and the inference
    probe (which needs a slot too) reports DEGRADED while the other checks stay READY."""
    coord, coord_metrics = processes.with_metrics(processes.coordinator())
    deployment.add(coord)
    deployment.add(processes.node(coord.target, 0, "--max-batch", "1", "--max-queue", "0"))
    fe = deployment.add(processes.frontend(coord.target, "grpcio"))
    probe = lifecycle_pb2.HealthRequest(include_inference_probe=True)
    with Client(fe.target, retries=False) as client:
        assert client.control.Health(probe, timeout=10).state == lifecycle_pb2.HEALTH_STATE_READY
        stream = client.inference.Generate(request(max_tokens=8000), timeout=60)
        first_token_then(stream)
        with pytest.raises(grpc.RpcError) as full:
            list(client.inference.Generate(request(max_tokens=5), timeout=10))
        health = client.control.Health(probe, timeout=10)
        # Counted before the slot is freed: the probes polled below are refused too until the coordinator
        # hears of the free slot, how many depends on timing.
        refusals = processes.metric(
            processes.scrape(coord_metrics), "openengine_coordinator_refusals_total", reason="deployment_full"
        )
        stream.cancel()
        wait_for(
            lambda: client.control.Health(probe, timeout=10).state == lifecycle_pb2.HEALTH_STATE_READY,
            10,
            "the probe to pass again once the slot is free",
        )
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "capacity" in full.value.details() or "full" in full.value.details()
    assert health.state == lifecycle_pb2.HEALTH_STATE_DEGRADED
    assert [c.name for c in health.checks] == ["grpc", "coordinator", "scheduler", "model", "inference_probe"]
    assert {c.state for c in health.checks[:-1]} == {lifecycle_pb2.HEALTH_STATE_READY}
    assert health.checks[-1].state == lifecycle_pb2.HEALTH_STATE_DEGRADED
    assert health.checks[-1].message.startswith("probe failed")
    assert refusals == 2, "the second request and the probe"


def health_cli(target: str) -> int:
    return subprocess.run(
        [sys.executable, "-m", "openengine_serve", "health", "--target", target, "--service", "readiness"],
        capture_output=True,
        timeout=30,
    ).returncode


def test_frontend_not_serving_until_a_node_is_ready(deployment):
    """Readiness stays NOT_SERVING (the health CLI exits 1) while no node is ready, then turns SERVING."""
    coord = deployment.add(processes.coordinator())
    fe = processes.frontend(coord.target, "grpcio").start()
    deployment.components.append(fe)
    wait_for(lambda: is_serving(fe.target, "liveness"), 60, "frontend liveness")
    watch = Watcher(fe.target, "readiness")
    time.sleep(1.0)  # five readiness updates
    assert watch.statuses and set(watch.statuses) == {NOT_SERVING}
    assert health_cli(fe.target) == 1
    with Client(fe.target, retries=False) as client:
        with pytest.raises(grpc.RpcError) as refused:
            list(client.inference.Generate(request(max_tokens=2), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    deployment.add(processes.node(coord.target, 0))
    wait_for(lambda: watch.statuses[-1] == SERVING, 10, "frontend readiness SERVING once the node is ready")
    assert health_cli(fe.target) == 0
    watch.close()


def test_node_sigterm_drains_its_running_requests(deployment):
    """SIGTERM a node with running requests: they finish, the coordinator sees it DRAINING, nothing new is
    routed to it, then it exits 0."""
    coord, coord_metrics = processes.with_metrics(processes.coordinator())
    deployment.add(coord)
    deployment.add(processes.node(coord.target, 0))
    draining_node = deployment.add(processes.node(coord.target, 1, "--drain-timeout-s", "30"))
    fe = deployment.add(processes.frontend(coord.target, "grpcio"))
    on_rank_1 = (("openengine-target-dp-rank", "1"),)
    with Client(fe.target, retries=False) as client:
        wait_for(
            lambda: (
                client.control.GetServerInfo(
                    server_pb2.GetServerInfoRequest(), timeout=5
                ).parallelism.data_parallel_size
                == 2
            ),
            10,
            "two ready nodes",
        )
        probe = request(max_tokens=2)
        list(client.inference.Generate(probe, timeout=30, metadata=on_rank_1))
        draining_id = served_by(fe, probe.request_id)
        streams = [
            client.inference.Generate(request(max_tokens=2500), timeout=60, metadata=on_rank_1) for _ in range(3)
        ]  # 5 s each at 2 ms a step
        firsts = [first_token_then(s) for s in streams]
        draining_node.proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: (
                processes.metric(processes.scrape(coord_metrics), "openengine_coordinator_nodes", state="draining") == 1
            ),
            3,
            "the coordinator to see the node DRAINING",
        )
        with pytest.raises(grpc.RpcError) as not_routable:
            list(client.inference.Generate(request(max_tokens=2), timeout=10, metadata=on_rank_1))
        others = []
        for _ in range(4):
            req = request(max_tokens=2)
            assert list(client.inference.Generate(req, timeout=30))[-1].HasField("usage")
            others.append(served_by(fe, req.request_id))
        assert draining_node.proc.poll() is None, "the node is still draining its requests"
        rests = [list(s) for s in streams]
    assert not_routable.value.code() == grpc.StatusCode.NOT_FOUND
    assert draining_id not in others
    for first, rest in zip(firsts, rests):
        out = by_output([first, *rest])[0]
        assert out["finished"][0].reason == generation_pb2.FINISH_REASON_LENGTH and len(out["ids"]) == 2500
        assert rest[-1].usage.completion_tokens == 2500
    assert draining_node.proc.wait(timeout=30) == 0


def test_coordinator_sigterm_stops_it(deployment):
    coord = deployment.add(processes.coordinator())
    watch = Watcher(coord.target, "readiness")
    wait_for(lambda: watch.statuses and watch.statuses[-1] == SERVING, 10, "coordinator readiness SERVING")
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.proc.wait(timeout=10) == 0
    assert NOT_SERVING in watch.statuses, "readiness turned NOT_SERVING before it stopped"
    watch.close()
