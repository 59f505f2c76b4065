"""Control.SubscribeKvEvents (frontend/control.py, frontend/kv_events.py) before any stream opens: no ready node,
a rank no ready node has."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
import pytest

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.frontend import kv_events
from openengine_serve.frontend.control import Control
from openengine_serve.frontend.kv_events import KvEventRelay

from .frontend_fakes import node_entry
from .test_control_abort import Aborted, FakeContext


def control_with(ready_nodes) -> Control:
    loaded = SimpleNamespace(limits=SimpleNamespace(prefix_cache=True))
    model = SimpleNamespace(loaded=loaded, models={"m": loaded})
    relay = KvEventRelay(lambda: ready_nodes, lambda address: None, "frontend.test", 50051)
    return Control(None, "fe-test", None, None, None, None, model, relay)


async def first_response(control: Control, request: kv_pb2.SubscribeKvEventsRequest, context: FakeContext):
    async for response in control.SubscribeKvEvents(request, context):
        return response


async def test_no_ready_node_is_unavailable_not_a_stream_that_never_answers():
    context = FakeContext()
    with pytest.raises(Aborted):
        await first_response(control_with([]), kv_pb2.SubscribeKvEventsRequest(), context)
    assert context.status is not None and context.status[0] == grpc.StatusCode.UNAVAILABLE


async def test_a_rank_no_ready_node_has_is_refused_naming_the_ready_ones():
    context = FakeContext()
    request = kv_pb2.SubscribeKvEventsRequest(data_parallel_ranks=[3])
    with pytest.raises(Aborted, match=r"\[3\] name no ready node \(ready ranks: 0"):
        await first_response(control_with([node_entry("n0")]), request, context)
    assert context.status[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_the_sources_are_the_ready_nodes_asked_for():
    relay = KvEventRelay(
        lambda: [node_entry("n1", rank=1), node_entry("n0")], lambda address: None, "frontend.test", 50051
    )
    assert [s.data_parallel_rank for s in relay.sources([])] == [0, 1]
    assert [s.data_parallel_rank for s in relay.sources([1, 5])] == [1]
    assert relay.sources([1])[0].endpoint_addr.host == "frontend.test"


def fake_reads(monkeypatch) -> None:
    """Each node read sends one batch naming its rank (sequence number 1 when read from a snapshot), then waits."""

    async def read(self, node, node_request, relayed) -> None:
        batch = kv_pb2.KvEventBatch(data_parallel_rank=node.rank, sequence_number=int(node_request.include_snapshot))
        await relayed.put(kv_pb2.SubscribeKvEventsResponse(batch=batch))
        await asyncio.Event().wait()

    monkeypatch.setattr(KvEventRelay, "_read", read)
    monkeypatch.setattr(kv_events, "NEW_NODES_S", 0.01)


@pytest.mark.parametrize("ranks", [[], [0]])
async def test_a_subscription_without_ranks_also_reads_nodes_ready_later_from_their_snapshot(monkeypatch, ranks):
    fake_reads(monkeypatch)
    ready = [node_entry("n0")]
    relay = KvEventRelay(lambda: list(ready), lambda address: None, "frontend.test", 50051)
    request = kv_pb2.SubscribeKvEventsRequest(data_parallel_ranks=ranks)
    stream = relay.subscribe(request, relay.check(request))
    try:
        assert (await anext(stream)).batch.data_parallel_rank == 0
        ready.append(node_entry("n1", rank=1))
        later = asyncio.ensure_future(anext(stream))
        done, _ = await asyncio.wait([later], timeout=0.5)
        if ranks:  # the ranks named are the ones read
            assert not done
            later.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await later
        else:
            assert done and later.result().batch.data_parallel_rank == 1
            assert later.result().batch.sequence_number == 1, "read from its snapshot"
    finally:
        await stream.aclose()
