"""No stream may hang, whatever went wrong below: a request that hears nothing from its node for the stall
timeout ends with a retryable error."""

from __future__ import annotations

import asyncio
import logging
import time

from ..common.logging_setup import log_event
from .nodes import LaneFailure, RequestSink

logger = logging.getLogger("openengine_serve.frontend")


async def stall_watchdog(sinks: dict[str, RequestSink], stall_timeout_s: float) -> None:
    """Runs until cancelled, checking `sinks` (request id -> inbox, read live) a few times per timeout."""
    while True:
        await asyncio.sleep(min(1.0, stall_timeout_s / 4))
        silent_since = time.monotonic() - stall_timeout_s
        for request_id, sink in list(sinks.items()):
            if sink.last_event_at < silent_since:
                log_event(logger, "request stalled", logging.WARNING, request_id=request_id, silent_s=stall_timeout_s)
                sink.fail(LaneFailure(f"no progress from the engine for {stall_timeout_s:g} s; retry the request",
                                      retryable=True))
