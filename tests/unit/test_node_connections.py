"""The frontend's node connections (result lanes, request inboxes) and its fallback routing."""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.coordinator.state import ClusterState
from openengine_serve.frontend import metrics
from openengine_serve.frontend.fallback_routing import FallbackRouter
from openengine_serve.frontend.nodes import (
    BUSY_TURN_S,
    LaneAcknowledgements,
    LaneFailure,
    NodeConnections,
    SubmitRefused,
)
from openengine_serve.frontend.refusal import NotServed, Unavailable
from openengine_serve.frontend.tasks import BackgroundTasks

from .frontend_fakes import add_fake_node, node_entry, rpc_error, settle

# ------------------------------------------------------------------ fallback routing


def no_load(node_id: str) -> int:
    return 0


def test_a_routing_key_lands_where_the_coordinator_sends_it():
    entries = [node_entry(f"node-{i}", rank=i) for i in range(4)]
    coordinator = ClusterState()
    for entry in entries:
        coordinator.register_node(entry, entry.rank)
        coordinator.node_heartbeat(entry.node_id, cluster_pb2.NODE_STATE_READY, None)
    router = FallbackRouter()
    keys = [f"conversation-{i}" for i in range(40)]
    frontend_choice = {key: router.choose(entries, key, None, no_load).node_id for key in keys}
    coordinator_choice = {
        key: coordinator.reserve(cluster_pb2.ReserveRequest(request_id=key, frontend_id="fe", routing_key=key)).node_id
        for key in keys
    }
    assert frontend_choice == coordinator_choice
    assert len(set(frontend_choice.values())) == 4


def test_target_rank_picks_that_node_or_names_the_rank():
    entries = [node_entry("a", rank=0), node_entry("b", rank=1)]
    router = FallbackRouter()
    assert router.choose(entries, "some-key", 1, no_load).node_id == "b"
    with pytest.raises(NotServed, match="openengine-target-dp-rank 5 names no ready node"):
        router.choose(entries, "", 5, no_load)


def test_no_ready_node_is_unavailable():
    with pytest.raises(Unavailable, match="no ready node is known and the coordinator is unreachable"):
        FallbackRouter().choose([], "", None, no_load)


def test_without_a_key_the_least_busy_node_wins_and_ties_take_turns():
    entries = [node_entry("a", rank=0), node_entry("b", rank=1), node_entry("c", rank=2)]
    router = FallbackRouter()
    busy = {"a": 2, "b": 0, "c": 1}
    assert router.choose(entries, "", None, busy.__getitem__).node_id == "b"
    placed = collections.Counter(router.choose(entries, "", None, no_load).node_id for _ in range(6))
    assert placed == {"a": 2, "b": 2, "c": 2}


# ------------------------------------------------------------------ node connections


@pytest.fixture
async def nodes():
    nodes = NodeConnections("fe-test", BackgroundTasks(), connect_timeout_s=1.0, call_timeout_s=1.0)
    yield nodes
    await nodes.close()
    await settle()


async def test_the_lane_hands_each_event_to_its_request(nodes: NodeConnections):
    entry = node_entry("n0")
    _, stub = add_fake_node(nodes, entry)
    first, second, elsewhere = nodes.open_sink("r1"), nodes.open_sink("r2"), nodes.open_sink("r3")
    conn = await nodes.connect(entry)
    assert conn.lane_ready.done()
    for request_id in ("r1", "r2"):
        await nodes.submit(conn, cluster_pb2.EngineRequest(request_id=request_id))
    stub.lane.put_nowait(
        cluster_pb2.StepResults(
            events=[
                cluster_pb2.OutputEvent(request_id="r1", output_index=0),
                cluster_pb2.OutputEvent(request_id="gone"),
                cluster_pb2.OutputEvent(request_id="r2"),
                cluster_pb2.OutputEvent(request_id="r3"),  # open here, but not submitted to this node
                cluster_pb2.OutputEvent(request_id="r1", output_index=1),
            ]
        )
    )
    await settle()
    assert [e.output_index for e in await first.take()] == [0, 1]
    assert [e.request_id for e in await second.take()] == ["r2"]
    assert not elsewhere.items, "a node sends events only for the requests it holds"


async def test_the_lane_gives_the_node_a_window_and_acknowledges_each_message_handled(nodes: NodeConnections):
    entry = node_entry("n0")
    _, stub = add_fake_node(nodes, entry)
    sink = nodes.open_sink("r1")
    await nodes.submit(await nodes.connect(entry), cluster_pb2.EngineRequest(request_id="r1"))
    assert [(c.frontend_id, c.window) for c in stub.credits] == [("fe-test", nodes.lane_window)]
    for token in range(3):
        stub.lane.put_nowait(
            cluster_pb2.StepResults(
                events=[cluster_pb2.OutputEvent(request_id="r1", tokens=[cluster_pb2.TokenRecord(token_id=token)])]
            )
        )
    await settle()
    assert [e.tokens[0].token_id for e in await sink.take()] == [0, 1, 2]
    assert sum(c.handled for c in stub.credits[1:]) == 3, stub.credits  # the opening message is not counted


async def test_without_a_window_the_lane_is_opened_with_window_0_and_read_as_usual():
    nodes = NodeConnections("fe-test", BackgroundTasks(), 1.0, 1.0, lane_window=0)
    entry = node_entry("n0")
    _, stub = add_fake_node(nodes, entry)
    sink = nodes.open_sink("r1")
    try:
        await nodes.submit(await nodes.connect(entry), cluster_pb2.EngineRequest(request_id="r1"))
        assert [(c.frontend_id, c.window) for c in stub.credits] == [("fe-test", 0)], "0: no limit"
        stub.lane.put_nowait(cluster_pb2.StepResults(events=[cluster_pb2.OutputEvent(request_id="r1")]))
        await settle()
        assert [e.request_id for e in await sink.take()] == ["r1"]
    finally:
        await nodes.close()
        await settle()


async def test_a_sink_whose_client_takes_nothing_pauses_its_request_on_the_lane_and_resumes_it():
    nodes = NodeConnections("fe-test", BackgroundTasks(), 1.0, 1.0, pause_after_s=0.05)
    entry = node_entry("n0")
    _, stub = add_fake_node(nodes, entry)
    sink = nodes.open_sink("r1")
    conn = await nodes.connect(entry)
    await nodes.submit(conn, cluster_pb2.EngineRequest(request_id="r1"))
    paused_before = metrics.PAUSED_STREAMS._value.get()

    def event(token: int) -> cluster_pb2.StepResults:
        return cluster_pb2.StepResults(
            events=[cluster_pb2.OutputEvent(request_id="r1", tokens=[cluster_pb2.TokenRecord(token_id=token)])]
        )

    def pauses() -> list[tuple[str, bool]]:
        return [(p.request_id, p.resume) for credit in stub.credits for p in credit.pauses]

    try:
        stub.lane.put_nowait(event(0))
        await settle()
        assert not sink.paused, "a stream waiting for events is not writing: nothing to pause"
        sink.writing_since = time.monotonic()  # the stream hands output to its client, which takes nothing
        stub.lane.put_nowait(event(1))
        await settle()
        assert not sink.paused, "not for pause_after_s yet"
        await asyncio.sleep(0.06)
        stub.lane.put_nowait(event(2))
        stub.lane.put_nowait(event(3))
        await settle()
        assert sink.paused and pauses() == [("r1", False)], "paused once"
        assert metrics.PAUSED_STREAMS._value.get() == paused_before + 1
        sink.resume()  # the client took the output
        await settle()
        assert not sink.paused and pauses() == [("r1", False), ("r1", True)]
        assert metrics.PAUSED_STREAMS._value.get() == paused_before
        assert [e.tokens[0].token_id for e in await sink.take()] == [0, 1, 2, 3], "nothing lost or reordered"
        sink.writing_since = time.monotonic() - 1
        stub.lane.put_nowait(event(4))
        await settle()
        assert sink.paused
        nodes.close_sink("r1", "n0")  # a stream that ends paused (its request is cancelled or finished)
        assert metrics.PAUSED_STREAMS._value.get() == paused_before
    finally:
        await nodes.close()
        await settle()


async def test_with_pausing_off_nothing_is_paused(nodes: NodeConnections):
    entry = node_entry("n0")
    add_fake_node(nodes, entry)
    await nodes.connect(entry)
    off = nodes.open_sink("r2")  # the fixture's NodeConnections: pause_after_s 0
    off.set_paused = lambda paused: pytest.fail("paused with pausing off")
    off.writing_since = time.monotonic() - 100
    off.put(cluster_pb2.OutputEvent(request_id="r2"))
    assert not off.paused


class RecordedCredits:
    """A Lane call's write side: the loop time of each LaneCredit written."""

    def __init__(self) -> None:
        self.written: list[tuple[float, int]] = []

    async def write(self, credit: cluster_pb2.LaneCredit) -> None:
        self.written.append((asyncio.get_running_loop().time(), credit.handled))


async def busy_turns(turns: int) -> None:
    """A saturated loop: `turns` turns, each blocking the loop for twice BUSY_TURN_S."""
    for _ in range(turns):
        time.sleep(2 * BUSY_TURN_S)
        await asyncio.sleep(0)


async def test_an_acknowledgement_goes_out_at_once_when_the_loop_has_room():
    call = RecordedCredits()
    acknowledgements = LaneAcknowledgements(call, min_interval_s=1.0)
    acknowledgements.handled(5)  # behind (it covers steps 1-5), but the loop has room
    await settle()
    assert [handled for _, handled in call.written] == [1]
    acknowledgements.close()


async def test_a_busy_loop_paces_the_acknowledgements_and_those_handled_meanwhile_go_together():
    loop = asyncio.get_running_loop()
    call = RecordedCredits()
    acknowledgements = LaneAcknowledgements(call, min_interval_s=0.05)
    busy = asyncio.create_task(busy_turns(5))
    acknowledgements.handled(5)  # the node folded steps 1-5: this frontend is behind
    handled_at = loop.time()
    await busy
    acknowledgements.handled(9)  # while the first waits
    async with asyncio.timeout(1.0):
        while not call.written:
            await asyncio.sleep(0.01)
    [(written_at, handled)] = call.written
    assert handled == 2 and written_at - handled_at >= 0.05
    acknowledgements.close()


async def test_a_frontend_that_keeps_up_acknowledges_at_once_however_busy_its_loop():
    """One step per message: its streams' tokens must not come in chunks because their turns are long."""
    call = RecordedCredits()
    acknowledgements = LaneAcknowledgements(call, min_interval_s=1.0)
    busy = asyncio.create_task(busy_turns(5))
    acknowledgements.handled(1)
    async with asyncio.timeout(0.5):
        while not call.written:
            await asyncio.sleep(0.001)
    await busy
    acknowledgements.handled(2)
    await settle()
    assert [handled for _, handled in call.written] == [1, 1]  # one credit per message, none counted twice
    acknowledgements.close()


async def test_credits_go_out_once_per_window_and_at_once_with_a_pause():
    """With a window of 2 the node may send a second message before the first is acknowledged: one credit per
    two messages keeps it sending, at half the writes (a pause goes out at once, with what was handled)."""
    call = RecordedCredits()
    acknowledgements = LaneAcknowledgements(call, every=2)
    acknowledgements.handled(1)
    await settle()
    assert call.written == []
    acknowledgements.handled(2)
    await settle()
    assert [handled for _, handled in call.written] == [2]
    acknowledgements.handled(3)
    acknowledgements.pause("r1", resume=False)
    await settle()
    assert [handled for _, handled in call.written] == [2, 1]
    acknowledgements.close()


async def test_a_lost_lane_fails_the_requests_on_that_node_only(nodes: NodeConnections):
    lost, kept = node_entry("lost"), node_entry("kept")
    lost_conn, lost_stub = add_fake_node(nodes, lost)
    kept_conn, _ = add_fake_node(nodes, kept)
    on_lost, on_kept = nodes.open_sink("a"), nodes.open_sink("b")
    await nodes.connect(lost)
    await nodes.connect(kept)
    lost_conn.requests.add("a")
    kept_conn.requests.add("b")
    lost_stub.lane.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE))
    await settle()
    [failure] = await on_lost.take()
    assert isinstance(failure, LaneFailure) and failure.retryable
    assert failure.message == "node lost at lost.test:1 was lost (UNAVAILABLE)"
    assert not on_kept.items and kept_conn.requests == {"b"}
    assert lost_conn.lane_task is None  # the next request reopens the lane


async def test_a_node_that_left_the_table_is_dropped_and_its_requests_fail(nodes: NodeConnections):
    gone, stays = node_entry("gone"), node_entry("stays")
    gone_conn, _ = add_fake_node(nodes, gone)
    add_fake_node(nodes, stays)
    sink = nodes.open_sink("r")
    await nodes.connect(gone)
    gone_conn.requests.add("r")
    nodes.keep_only({"stays": stays})
    await settle()
    assert set(nodes.connections) == {"stays"}
    assert gone_conn.channel.closed
    [failure] = await sink.take()
    assert failure.message == "node left the deployment" and failure.retryable


async def test_submit_and_cancel_reach_the_node_and_count_in_flight(nodes: NodeConnections):
    entry = node_entry("n0")
    conn, stub = add_fake_node(nodes, entry)
    await nodes.submit(conn, cluster_pb2.EngineRequest(request_id="r"))
    assert nodes.in_flight("n0") == 1 and nodes.in_flight("unknown") == 0
    nodes.cancel(conn, "r", 2)
    await settle()
    assert [r.request_id for r in stub.submitted] == ["r"] and stub.cancelled == [("r", 2)]
    nodes.open_sink("r")
    nodes.close_sink("r", "n0")
    assert nodes.in_flight("n0") == 0 and nodes.sinks == {}


async def test_submissions_of_one_tick_go_to_the_node_in_one_batch_and_refusals_keep_their_code(nodes: NodeConnections):
    conn, stub = add_fake_node(nodes, node_entry("n0"))
    batches = []
    open_submissions = stub.Submissions

    def recording_submissions():
        call = open_submissions()
        write = call.write

        async def recorded(batch):
            batches.append([s.request.request_id for s in batch.submit])
            await write(batch)

        call.write = recorded
        return call

    stub.Submissions = recording_submissions
    trace = (("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),)
    await asyncio.gather(*(nodes.submit(conn, cluster_pb2.EngineRequest(request_id=f"r{i}"), trace) for i in range(3)))
    assert batches == [["r0", "r1", "r2"]] and [r.request_id for r in stub.submitted] == ["r0", "r1", "r2"]
    stub.submit_error = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    with pytest.raises(SubmitRefused) as refused:
        await nodes.submit(conn, cluster_pb2.EngineRequest(request_id="r3"))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.message == "queue full"


async def test_a_node_whose_lane_does_not_open_is_a_connection_error(nodes: NodeConnections):
    entry = node_entry("n0")
    _, stub = add_fake_node(nodes, entry)

    def refused(frontend_id):
        async def stream():
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
            yield  # pragma: no cover

        return stream()

    stub.lane_messages = refused
    with pytest.raises(ConnectionError, match="node n0 at n0.test:1 was lost"):
        await nodes.connect(entry)


async def test_a_request_getting_its_first_event_wakes_before_those_with_a_backlog(nodes: NodeConnections):
    entry = node_entry("n0")
    _, stub = add_fake_node(nodes, entry)
    running, new = nodes.open_sink("running"), nodes.open_sink("new")
    conn = await nodes.connect(entry)
    for request_id in ("running", "new"):
        await nodes.submit(conn, cluster_pb2.EngineRequest(request_id=request_id))
    stub.lane.put_nowait(cluster_pb2.StepResults(events=[cluster_pb2.OutputEvent(request_id="running")]))
    await settle()
    woken = []

    async def stream(name, sink):
        await sink.take()
        woken.append(name)

    tasks = [asyncio.create_task(stream("running", running)), asyncio.create_task(stream("new", new))]
    await settle()
    assert woken == ["running"]
    tasks[0] = asyncio.create_task(stream("running", running))
    await settle()
    stub.lane.put_nowait(
        cluster_pb2.StepResults(
            events=[
                cluster_pb2.OutputEvent(request_id="running", output_index=0),
                cluster_pb2.OutputEvent(request_id="new", output_index=0),
                cluster_pb2.OutputEvent(request_id="new", output_index=1),
            ]
        )
    )
    await settle()
    assert woken == ["running", "new", "running"], "the new request's stream ran first"
    await asyncio.gather(*tasks)
