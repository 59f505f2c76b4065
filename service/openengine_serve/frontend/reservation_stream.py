"""The frontend's batched Reserve/Release: one stream to the coordinator, one message per event-loop tick.

Every reservation and release asked for during one tick of the event loop goes
out as one `ReservationBatch` on the frontend's `Reservations` stream; the
coordinator answers each batch with one `ReservationReplies` (one outcome per
reservation, in order), so the replies are matched to batches by position.
While a batch is being written, the next tick's requests gather and go out
together after it: under load the batches grow instead of the messages.

Releases need no answer: they ride on the next batch, and they are kept until
the batch that carried them is answered. When the stream breaks, every
reservation not yet answered fails with `StreamBroken` (the caller routes on its
own, as when the coordinator cannot be reached) and the unanswered releases are
sent again on the next stream (a release of an unknown id is a no-op there).
Requests already accepted are not affected: their reservations stay on the
coordinator until released. The next reservation or `flush` opens a new stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from ..api.openengine_internal.v1 import cluster_pb2
from ..common.logging_setup import log_event

logger = logging.getLogger("openengine_serve.frontend")

# Larger ticks are split: one message stays well under gRPC's default 4 MB limit.
MAX_BATCH = 2048
# Releases kept while the coordinator cannot be reached; beyond this the oldest are dropped (a coordinator
# that restarted no longer knows them; one that did not keeps those reservations until this frontend expires).
MAX_KEPT_RELEASES = 100_000


class StreamBroken(Exception):
    """The stream ended before the reservation was answered (coordinator gone, restarted or unreachable)."""


class ReservationRefused(Exception):
    """The coordinator refused the reservation; `code` is the gRPC status code the unary Reserve would use."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ReservationCall(Protocol):
    """What the batcher needs of a grpc.aio stream-stream call."""

    async def write(self, message: cluster_pb2.ReservationBatch) -> None: ...
    async def read(self) -> Any: ...  # ReservationReplies, or grpc.aio.EOF once the coordinator ended it
    def cancel(self) -> bool: ...


STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class ReservationBatcher:
    """Coalesces reservations and releases per tick onto one stream (see the module docstring)."""

    def __init__(self, frontend_id: str, open_call: Callable[[], ReservationCall], max_batch: int = MAX_BATCH) -> None:
        self.frontend_id = frontend_id
        self.max_batch = max_batch
        self.batches_sent = 0
        self.streams_opened = 0
        self._open_call = open_call
        self._reserves: list[tuple[cluster_pb2.ReserveRequest, asyncio.Future]] = []
        self._releases: list[str] = []
        # Per batch written and not yet answered: its reservations' futures and its releases.
        self._unanswered: collections.deque[tuple[list[asyncio.Future], list[str]]] = collections.deque()
        self._call: ReservationCall | None = None
        self._reader: asyncio.Task | None = None
        self._sender: asyncio.Task | None = None
        self._wake = asyncio.Event()

    async def reserve(self, request: cluster_pb2.ReserveRequest) -> cluster_pb2.NodeEntry:
        """The node the coordinator picked; raises ReservationRefused or StreamBroken.

        `request.frontend_id` is not sent: the batch names the frontend once.
        """
        future = asyncio.get_running_loop().create_future()
        self._reserves.append((request, future))
        self._kick()
        return await future

    def release(self, request_id: str) -> None:
        self._releases.append(request_id)
        self._kick()

    def flush(self) -> None:
        """Sends what is waiting (the releases kept after a broken stream) without waiting for a reservation."""
        if self._releases or self._reserves:
            self._kick()

    @property
    def pending_releases(self) -> int:
        return len(self._releases) + sum(len(releases) for _, releases in self._unanswered)

    async def close(self) -> None:
        for task in (self._sender, self._reader):
            if task is not None:
                task.cancel()
        self._broken(self._call, "frontend closing")
        for _, future in self._reserves:
            if not future.done():
                future.set_exception(StreamBroken("frontend closing"))
        self._reserves.clear()

    def _kick(self) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_loop(), name="reservation-sender")
        self._wake.set()

    async def _send_loop(self) -> None:
        # Woken at most once per tick: everything asked for until it runs goes into one batch.
        while True:
            await self._wake.wait()
            await asyncio.sleep(0)  # let the rest of this tick's callbacks (already scheduled) add theirs
            self._wake.clear()
            while self._reserves or self._releases:
                if not await self._send_one():
                    break  # the stream broke: what is left waits for the next reservation, release or flush

    async def _send_one(self) -> bool:
        reserves, self._reserves = self._reserves[:self.max_batch], self._reserves[self.max_batch:]
        releases, self._releases = self._releases[:self.max_batch], self._releases[self.max_batch:]
        futures = []
        batch = cluster_pb2.ReservationBatch(frontend_id=self.frontend_id, release=releases)
        for request, future in reserves:
            if future.done():  # the caller stopped waiting before it was sent: it cleans up by releasing
                continue
            request.frontend_id = ""  # named once by the batch
            batch.reserve.append(request)
            futures.append(future)
        if self._call is None:
            try:
                self._call = self._open_call()
            except Exception as exc:  # noqa: BLE001 - e.g. the channel is closed: as a stream broken at once
                self._unanswered.append((futures, releases))
                self._fail_unanswered(repr(exc))
                return False
            self.streams_opened += 1
            self._reader = asyncio.create_task(self._read_loop(self._call), name="reservation-reader")
        call = self._call
        self._unanswered.append((futures, releases))
        try:
            await call.write(batch)
        except Exception as exc:  # noqa: BLE001 - any failure to write ends this stream; the reader may have seen it first
            self._broken(call, repr(exc))
            return False
        self.batches_sent += 1
        return True

    async def _read_loop(self, call: ReservationCall) -> None:
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    self._broken(call, "the coordinator ended the stream")
                    return
                self._answer(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - grpc.aio.AioRpcError mostly; any error ends the stream
            detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            self._broken(call, detail)

    def _answer(self, reply: cluster_pb2.ReservationReplies) -> None:
        futures, _ = self._unanswered.popleft()
        for future, outcome in zip(futures, reply.outcome, strict=True):
            if future.done():
                continue  # the caller stopped waiting; it releases the id itself
            if outcome.refusal_code:
                future.set_exception(ReservationRefused(STATUS_BY_NUMBER[outcome.refusal_code], outcome.refusal))
            else:
                future.set_result(outcome.node)

    def _broken(self, call: ReservationCall | None, detail: str) -> None:
        """Fails what this stream did not answer; its releases go out again on the next one."""
        if call is None or call is not self._call:
            return  # already handled (the writer and the reader both see a failure)
        self._call = None
        call.cancel()
        self._fail_unanswered(detail)

    def _fail_unanswered(self, detail: str) -> None:
        unanswered, self._unanswered = self._unanswered, collections.deque()
        failed = 0
        self._releases[:0] = [request_id for _, releases in unanswered for request_id in releases]  # oldest first
        for futures, _ in unanswered:
            for future in futures:
                if not future.done():
                    future.set_exception(StreamBroken(detail))
                    failed += 1
        dropped = max(0, len(self._releases) - MAX_KEPT_RELEASES)
        del self._releases[:dropped]
        log_event(logger, "reservation stream broken", logging.WARNING if failed or self._releases else logging.INFO,
                  detail=detail, reservations_failed=failed, releases_kept=len(self._releases),
                  releases_dropped=dropped)
