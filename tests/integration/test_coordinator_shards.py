"""Two coordinators sharing the request ids (a comma-separated OPENENGINE_COORDINATOR_ADDRESS): real coordinator,
node and frontend processes, on both servers. One deployment per server runs every check in turn (a start costs
more than the checks)."""

from __future__ import annotations

import os
import signal

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import lifecycle_pb2, server_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.client import Client
from openengine_serve.common.routing import owning_coordinator

from . import processes
from .conftest import SERVERS, request
from .processes import wait_for
from .test_coordinator_stream import STEP_MS, CoordinatorView, first_token


def ready_ranks(view: CoordinatorView) -> list[tuple[str, int]]:
    """(node id, rank) of the READY nodes in one coordinator's table."""
    nodes = view.stub.GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=5).nodes
    return sorted((n.node_id, n.rank) for n in nodes if n.state == cluster_pb2.NODE_STATE_READY)


def request_owned_by(coordinators: list[str], owner: str, **kwargs) -> G.GenerateRequest:
    """A request whose id the coordinator `owner` owns (the frontends' rule, same addresses)."""
    while True:
        req = request(**kwargs)
        if owning_coordinator(req.request_id, coordinators) == owner:
            return req


def rest_of(stream) -> list[G.GenerateResponse]:
    return list(stream)


def refused_code(client: Client, req: G.GenerateRequest) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        list(client.generate(req, timeout=10))
    return refused.value.code()


@pytest.mark.parametrize("server", SERVERS)
def test_two_coordinators_share_the_ids_and_each_node_and_frontend_uses_both(server, deployment):
    coords = [deployment.add(processes.coordinator()) for _ in range(2)]
    targets = [c.target for c in coords]
    shards = ",".join(targets)
    # Automatic ranks: a node's first registration picks it, the other coordinator is asked for the same one.
    nodes = [processes.node(shards, -1, "--step-ms", STEP_MS) for _ in range(2)]
    for node in nodes:  # started together, awaited together
        deployment.components.append(node.start())
    for node in nodes:
        node.wait_ready(90)
    first = deployment.add(processes.frontend(shards, server))
    second = deployment.add(processes.frontend(shards, server))
    views = [CoordinatorView(t) for t in targets]
    try:
        wait_for(lambda: all(len(ready_ranks(v)) == 2 for v in views), 20, "both nodes ready on both coordinators")
        table = ready_ranks(views[0])
        assert ready_ranks(views[1]) == table and [rank for _, rank in sorted(table, key=lambda e: e[1])] == [0, 1]

        with Client(first.target, retries=False) as owner, Client(second.target, retries=False) as other:
            # One long request per coordinator: each holds only the id it owns.
            running = [request_owned_by(targets, t, max_tokens=1000) for t in targets]
            streams = [owner.inference.Generate(r, timeout=60) for r in running]
            for s in streams:
                first_token(s)
            assert [v.live_reservations() for v in views] == [1, 1]

            # Duplicates are caught by the id's coordinator whichever frontend the copy arrives at.
            for req in running:
                assert refused_code(other, req) == grpc.StatusCode.ALREADY_EXISTS

            # GetLoad: the nodes report to both coordinators; the deployment's running requests are counted once.
            def running_requests() -> int:
                return other.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5).running_requests

            wait_for(lambda: running_requests() == 2, 10, "GetLoad counting the two running requests once")

            # Abort from the other frontend reaches the id's coordinator, which cancels it on its node.
            reply = other.control.Abort(lifecycle_pb2.AbortRequest(request_id=running[1].request_id), timeout=10)
            assert reply.status == lifecycle_pb2.ABORT_STATUS_ABORTED
            assert rest_of(streams[1])[-1].finished.reason == G.FINISH_REASON_CANCELLED
            wait_for(lambda: views[1].live_reservations() == 0, 10, "the aborted request released")
            assert views[0].live_reservations() == 1

            # Abort(all_requests) goes to every coordinator and sums what they aborted.
            again = request_owned_by(targets, targets[1], max_tokens=1000)
            streams[1] = owner.inference.Generate(again, timeout=60)
            first_token(streams[1])
            reply = other.control.Abort(
                lifecycle_pb2.AbortRequest(all_requests=lifecycle_pb2.AllRequests()), timeout=10
            )
            assert reply.message == "aborted 2 request(s)"
            for s in streams:
                assert rest_of(s)[-1].finished.reason == G.FINISH_REASON_CANCELLED
            wait_for(lambda: [v.live_reservations() for v in views] == [0, 0], 10, "every id released")

            # One coordinator restarts: the other's ids keep their duplicate check throughout; the restarted
            # one's in-flight ids are forgotten (as after a restart of a single coordinator) and its new ids
            # are reserved there again once the node and the frontends have registered with it.
            kept = request_owned_by(targets, targets[0], max_tokens=1000)
            across = request_owned_by(targets, targets[1], max_tokens=1000)
            kept_stream = owner.inference.Generate(kept, timeout=60)
            across_stream = owner.inference.Generate(across, timeout=60)
            first_token(kept_stream)
            first_token(across_stream)
            coords[1].proc.kill()
            coords[1].proc.wait()
            assert refused_code(other, kept) == grpc.StatusCode.ALREADY_EXISTS
            # The lost coordinator's in-flight id: its duplicate is caught on the frontend that runs it.
            assert refused_code(owner, across) == grpc.StatusCode.ALREADY_EXISTS
            # Its ids route from the last known node table meanwhile, and are served.
            served = list(other.generate(request_owned_by(targets, targets[1], max_tokens=2), timeout=10))
            assert served[-1].HasField("usage")
            coords[1].start().wait_ready()
            views[1].close()
            views[1] = CoordinatorView(targets[1])
            wait_for(lambda: len(ready_ranks(views[1])) == 2, 20, "both nodes registered again")
            assert ready_ranks(views[1]) == table, "each node kept its rank"
            for client in (owner, other):  # their channels may still be in a reconnect backoff
                wait_for(
                    lambda: (
                        client.control.Health(lifecycle_pb2.HealthRequest(), timeout=5).state
                        == lifecycle_pb2.HEALTH_STATE_READY
                    ),
                    20,
                    "the frontends reaching the restarted coordinator",
                )
            fresh = request_owned_by(targets, targets[1], max_tokens=1000)
            fresh_stream = owner.inference.Generate(fresh, timeout=60)
            first_token(fresh_stream)
            assert views[1].live_reservations() == 1, "reserved on the restarted coordinator"
            assert refused_code(other, fresh) == grpc.StatusCode.ALREADY_EXISTS
            with pytest.raises(grpc.RpcError) as forgotten:  # in flight across the restart: not known there
                other.control.Abort(lifecycle_pb2.AbortRequest(request_id=across.request_id), timeout=10)
            assert forgotten.value.code() == grpc.StatusCode.NOT_FOUND
            for s in (kept_stream, across_stream):
                first_token(s)  # in flight across the restart: still streaming
            for s in (kept_stream, across_stream, fresh_stream):
                s.cancel()
            wait_for(lambda: [v.live_reservations() for v in views] == [0, 0], 10, "every id released")
    finally:
        for v in views:
            v.close()
        # Their shutdown is not under test here, and a node's SIGTERM stop currently outlasts the 15 s stop timeout.
        for node in nodes:
            for pid in [*processes.descendants(node.proc.pid), node.proc.pid]:
                os.kill(pid, signal.SIGKILL)
            node.proc.wait()
