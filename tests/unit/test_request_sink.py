"""The frontend's per-request inbox and the stall watchdog that guarantees no stream hangs."""

import asyncio

from openengine_serve.frontend.nodes import LaneFailure, RequestSink
from openengine_serve.frontend.watchdog import stall_watchdog


async def test_take_returns_everything_queued_in_order():
    sink = RequestSink()
    sink.put("a")
    sink.put("b")
    assert await sink.take() == ["a", "b"]
    waiter = asyncio.ensure_future(sink.take())
    await asyncio.sleep(0)
    assert not waiter.done()
    sink.put("c")
    assert await asyncio.wait_for(waiter, 1) == ["c"]


async def test_a_sink_fails_once():
    sink = RequestSink()
    sink.fail(LaneFailure("lost", retryable=True))
    sink.fail(LaneFailure("again", retryable=True))
    items = await sink.take()
    assert [i.message for i in items] == ["lost"]


async def test_silent_request_ends_with_a_retryable_failure():
    quiet = RequestSink()
    watchdog = asyncio.ensure_future(stall_watchdog({"quiet": quiet}, stall_timeout_s=0.2, client_stall_timeout_s=30))
    try:
        items = await asyncio.wait_for(quiet.take(), 2)
    finally:
        watchdog.cancel()
    assert len(items) == 1 and isinstance(items[0], LaneFailure)
    assert items[0].retryable and "no progress" in items[0].message


async def test_a_paused_request_is_not_taken_for_a_silent_engine_and_resumes_with_a_fresh_clock():
    paused = RequestSink()
    paused.set_paused = lambda pause: True
    paused.paused = True  # its client takes nothing: the node sends nothing on purpose
    watchdog = asyncio.ensure_future(stall_watchdog({"paused": paused}, stall_timeout_s=0.2, client_stall_timeout_s=30))
    try:
        await asyncio.sleep(0.5)
        assert not paused.items
        paused.resume()
        assert not paused.paused
        await asyncio.sleep(0.1)
        assert not paused.items, "the engine's silence is counted from the resume"
        items = await asyncio.wait_for(paused.take(), 2)
    finally:
        watchdog.cancel()
    assert isinstance(items[0], LaneFailure) and "no progress" in items[0].message


async def test_a_backlog_merges_token_events_per_output_and_keeps_their_order():
    from openengine_serve.api.openengine_internal.v1 import cluster_pb2
    from openengine_serve.frontend.nodes import COMPACT_AT

    def event(index, token, finish=cluster_pb2.ENGINE_FINISH_NONE):
        return cluster_pb2.OutputEvent(
            request_id="r", output_index=index, finish=finish, tokens=[cluster_pb2.TokenRecord(token_id=token)]
        )

    sink = RequestSink()
    sink.put(cluster_pb2.OutputEvent(request_id="r", output_index=0, prompt_tokens=[cluster_pb2.TokenRecord()]))
    for token in range(2 * COMPACT_AT):
        sink.put(event(0, token))
        sink.put(event(1, token))
        assert len(sink.items) < COMPACT_AT + 2, "the backlog stays a few objects"
    sink.put(event(1, 9999, cluster_pb2.ENGINE_FINISH_LENGTH))
    items = await sink.take()
    assert items[0].prompt_tokens, "the prompt event stays first, as it came"
    tokens = {0: [], 1: []}
    for item in items[1:]:
        tokens[item.output_index] += [t.token_id for t in item.tokens]
    assert tokens[0] == list(range(2 * COMPACT_AT))
    assert tokens[1] == [*range(2 * COMPACT_AT), 9999]
    assert items[-1].finish == cluster_pb2.ENGINE_FINISH_LENGTH
    sink.put(event(0, 1))
    assert [t.token_id for t in (await sink.take())[0].tokens] == [1], "a new round starts unmerged"


async def test_direct_handling_only_while_the_stream_waits_with_nothing_queued():
    sink = RequestSink()
    handled = []

    def direct(item):
        handled.append(item)
        return None if item != "replace" else "replacement"

    sink.direct = direct
    sink.put("queued")  # nobody waits: queued, not handled
    assert await sink.take() == ["queued"] and not handled
    waiter = asyncio.ensure_future(sink.take())
    await asyncio.sleep(0)
    sink.put("sent")  # the stream waits with nothing queued: handled, not queued
    sink.put("replace")  # handled, and its replacement is queued (wakes the stream)
    sink.put("after")  # something is queued: not handled, keeps its place behind it
    assert handled == ["sent", "replace"]
    assert await asyncio.wait_for(waiter, 1) == ["replacement", "after"]
