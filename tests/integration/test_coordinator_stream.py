"""The frontends' batched reservation stream to the coordinator, under faults, with real processes on both servers."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import grpc
import pytest

from openengine_serve.api.openengine.v1 import lifecycle_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from openengine_serve.client import Client

from . import processes
from .conftest import SERVERS, request
from .processes import Deployment, wait_for

STEP_MS = "20"  # a request of 1000 tokens runs for ~20 s: it is in flight for the whole test


def slow_cluster(d: Deployment, coordinator_port: int | None = None, metrics: bool = False):
    coord = processes.with_metrics(processes.coordinator())[0] if metrics else processes.coordinator()
    if coordinator_port:
        coord.port = coordinator_port
    d.add(coord)
    d.add(processes.node(coord.target, 0, "--step-ms", STEP_MS))
    return coord


class CoordinatorView:
    """The coordinator's own answers (unary calls straight to it)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = cluster_pb2_grpc.CoordinatorStub(self.channel)

    def live_reservations(self) -> int:
        return self.stub.GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=5).live_reservations

    def node_ready(self) -> bool:
        nodes = self.stub.GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=5).nodes
        return any(n.state == cluster_pb2.NODE_STATE_READY for n in nodes)

    def abort_outcome(self, request_id: str) -> int:
        return self.stub.Abort(cluster_pb2.ClusterAbortRequest(request_id=request_id), timeout=5).outcome

    def close(self) -> None:
        self.channel.close()


def first_token(stream) -> None:
    assert next(stream).WhichOneof("event") == "token"


def heartbeat_streams(metrics_port: int) -> dict[str, float]:
    """The coordinator's open heartbeat streams, by peer."""
    samples = processes.scrape(metrics_port)
    return {
        peer: processes.metric(samples, "openengine_coordinator_heartbeat_streams", peer=peer)
        for peer in ("node", "frontend")
    }


@pytest.mark.parametrize("server", SERVERS)
def test_after_a_coordinator_restart_the_frontend_reopens_its_streams_and_reserves_there(server, deployment):
    """The reservation stream and the node's and frontend's heartbeat streams (one each, long-lived) are opened
    again to the new process; the node and the frontend register there again (their first heartbeat on the new
    stream answers known=False)."""
    coord = slow_cluster(deployment, coordinator_port=processes.free_port(), metrics=True)
    metrics_port = int(coord.args[coord.args.index("--metrics-port") + 1])
    fe = deployment.add(processes.frontend(coord.target, server))
    one_each = {"node": 1, "frontend": 1}
    wait_for(lambda: heartbeat_streams(metrics_port) == one_each, 10, "one heartbeat stream per node and frontend")
    with Client(fe.target, retries=False) as client:
        before = client.inference.Generate(request(max_tokens=1000), timeout=60)
        first_token(before)
        assert heartbeat_streams(metrics_port) == one_each, "still the same stream each, heartbeats later"
        coord.proc.kill()
        coord.proc.wait()
        coord.start().wait_ready()
        view = CoordinatorView(coord.target)
        try:
            wait_for(view.node_ready, 20, "the node registered again")
            wait_for(lambda: heartbeat_streams(metrics_port) == one_each, 20, "new heartbeat streams")
            # The frontend's channel may still be in its reconnect backoff: wait until it heartbeats there again.
            wait_for(
                lambda: (
                    client.control.Health(lifecycle_pb2.HealthRequest(), timeout=5).state
                    == lifecycle_pb2.HEALTH_STATE_READY
                ),
                20,
                "the frontend reaching the new coordinator",
            )
            # The frontend's next reservation opens a new stream to the new process.
            assert list(client.generate(request(max_tokens=2), timeout=10))[-1].HasField("usage")
            first_token(before)  # in flight across the restart: still streaming
            long = request(max_tokens=1000)
            stream = client.inference.Generate(long, timeout=60)
            first_token(stream)
            assert view.live_reservations() == 1, "reserved on the restarted coordinator"
            with pytest.raises(grpc.RpcError) as duplicate:
                list(client.generate(long, timeout=10))
            assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
            stream.cancel()
            wait_for(lambda: view.live_reservations() == 0, 10, "the release of the cancelled request")
        finally:
            view.close()
        before.cancel()


@pytest.mark.parametrize("server", SERVERS)
def test_a_dead_frontends_reservations_expire_and_are_released(server, deployment):
    coord = slow_cluster(deployment)
    fe = deployment.add(processes.frontend(coord.target, server))
    view = CoordinatorView(coord.target)
    try:
        with Client(fe.target, retries=False) as client:
            streams, ids = [], []
            for _ in range(3):
                req = request(max_tokens=1000)
                streams.append(client.inference.Generate(req, timeout=60))
                ids.append(req.request_id)
                first_token(streams[-1])
            assert view.live_reservations() == 3
            for pid in [*processes.descendants(fe.proc.pid), fe.proc.pid]:
                os.kill(pid, signal.SIGKILL)
            fe.proc.wait()
            # Node expiry is 1.5 s in these tests (processes.coordinator): the frontend expires with it.
            wait_for(lambda: view.live_reservations() == 0, 15, "the dead frontend's reservations dropped")
            assert {view.abort_outcome(i) for i in ids} == {cluster_pb2.ABORT_OUTCOME_ALREADY_FINISHED}
    finally:
        view.close()


@pytest.mark.parametrize("server", SERVERS)
def test_the_stream_breaking_mid_batch_keeps_accepted_requests_and_routes_the_pending_ones_locally(server, deployment):
    coord = slow_cluster(deployment)
    fe = deployment.add(processes.frontend(coord.target, server))
    with Client(fe.target, retries=False) as client:
        accepted = client.inference.Generate(request(max_tokens=1000), timeout=60)
        first_token(accepted)
        coord.proc.send_signal(signal.SIGSTOP)  # the next batch is written and never answered
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            pending = [pool.submit(lambda: list(client.generate(request(max_tokens=2), timeout=30))) for _ in range(8)]
            time.sleep(1.0)
            assert not any(f.done() for f in pending), "the reservations wait for the coordinator's answer"
            coord.proc.kill()  # the stream breaks with that batch unanswered
            broken_at = time.monotonic()
            results = [f.result(timeout=30) for f in pending]
        # Each ends served (local routing from the last known node table), well before the 5 s reserve deadline.
        assert all(r[-1].HasField("usage") for r in results)
        assert time.monotonic() - broken_at < 4.0
        for _ in range(3):
            first_token(accepted)  # accepted before the break: still streaming
        accepted.cancel()
