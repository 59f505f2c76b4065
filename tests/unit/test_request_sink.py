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
