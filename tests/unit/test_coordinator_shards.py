"""The frontend's client of several coordinators (frontend/coordinator_client.py), with fake coordinator stubs:
each id's calls go to its coordinator; Abort(all_requests) and the load go to all of them."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.routing import owning_coordinator
from openengine_serve.frontend.coordinator_client import AbortIncomplete, CoordinatorClient, CoordinatorUnreachable
from openengine_serve.frontend.nodes import NodeConnections
from openengine_serve.frontend.tasks import BackgroundTasks

from .frontend_fakes import FakeCoordinatorStub, coordinator_client, node_entry, rpc_error, settle

FIRST, SECOND = "coordinator.test:1", "coordinator.test:2"
UNAVAILABLE = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")


def id_owned_by(address: str, start: int = 0) -> str:
    return next(
        f"req-{i}" for i in range(start, start + 1000) if owning_coordinator(f"req-{i}", [FIRST, SECOND]) == address
    )


@pytest.fixture
def stubs() -> dict[str, FakeCoordinatorStub]:
    return {FIRST: FakeCoordinatorStub(node_entry("n0")), SECOND: FakeCoordinatorStub(node_entry("n1"))}


@pytest.fixture
async def client(stubs):
    nodes = NodeConnections("fe-test", BackgroundTasks(), connect_timeout_s=1.0, call_timeout_s=1.0)
    return coordinator_client(stubs[FIRST], nodes, more_shards={SECOND: stubs[SECOND]})


async def reserve(client, request_id: str) -> cluster_pb2.NodeEntry:
    return await client.reserve(request_id, "", None, prompt_tokens=4, num_sequences=1)


async def test_an_ids_reserve_and_release_go_to_its_coordinator_only(client, stubs):
    first_id, second_id = id_owned_by(FIRST), id_owned_by(SECOND)
    assert (await reserve(client, first_id)).node_id == "n0"
    assert (await reserve(client, second_id)).node_id == "n1"
    client.release(first_id)
    client.release(second_id)
    await settle()
    assert [r.request_id for r in stubs[FIRST].reserved] == [first_id] and stubs[FIRST].released == [first_id]
    assert [r.request_id for r in stubs[SECOND].reserved] == [second_id] and stubs[SECOND].released == [second_id]


async def test_a_coordinator_that_cannot_be_reached_fails_only_its_own_ids(client, stubs):
    stubs[SECOND].reserve_error = UNAVAILABLE
    with pytest.raises(CoordinatorUnreachable):
        await reserve(client, id_owned_by(SECOND))
    assert (await reserve(client, id_owned_by(FIRST))).node_id == "n0"
    assert client.unreachable_addresses() == [SECOND] and not client.reachable


async def test_abort_of_one_id_asks_its_coordinator(client, stubs):
    request_id = id_owned_by(SECOND)
    await client.abort(cluster_pb2.ClusterAbortRequest(request_id=request_id))
    assert [a.request_id for a in stubs[SECOND].aborts] == [request_id] and stubs[FIRST].aborts == []


async def test_abort_of_all_requests_asks_every_coordinator_and_sums(client, stubs):
    stubs[FIRST].aborted, stubs[SECOND].aborted = 2, 3
    reply = await client.abort(cluster_pb2.ClusterAbortRequest(all_requests=True))
    assert (reply.outcome, reply.aborted) == (cluster_pb2.ABORT_OUTCOME_ABORTED, 5)


async def test_abort_of_all_requests_says_which_coordinators_it_missed(client, stubs):
    stubs[FIRST].aborted = 2
    stubs[SECOND].unreachable = UNAVAILABLE
    with pytest.raises(AbortIncomplete, match=f"aborted 2 request.*{SECOND} unreachable \\(UNAVAILABLE\\)"):
        await client.abort(cluster_pb2.ClusterAbortRequest(all_requests=True))
    stubs[FIRST].unreachable = UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError):  # none reached: as with a single coordinator
        await client.abort(cluster_pb2.ClusterAbortRequest(all_requests=True))


async def test_the_load_counts_each_coordinators_reservations_and_the_nodes_once(client, stubs):
    stubs[FIRST].load = cluster_pb2.ClusterLoad(nodes=[node_entry("n0")], live_reservations=4)
    stubs[SECOND].load = cluster_pb2.ClusterLoad(nodes=[node_entry("n0")], live_reservations=6)
    load = await client.cluster_load()
    assert (load.live_reservations, [n.node_id for n in load.nodes]) == (10, ["n0"])
    stubs[FIRST].unreachable = UNAVAILABLE
    load = await client.cluster_load()
    assert load.live_reservations == 6 and [n.node_id for n in load.nodes] == ["n0"]


def test_the_node_table_is_every_answering_coordinators_and_the_first_listed_wins(client):
    first, second = client.shards
    client._set_nodes(second, [node_entry("n0", rank=0, state=cluster_pb2.NODE_STATE_DOWN), node_entry("n1", 1)])
    client._set_nodes(first, [node_entry("n0", rank=0)])
    # Neither has answered yet: every last known table.
    assert {n.node_id: n.state for n in client.nodes.values()} == {
        "n0": cluster_pb2.NODE_STATE_READY,
        "n1": cluster_pb2.NODE_STATE_READY,
    }
    first.reachable = second.reachable = True
    client._set_nodes(first, [node_entry("n0", rank=0)])
    assert sorted(n.node_id for n in client.ready_nodes()) == ["n0", "n1"]
    # A coordinator that stopped answering no longer speaks for the nodes; the others' tables are complete.
    first.reachable = False
    client._set_nodes(second, [node_entry("n0", rank=0, state=cluster_pb2.NODE_STATE_DOWN), node_entry("n1", 1)])
    assert [n.node_id for n in client.ready_nodes()] == ["n1"]


async def test_heartbeats_ride_one_stream_and_keep_the_node_table_from_its_changes():
    """The whole table, then the entries that changed; a broken stream: unreachable, register again, a new
    stream (whose first reply is the whole table again: a node gone from it is dropped); known=False: register."""
    stub = FakeCoordinatorStub()
    a, b = node_entry("a", 0), node_entry("b", 1)
    b_draining = node_entry("b", 1, state=cluster_pb2.NODE_STATE_DRAINING)
    stub.table = [a, b]
    stub.heartbeat_replies = [
        cluster_pb2.HeartbeatReply(known=True, nodes=[a, b], full_table=True),
        cluster_pb2.HeartbeatReply(known=True),  # nothing changed
        cluster_pb2.HeartbeatReply(known=True, nodes=[b_draining]),
        UNAVAILABLE,  # the coordinator restarted
        cluster_pb2.HeartbeatReply(known=True, nodes=[b_draining], full_table=True),
        cluster_pb2.HeartbeatReply(known=False, nodes=[]),
        cluster_pb2.HeartbeatReply(known=True),
    ]
    tables: list[list[tuple[str, int]]] = []
    reachable: list[bool] = []

    def on_node_table(nodes):
        tables.append(sorted((n.node_id, n.state) for n in nodes.values()))
        reachable.append(client.reachable)

    client = CoordinatorClient(
        "fe-test",
        [FIRST],
        "fe.test:1",
        heartbeat_s=0.01,
        call_timeout_s=1.0,
        live_requests=lambda: 3,
        on_node_table=on_node_table,
    )
    client.shards[0].stub = stub
    loop = asyncio.create_task(client.heartbeat_loop())
    try:
        async with asyncio.timeout(5):
            while stub.heartbeat_replies or len(stub.heartbeats) < 8:
                await asyncio.sleep(0.01)
    finally:
        loop.cancel()
        await client.close()
    ready, draining = cluster_pb2.NODE_STATE_READY, cluster_pb2.NODE_STATE_DRAINING
    both, b_drains, only_b = [("a", ready), ("b", ready)], [("a", ready), ("b", draining)], [("b", draining)]
    # registration (stub.table), 3 replies, (the break), registration, 2 replies (known=False), registration, reply
    assert tables == [both, both, both, b_drains, both, only_b, only_b, both, both]
    assert stub.registrations == 3 and stub.heartbeat_streams == 2
    assert all(reachable) and {h.live_requests for h in stub.heartbeats} == {3}
