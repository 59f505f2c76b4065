"""Heartbeats on one long-lived stream per node and frontend (common/heartbeat_stream.py), with real processes:
a broken stream alone loses no peer, a node's drain is acknowledged on it. (Reopened after a coordinator restart:
test_coordinator_stream.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import grpc

from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from openengine_serve.common.heartbeat_stream import HeartbeatFailed, HeartbeatStream

from . import processes
from .processes import wait_for
from .test_coordinator_stream import CoordinatorView

READY, DRAINING, DOWN = cluster_pb2.NODE_STATE_READY, cluster_pb2.NODE_STATE_DRAINING, cluster_pb2.NODE_STATE_DOWN
EXPIRY_S = 1.5  # processes.coordinator()


def node_states(view: CoordinatorView) -> dict[str, int]:
    return {n.node_id: n.state for n in view.stub.GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=5).nodes}


def test_a_broken_heartbeat_stream_loses_the_node_only_at_expiry(deployment):
    """The stream ending is not a lost node: the node stays READY until the expiry without heartbeats, and a
    heartbeat on a new stream before that keeps it."""
    coord = deployment.add(processes.coordinator())
    view = CoordinatorView(coord.target)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(coord.target) as channel:
            stub = cluster_pb2_grpc.CoordinatorStub(channel)
            entry = cluster_pb2.NodeEntry(node_id="n1", address="127.0.0.1:1", rank=0, state=READY)
            await stub.RegisterNode(cluster_pb2.RegisterNodeRequest(node=entry), timeout=5)
            heartbeats = HeartbeatStream(stub.NodeHeartbeats, reply_timeout_s=5)
            heartbeat = cluster_pb2.NodeHeartbeatRequest(node_id="n1", state=READY)
            assert (await heartbeats.beat(heartbeat)).known
            heartbeats.close()  # the stream breaks
            await asyncio.sleep(0.5)
            assert node_states(view) == {"n1": READY}
            assert (await heartbeats.beat(heartbeat)).known and heartbeats.streams_opened == 2
            beat_at = time.monotonic()
            heartbeats.close()
            while node_states(view)["n1"] == READY:
                await asyncio.sleep(0.05)
            down_at = time.monotonic()
            assert node_states(view)["n1"] == DOWN
            # Lost after the expiry counted from its last heartbeat (whose reply came a little after the
            # coordinator took it), not from its stream's end.
            assert down_at - beat_at >= EXPIRY_S - 0.2

    try:
        asyncio.run(scenario())
    finally:
        view.close()


def test_an_idle_node_stops_only_once_the_coordinator_acknowledged_its_drain(deployment):
    """SIGTERM an idle node while its coordinator cannot answer: the node's draining heartbeat waits on its
    stream and the node does not exit until the coordinator acknowledged it, so the coordinator routes nothing
    more to it (it is DRAINING, not READY, when the process is gone)."""
    coord = processes.coordinator()
    coord.args[coord.args.index("--node-expiry-s") + 1] = "60"  # the exited node stays in the table as it left it
    deployment.add(coord)
    node = deployment.add(processes.node(coord.target, 0, "--rpc-timeout-s", "30"))  # the bound of that wait
    view = CoordinatorView(coord.target)
    try:
        wait_for(lambda: list(node_states(view).values()) == [READY], 10, "the node READY")
        coord.proc.send_signal(signal.SIGSTOP)
        node.proc.send_signal(signal.SIGTERM)
        time.sleep(3.0)
        assert node.proc.poll() is None, "the idle node waits for the coordinator to acknowledge its drain"
        coord.proc.send_signal(signal.SIGCONT)
        assert node.proc.wait(timeout=30) == 0
        assert list(node_states(view).values()) == [DRAINING]
    finally:
        coord.proc.send_signal(signal.SIGCONT)
        view.close()


def test_quiet_heartbeats_get_no_reply_until_the_coordinator_forgets_the_node(deployment):
    """A node's usual heartbeat is quiet (reply_optional): the coordinator takes it without a reply. Once the
    coordinator no longer knows the node (here: DOWN, then its rank given to another node), a quiet heartbeat
    ends the stream, and the next heartbeat opens a new one whose reply says known=false."""
    coord = deployment.add(processes.coordinator())
    view = CoordinatorView(coord.target)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(coord.target) as channel:
            stub = cluster_pb2_grpc.CoordinatorStub(channel)
            for node_id in ("n1", "n2"):
                entry = cluster_pb2.NodeEntry(node_id=node_id, address="127.0.0.1:1", rank=0, state=READY)
                if node_id == "n2":
                    while node_states(view)["n1"] != DOWN:  # silent past the expiry
                        await asyncio.sleep(0.05)
                else:
                    heartbeats = HeartbeatStream(stub.NodeHeartbeats, reply_timeout_s=5)
                await stub.RegisterNode(cluster_pb2.RegisterNodeRequest(node=entry), timeout=5)
                if node_id == "n1":
                    first = await heartbeats.beat(cluster_pb2.NodeHeartbeatRequest(node_id="n1"), quiet=True)
                    assert first.known, "a stream's first heartbeat asks"
                    assert (
                        await heartbeats.beat(
                            cluster_pb2.NodeHeartbeatRequest(node_id="n1", state=DRAINING), quiet=True
                        )
                        is None
                    )
                    assert node_states(view) == {"n1": DRAINING}, "a quiet heartbeat is taken all the same"
            assert set(node_states(view)) == {"n2"}  # n1 forgotten: its rank went to n2
            assert await heartbeats.beat(cluster_pb2.NodeHeartbeatRequest(node_id="n1"), quiet=True) is None
            reply = None
            for _ in range(50):  # the coordinator ends the stream on reading that heartbeat
                await asyncio.sleep(0.1)  # (a heartbeat written just as the stream ends fails: then the next one)
                with contextlib.suppress(HeartbeatFailed):
                    reply = await heartbeats.beat(cluster_pb2.NodeHeartbeatRequest(node_id="n1"), quiet=True)
                if reply is not None:
                    break
            assert reply is not None and not reply.known, "a new stream, whose first heartbeat asks"
            assert heartbeats.streams_opened >= 2

    try:
        asyncio.run(scenario())
    finally:
        view.close()
