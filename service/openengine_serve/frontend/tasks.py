"""Fire-and-forget internal calls (release, cancel, closing a channel) that must never fail a stream."""

from __future__ import annotations

import asyncio
import logging

from ..common.logging_setup import log_event

logger = logging.getLogger("openengine_serve.frontend")


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones

    def spawn(self, coro) -> None:
        """Runs `coro` in the background; its failure is logged, never raised."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_event(logger, "background call failed", logging.DEBUG, error=repr(task.exception()))
