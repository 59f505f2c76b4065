"""Calls coalesced per event-loop tick onto one bidirectional stream: the shape of the frontend's batched
Reserve/Release (`reservation_stream.py`) and Submit (`nodes.py : SubmissionBatcher`).

Every call asked for during one tick of the event loop goes out in one batch message;
the server answers each batch with one message holding one outcome per call, in
order, so the replies are matched to batches by position. At most one batch is out
unanswered (MAX_UNANSWERED): while it is, the calls of the next ticks gather and go
out together once it is answered. Under load the batches grow instead of the
messages (requests reach the frontend one completion at a time, so a tick alone
rarely holds more than one); an idle stream sends a call at once.

Riders (e.g. releases) need no answer: they go out with the next batch and are kept
until the batch that carried them is answered. A batch of riders alone counts against
MAX_UNANSWERED for riders only: a call does not wait behind it (that wait was part of
the first token's time). When the stream breaks, every call not yet answered fails with
`StreamBroken` and the unanswered riders are sent again on the next stream. The next
call or `flush` opens a new stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from ..common.grpc_server import STATUS_BY_NUMBER
from ..common.logging_setup import log_event

logger = logging.getLogger("openengine_serve.frontend")

# Larger ticks are split: one message stays well under gRPC's default 4 MB limit.
MAX_BATCH = 2048
# Batches written and not yet answered before the next waits: one round trip gathers the calls behind it.
MAX_UNANSWERED = 1
# Riders kept while the server cannot be reached; beyond this the oldest are dropped.
MAX_KEPT_RIDERS = 100_000


class StreamBroken(Exception):
    """The stream ended before the call was answered (server gone, restarted or unreachable)."""


class Refused(Exception):
    """The server answered the call with a refusal; `code` is the status the unary call would end with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _time_out(future: asyncio.Future) -> None:
    if not future.done():  # a timed-out call still in `_calls` is skipped when its batch is built
        future.set_exception(TimeoutError())


class BatchCall(Protocol):
    """What the batcher needs of a grpc.aio stream-stream call."""

    async def write(self, message: Any) -> None: ...
    async def read(self) -> Any: ...  # the batch's replies, or grpc.aio.EOF once the server ended the stream
    def cancel(self) -> bool: ...


class BatchedStream:
    """Coalesces calls and riders per tick onto one stream (see the module docstring). A subclass says how a
    batch is built (`_batch`), where a reply's outcomes are (`_outcomes`), what an accepted outcome returns
    (`_result`) and which `Refused` subclass a refused one raises (`refusal`); `kind`, `calls_name` and
    `riders_name` name the stream and what it carries in its log lines. An outcome carries
    `refusal_code` (0: accepted) and `refusal` (the message)."""

    kind = "batched"
    calls_name = "calls"
    riders_name = "riders"
    refusal: type[Refused] = Refused
    max_kept_riders = MAX_KEPT_RIDERS

    def __init__(
        self, open_call: Callable[[], BatchCall], max_batch: int = MAX_BATCH, max_unanswered: int = MAX_UNANSWERED
    ) -> None:
        self.max_batch = max_batch
        self.max_unanswered = max_unanswered
        self.batches_sent = 0
        self.streams_opened = 0
        self._open_call = open_call
        self._calls: list[tuple[Any, asyncio.Future]] = []
        self._riders: list[Any] = []
        # Per batch written and not yet answered: its calls' futures and its riders.
        self._unanswered: collections.deque[tuple[list[asyncio.Future], list[Any]]] = collections.deque()
        self._call: BatchCall | None = None
        self._reader: asyncio.Task | None = None
        self._sender: asyncio.Task | None = None
        self._wake = asyncio.Event()

    # ---------------------------------------------------------------- what a subclass defines

    def _batch(self, requests: list, riders: list) -> Any:
        raise NotImplementedError

    def _outcomes(self, reply) -> Sequence:
        raise NotImplementedError

    def _result(self, outcome) -> Any:
        return None

    # ---------------------------------------------------------------- the callers' side

    async def _call_batched(self, request, timeout_s: float | None = None) -> Any:
        """The call's outcome; raises TimeoutError after `timeout_s` (one timer, cheaper than asyncio.timeout)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.append((request, future))
        self._kick()
        if timeout_s is None:
            return await future
        timer = loop.call_later(timeout_s, _time_out, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _ride(self, rider) -> None:
        self._riders.append(rider)
        self._kick()

    def flush(self) -> None:
        """Sends what is waiting (the riders kept after a broken stream) without waiting for a call."""
        if self._riders or self._calls:
            self._kick()

    @property
    def _pending_riders(self) -> int:
        return len(self._riders) + sum(len(riders) for _, riders in self._unanswered)

    async def close(self) -> None:
        for task in (self._sender, self._reader):
            if task is not None:
                task.cancel()
        self._broken(self._call, "frontend closing")
        for _, future in self._calls:
            if not future.done():
                future.set_exception(StreamBroken("frontend closing"))
        self._calls.clear()

    # ---------------------------------------------------------------- the stream

    def _kick(self) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_loop(), name=f"{self.kind}-sender")
        self._wake.set()

    async def _send_loop(self) -> None:
        # Woken at most once per tick: everything asked for until it runs goes into one batch. With
        # max_unanswered batches out, what is asked for waits for an answer (`_answer` wakes this loop).
        while True:
            await self._wake.wait()
            await asyncio.sleep(0)  # let the rest of this tick's callbacks (already scheduled) add theirs
            self._wake.clear()
            while self._may_send():
                if not await self._send_one():
                    break  # the stream broke: what is left waits for the next call, rider or flush

    def _may_send(self) -> bool:
        """Calls wait only behind batches that carry calls: a batch of riders alone (a release) holds back no call
        (the replies stay in order, one per batch). Riders alone wait until nothing is unanswered."""
        if self._calls:
            return sum(1 for futures, _ in self._unanswered if futures) < self.max_unanswered
        return bool(self._riders) and len(self._unanswered) < self.max_unanswered

    async def _send_one(self) -> bool:
        calls, self._calls = self._calls[: self.max_batch], self._calls[self.max_batch :]
        riders, self._riders = self._riders[: self.max_batch], self._riders[self.max_batch :]
        futures, requests = [], []
        for request, future in calls:
            if future.done():  # the caller stopped waiting before it was sent: it cleans up itself
                continue
            requests.append(request)
            futures.append(future)
        batch = self._batch(requests, riders)
        if self._call is None:
            try:
                self._call = self._open_call()
            except Exception as exc:  # noqa: BLE001 - e.g. the channel is closed: as a stream broken at once
                self._unanswered.append((futures, riders))
                self._fail_unanswered(repr(exc))
                return False
            self.streams_opened += 1
            self._reader = asyncio.create_task(self._read_loop(self._call), name=f"{self.kind}-reader")
        call = self._call
        self._unanswered.append((futures, riders))
        try:
            await call.write(batch)
        except Exception as exc:  # noqa: BLE001 - any failure to write ends this stream; the reader may have seen it first
            self._broken(call, repr(exc))
            return False
        self.batches_sent += 1
        return True

    async def _read_loop(self, call: BatchCall) -> None:
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    self._broken(call, "the server ended the stream")
                    return
                self._answer(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - grpc.aio.AioRpcError mostly; any error ends the stream
            detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            self._broken(call, detail)

    def _answer(self, reply) -> None:
        futures, _ = self._unanswered.popleft()
        for future, outcome in zip(futures, self._outcomes(reply), strict=True):
            if future.done():
                continue  # the caller stopped waiting (or timed out); it cleans up itself
            if outcome.refusal_code:
                future.set_exception(self.refusal(STATUS_BY_NUMBER[outcome.refusal_code], outcome.refusal))
            else:
                future.set_result(self._result(outcome))
        if self._calls or self._riders:
            self._wake.set()  # what gathered behind the answered batch goes out

    def _broken(self, call: BatchCall | None, detail: str) -> None:
        """Fails what this stream did not answer; its riders go out again on the next one."""
        if call is None or call is not self._call:
            return  # already handled (the writer and the reader both see a failure)
        self._call = None
        call.cancel()
        self._fail_unanswered(detail)

    def _fail_unanswered(self, detail: str) -> None:
        unanswered, self._unanswered = self._unanswered, collections.deque()
        failed = 0
        self._riders[:0] = [rider for _, riders in unanswered for rider in riders]  # oldest first
        for futures, _ in unanswered:
            for future in futures:
                if not future.done():
                    future.set_exception(StreamBroken(detail))
                    failed += 1
        dropped = max(0, len(self._riders) - self.max_kept_riders)
        del self._riders[:dropped]
        log_event(
            logger,
            f"{self.kind} stream broken",
            logging.WARNING if failed or self._riders else logging.INFO,
            detail=detail,
            **{
                f"{self.calls_name}_failed": failed,
                f"{self.riders_name}_kept": len(self._riders),
                f"{self.riders_name}_dropped": dropped,
            },
        )
