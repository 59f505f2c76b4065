"""A peer's heartbeats to one coordinator on one long-lived stream (`NodeHeartbeats`, `FrontendHeartbeats`), and
the loop around them (`PeerHeartbeats`: register, heartbeat, register again when forgotten).

A unary call per heartbeat would cost the coordinator a call's setup each time;
with 1,000 nodes that keeps its event loop busy in bursts. Here the peer (node or
frontend) keeps one stream per coordinator, writes one heartbeat at a time and
waits for its reply, which the coordinator sends in order: the exchange of a
unary call, without a call per heartbeat.

Quiet heartbeats (nodes): a reply costs the coordinator about as much as the
heartbeat itself (a `sendmsg` per reply), and a node's usual reply says only
"known". A heartbeat sent with `quiet=True` is marked `reply_optional` once the
coordinator answered one heartbeat on this stream, and is then not waited for: the
coordinator answers it only by ending the stream when it no longer knows the
node, which the next heartbeat sees (`done`) and answers by opening a new stream,
whose first heartbeat asks for its reply (known=false: register); a heartbeat
written just as the stream ends fails instead (gRPC: INTERNAL), and the one
after the backoff's first step opens that stream. Every
`ACK_EVERY_S` one heartbeat asks for its reply anyway, so a connection that died
silently still shows within that time.

A stream that fails (the coordinator restarted or is gone, or no reply within
the deadline) is cancelled and the heartbeat fails; the next heartbeat opens a
new stream. Until one succeeds again (its registration
failing counts as well) the peer waits a backoff instead of the interval: doubling from `BACKOFF_FIRST_S`, never more
than the interval, jittered so that peers do not come back in step. So a
restarted coordinator hears from every peer within about one interval, and one
that is down gets at most a heartbeat per interval from each. Nothing on the
coordinator follows the stream: a peer is lost only after the expiry time
without a heartbeat, however its streams end.

The loop (`PeerHeartbeats`) is the same for a node and a frontend: register when
needed (a failed registration counts into the backoff), heartbeat, register again
when a reply says known=false, wait `next_delay`. What differs comes in as hooks:
the heartbeat and its handling (a node's drain acknowledgement, a frontend's node
table), what a failure means to the peer (a log line, an unreachable coordinator),
and a node's `wake` (it heartbeats at once when it starts draining).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

import grpc

BACKOFF_FIRST_S = 0.05
# A quiet peer asks for a reply at least this often (a liveness check of the stream).
ACK_EVERY_S = 10.0


class HeartbeatCall(Protocol):
    """What a heartbeat stream needs of a grpc.aio stream-stream call."""

    async def write(self, message: Any) -> None: ...
    async def read(self) -> Any: ...  # the reply, or grpc.aio.EOF once the coordinator ended the stream
    async def code(self) -> grpc.StatusCode: ...  # once done: the status the call ended with
    async def details(self) -> str: ...
    def done(self) -> bool: ...
    def cancel(self) -> bool: ...


class HeartbeatFailed(Exception):
    """The heartbeat got no reply: `code` is the gRPC status the stream ended with (UNAVAILABLE when the
    coordinator ended it, DEADLINE_EXCEEDED when no reply came in time)."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}" if detail else code.name)
        self.code = code
        self.detail = detail


class HeartbeatStream:
    """One peer's heartbeat stream to one coordinator (see the module docstring)."""

    def __init__(
        self,
        open_call: Callable[[], HeartbeatCall],
        reply_timeout_s: float,
        jitter: Callable[[], float] = random.random,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.streams_opened = 0
        self.failures = 0  # in a row, since the last reply
        self.replies_skipped = 0  # quiet heartbeats sent without waiting for a reply
        self._open_call = open_call
        self._reply_timeout_s = reply_timeout_s
        self._jitter = jitter
        self._now = now
        self._call: HeartbeatCall | None = None
        self._answered = False  # the coordinator answered a heartbeat on this stream
        self._replied_at = 0.0

    async def beat(self, heartbeat: Any, quiet: bool = False) -> Any:
        """Sends one heartbeat and returns its reply; raises HeartbeatFailed (the stream is then closed).

        `quiet` (a NodeHeartbeatRequest): the reply may be skipped (see the module docstring); returns None when
        it was."""
        if self._call is not None and self._call.done():
            await self._ended_by_coordinator(self._call)
        try:
            if self._call is None:
                self._call = self._open_call()
                self.streams_opened += 1
                self._answered = False
            skip_reply = quiet and self._answered and self._now() - self._replied_at < ACK_EVERY_S
            if quiet:
                heartbeat.reply_optional = skip_reply
            async with asyncio.timeout(self._reply_timeout_s):  # not wait_for: no extra task per heartbeat
                await self._call.write(heartbeat)
                if skip_reply:
                    self.replies_skipped += 1
                    return None
                reply = await self._call.read()
        except TimeoutError:
            self._fail(grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply within {self._reply_timeout_s:g} s")
        except grpc.aio.AioRpcError as exc:
            self._fail(exc.code(), exc.details() or "")
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a write on a call that already ended, a closed channel
            self._fail(grpc.StatusCode.UNAVAILABLE, repr(exc))
        if reply is grpc.aio.EOF:
            self._fail(grpc.StatusCode.UNAVAILABLE, "the coordinator ended the stream")
        self.failures = 0
        self._replied_at = self._now()
        self._answered = True
        return reply

    async def _ended_by_coordinator(self, call: HeartbeatCall) -> None:
        """The call ended before this heartbeat: with OK, the coordinator no longer knows this peer (it ends a
        quiet peer's stream to say so): a new stream is opened and its first heartbeat asks. Else it broke."""
        code = await call.code()
        if code != grpc.StatusCode.OK:
            self._fail(code, await call.details() or "")
        self._call = None

    def record_failure(self) -> None:
        """Another step of the peer's loop failed (its registration): the next heartbeat waits the backoff too."""
        self.failures += 1

    def next_delay(self, interval_s: float) -> float:
        """How long until the next heartbeat: the interval, or after a failure the backoff (see the module
        docstring), at most the interval."""
        if not self.failures:
            return interval_s
        backoff = min(interval_s, BACKOFF_FIRST_S * 2 ** (self.failures - 1))
        return backoff * (0.5 + 0.5 * self._jitter())

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    def _fail(self, code: grpc.StatusCode, detail: str) -> NoReturn:
        self.close()
        self.record_failure()
        raise HeartbeatFailed(code, detail) from None


class PeerHeartbeats:
    """One peer's loop with one coordinator (see the module docstring); `run` until cancelled.

    Hooks: `register()` registers and returns the heartbeat interval the coordinator asks for (None or 0: keep
    `interval_s`), raising grpc.aio.AioRpcError when it fails; `heartbeat()` builds the next heartbeat,
    `quiet(heartbeat)` says whether its reply may be skipped; `on_reply(heartbeat, reply)` gets every reply read
    (known or not); `on_register_failed(exc)` and `on_heartbeat_failed(exc)` are told of each failure. `wake`, once
    set, cuts the wait short: the next heartbeat goes at once.

    Two choices differ between the peers as they were built (kept, not merged): after known=false a node registers
    at once, a frontend at its next heartbeat (`register_at_once_when_forgotten`); after a failed heartbeat a
    frontend registers again before its next one, a node only once a reply says known=false
    (`register_after_failed_heartbeat`).
    """

    def __init__(
        self,
        stream: HeartbeatStream,
        interval_s: float,
        *,
        register: Callable[[], Awaitable[float | None]],
        heartbeat: Callable[[], Any],
        on_reply: Callable[[Any, Any], None],
        on_register_failed: Callable[[grpc.aio.AioRpcError], None],
        on_heartbeat_failed: Callable[[HeartbeatFailed], None],
        quiet: Callable[[Any], bool] = lambda heartbeat: False,
        wake: asyncio.Event | None = None,
        register_at_once_when_forgotten: bool = True,
        register_after_failed_heartbeat: bool = False,
    ) -> None:
        self.stream = stream
        self.interval_s = interval_s
        self.wake = wake if wake is not None else asyncio.Event()
        self._register = register
        self._heartbeat = heartbeat
        self._quiet = quiet
        self._on_reply = on_reply
        self._on_register_failed = on_register_failed
        self._on_heartbeat_failed = on_heartbeat_failed
        self._register_at_once_when_forgotten = register_at_once_when_forgotten
        self._register_after_failed_heartbeat = register_after_failed_heartbeat

    async def run(self) -> None:
        registered = False
        try:
            while True:
                self.wake.clear()  # a wake from here on (a node's drain) asks for the heartbeat after this one
                try:
                    if not registered:
                        self.interval_s = await self._register() or self.interval_s
                        registered = True
                    heartbeat = self._heartbeat()
                    reply = await self.stream.beat(heartbeat, quiet=self._quiet(heartbeat))
                    if reply is not None:  # None: a quiet heartbeat whose reply was skipped
                        self._on_reply(heartbeat, reply)
                        registered = reply.known
                        if not registered and self._register_at_once_when_forgotten:
                            continue
                except grpc.aio.AioRpcError as exc:  # the registration (the heartbeat raises HeartbeatFailed)
                    self.stream.record_failure()
                    self._on_register_failed(exc)
                except HeartbeatFailed as exc:
                    self._on_heartbeat_failed(exc)
                    if self._register_after_failed_heartbeat:
                        registered = False
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that arrives just after `wake` was set
                # (as a node's drain does), and the node's stop then waited for this loop until it was killed.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.stream.next_delay(self.interval_s)):
                        await self.wake.wait()
        finally:
            self.stream.close()
