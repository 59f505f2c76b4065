"""No stream may hang, whatever went wrong below: a request that hears nothing from its node for the stall
timeout ends with a retryable error; one whose client accepts no output for the client stall timeout is ended
(`RequestSink.stall_client`)."""

from __future__ import annotations

import asyncio
import logging
import time

from ..common.logging_setup import log_event
from . import metrics
from .nodes import LaneFailure, RequestSink

logger = logging.getLogger("openengine_serve.frontend")


async def stall_watchdog(sinks: dict[str, RequestSink], stall_timeout_s: float, client_stall_timeout_s: float) -> None:
    """Runs until cancelled, checking `sinks` (request id -> inbox, read live) a few times per timeout."""
    while True:
        await asyncio.sleep(min(1.0, stall_timeout_s / 4, client_stall_timeout_s / 4))
        now = time.monotonic()
        silent_since = now - stall_timeout_s
        client_silent_since = now - client_stall_timeout_s
        for request_id, sink in list(sinks.items()):
            if 0.0 < sink.writing_since < client_silent_since and not sink.client_stalled:
                log_event(
                    logger, "client stalled", logging.WARNING, request_id=request_id, silent_s=client_stall_timeout_s
                )
                sink.stall_client()
                continue
            if sink.last_event_at < silent_since and not sink.paused:  # a paused one waits for its client
                log_event(logger, "request stalled", logging.WARNING, request_id=request_id, silent_s=stall_timeout_s)
                sink.fail(
                    LaneFailure(
                        f"no progress from the engine for {stall_timeout_s:g} s; retry the request", retryable=True
                    )
                )


LOOP_LAG_INTERVAL_S = 0.25


async def measure_loop_lag(interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
    """Event-loop lag: how much later than asked a short sleep wakes (the time callbacks wait for the loop).
    A loop that is truly stuck stops updating this, and stops answering grpc.health.v1 liveness, which is
    served on the same loop."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(interval_s)
        metrics.EVENT_LOOP_LAG.set(max(0.0, loop.time() - asked - interval_s))
