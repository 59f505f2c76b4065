"""The frontend's data plane: one connection per node, its result lane, and each open request's inbox.

Per-token traffic never touches the coordinator: a node streams one
StepResults message per engine step on this frontend's lane, and the lane
reader hands each event to the waiting request's sink. A lane that breaks
ends every request on that node with a retryable failure.

Requests reach a node over its `Submissions` stream, every submission of one
event-loop tick in one message (`SubmissionBatcher`), answered per submission
(taken, or refused with a status code).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from . import metrics
from .batched_stream import BatchedStream, Refused
from .tasks import BackgroundTasks


@dataclass(frozen=True)
class LaneFailure:
    """Ends a request's stream with one terminal EngineError (node lost, stall, drain deadline)."""

    message: str
    retryable: bool
    draining: bool = False


def _succeeded(future: asyncio.Future | None) -> bool:
    return future is not None and future.done() and not future.cancelled() and future.exception() is None


COMPACT_AT = 256  # queued events that make a sink merge its plain token events (see RequestSink.put)


class RequestSink:
    """One request's inbox: the lane reader appends OutputEvents (or a LaneFailure); the stream takes
    everything queued at once, so a stream that fell behind catches up in one message, not one per token.

    While the stream cannot hand output to its client, events pile up here until the client stall timeout.
    From COMPACT_AT queued events on, the plain token events of each output merge into one event holding
    copies of their token records: the lane's messages are freed, and what waits is the token records of
    the stall window (at most max_tokens × num_sequences) in a few objects, not one object per step.

    Backpressure: an event that arrives while the stream has been handing output to its client for more than
    `pause_after_s` (the client takes nothing) pauses the request on its node (`set_paused(True)`): the engine
    gives it no tokens, so what waits here stops growing and its tokens cost no engine, node or lane work
    until the stream resumes it (`resume`, once its client took the output)."""

    __slots__ = (
        "items",
        "waiter",
        "last_event_at",
        "first_event_at",
        "failed",
        "writing_since",
        "owner",
        "client_stalled",
        "direct",
        "pause_after_s",
        "set_paused",
        "paused",
        "_compact_at",
        "_merged",
    )

    def __init__(self, pause_after_s: float = 0.0) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.last_event_at = time.monotonic()
        self.first_event_at = 0.0  # monotonic time the lane reader handed it its first item; 0: none yet
        self.failed = False
        self.writing_since = 0.0  # monotonic time the stream began handing output to its client; 0: not writing
        self.owner: asyncio.Task | None = None  # the task streaming to the client, cancelled when the client stalls
        self.client_stalled = False
        # Set by a stream whose server can send without waiting (pygrpc-native): called with an item while the
        # stream waits in take() with nothing queued; returns None when it sent the item itself, else what to
        # queue instead (the item, or its serialized delta that did not fit the client's buffer). It saves the
        # stream's wake-up per token.
        self.direct: Callable[[object], object] | None = None
        self.pause_after_s = pause_after_s  # 0: never paused
        # Pauses (True) or resumes (False) the request on its node; returns whether it could (set on submission).
        self.set_paused: Callable[[bool], bool] | None = None
        self.paused = False
        self._compact_at = COMPACT_AT
        self._merged: dict[int, cluster_pb2.OutputEvent] = {}  # output index -> its merged event in `items`

    def put(self, item, now: float | None = None) -> None:
        """`now`: time.monotonic() if the caller has it (the lane reader reads the clock once per lane message)."""
        self.last_event_at = now = time.monotonic() if now is None else now
        if not self.first_event_at:
            self.first_event_at = now
        direct = self.direct
        if direct is not None and not self.items:
            waiter = self.waiter
            if waiter is not None and not waiter.done():  # the stream is idle in take(): nothing to overtake
                item = direct(item)
                if item is None:
                    return
        self.items.append(item)
        if len(self.items) >= self._compact_at:
            self._compact()
        writing_since = self.writing_since
        if (
            writing_since
            and self.pause_after_s
            and not self.paused
            and now - writing_since > self.pause_after_s
            and self.set_paused is not None
        ):
            self.paused = self.set_paused(True)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def resume(self) -> None:
        """The stream's client took its output: its request, if paused, gets tokens again."""
        if self.paused:
            self.paused = False
            self.last_event_at = time.monotonic()  # the node was silent because it was told to be
            if self.set_paused is not None:
                self.set_paused(False)

    def fail(self, failure: LaneFailure) -> None:
        if not self.failed:
            self.failed = True
            self.put(failure)

    def stall_client(self) -> None:
        """The client accepted nothing for the client stall timeout: cancel the stream's task (its request
        owner frees the engine slot on the way out)."""
        if not self.client_stalled and self.owner is not None:
            self.client_stalled = True
            self.owner.cancel()

    def _compact(self) -> None:
        merged = self._merged
        kept: deque = deque()
        for item in self.items:
            if (
                type(item) is cluster_pb2.OutputEvent
                and item.finish == cluster_pb2.ENGINE_FINISH_NONE
                and not item.prompt_tokens
            ):
                target = merged.get(item.output_index)
                if item is target:  # merged by an earlier compaction
                    kept.append(item)
                    continue
                if target is None:
                    target = merged[item.output_index] = cluster_pb2.OutputEvent(
                        request_id=item.request_id, output_index=item.output_index, lane=item.lane
                    )
                    kept.append(target)
                target.tokens.extend(item.tokens)
                continue
            kept.append(item)
        self.items = kept
        self._compact_at = max(COMPACT_AT, 2 * len(kept))

    async def take(self) -> list:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items = list(self.items)
        self.items.clear()
        self._merged.clear()
        self._compact_at = COMPACT_AT
        return items


BUSY_TURN_S = 0.002  # a turn of the event loop longer than this: the loop is busy (see LaneAcknowledgements)


class LaneAcknowledgements:
    """Tells the node, on its `Lane` call, how many lane messages this frontend handled and which requests to
    pause or resume: one write at a time, what happened meanwhile sent together by the next. Credits go out
    once `every` messages were handled (the window: the node may send that many before it needs one), a pause
    or resume at once: at one message per engine step, a credit per message would be a write per token.

    With `min_interval_s` the credits are paced by the frontend's capacity: when this frontend is behind (the
    node folded several steps into the message) and the turn of the event loop in which the message's streams
    run takes longer than BUSY_TURN_S, the acknowledgement waits until `min_interval_s` after the message
    arrived. The node folds the steps meanwhile into its next message, each stream then writes one larger delta
    per message instead of one per step (fewer writes per token), and the loop gets idle time. A frontend that
    keeps up gets one step per message and acknowledges at once, however long its turns: its streams' tokens
    do not come in chunks. 0: acknowledged on receipt."""

    def __init__(self, call, min_interval_s: float = 0.0, every: int = 1) -> None:
        self._call = call
        self._min_interval_s = min_interval_s
        self._every = every
        self._handled = 0
        self._last_step = 0
        self._behind = False  # the last message handled covered more than one engine step
        self._pauses: dict[str, bool] = {}  # request id -> resume (its last change wins)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._send(), name="lane-acknowledgements")

    def handled(self, step: int) -> None:
        """One more lane message handled; `step`: its (last) engine step."""
        self._behind = step > self._last_step + 1
        self._last_step = step
        self._handled += 1
        if self._handled >= self._every:
            self._wake.set()

    def pause(self, request_id: str, resume: bool) -> None:
        self._pauses[request_id] = resume
        self._wake.set()

    async def _send(self) -> None:
        with contextlib.suppress(Exception):  # the call ended: its reader sees it
            while True:
                await self._wake.wait()
                if self._behind and self._min_interval_s:  # checked here: no coroutine per message keeping up
                    await self._pace()
                self._wake.clear()  # what was handled while this waited goes out with it
                handled, self._handled = self._handled, 0
                if not self._pauses:  # the common case: a credit alone
                    await self._call.write(cluster_pb2.LaneCredit(handled=handled))
                    continue
                pauses, self._pauses = self._pauses, {}
                await self._call.write(
                    cluster_pb2.LaneCredit(
                        handled=handled,
                        pauses=[
                            cluster_pb2.PauseRequest(request_id=request_id, resume=resume)
                            for request_id, resume in pauses.items()
                        ],
                    )
                )

    async def _pace(self) -> None:
        """This frontend is behind: if its loop is busy, waits until min_interval_s after it was called. sleep(0)
        resumes after everything that was ready when it yielded (the streams the message woke), so the time it
        takes is their work."""
        loop = asyncio.get_running_loop()
        asked = loop.time()
        await asyncio.sleep(0)
        turn = loop.time() - asked
        if turn > BUSY_TURN_S:
            await asyncio.sleep(self._min_interval_s - turn)

    def close(self) -> None:
        self._task.cancel()


class SubmitRefused(Refused):
    """The node did not take the request; `code` is the status of its refusal."""


class SubmissionBatcher(BatchedStream):
    """One node's submissions of a tick in one SubmitBatch on its Submissions stream (batched_stream.py)."""

    kind = "submission"
    calls_name = "submissions"
    refusal = SubmitRefused

    async def submit(self, request: cluster_pb2.SubmitRequest, timeout_s: float | None = None) -> None:
        """Returns once the node took the request; raises SubmitRefused, StreamBroken, or TimeoutError after
        `timeout_s`."""
        await self._call_batched(request, timeout_s)

    def _batch(self, requests: list[cluster_pb2.SubmitRequest], riders: list) -> cluster_pb2.SubmitBatch:
        return cluster_pb2.SubmitBatch(submit=requests)

    def _outcomes(self, reply: cluster_pb2.SubmitOutcomes):
        return reply.outcome


@dataclass
class NodeConnection:
    entry: cluster_pb2.NodeEntry
    channel: grpc.aio.Channel
    stub: cluster_pb2_grpc.NodeStub
    lane_ready: asyncio.Future | None = None
    lane_task: asyncio.Task | None = None
    requests: set[str] = field(default_factory=set)
    submissions: SubmissionBatcher = field(init=False)
    acknowledgements: LaneAcknowledgements | None = None  # while the Lane call is open: pauses go on it

    def __post_init__(self) -> None:
        # The stub is looked up at each stream opening (unit tests replace it).
        self.submissions = SubmissionBatcher(lambda: self.stub.Submissions())


class NodeConnections:
    def __init__(
        self,
        frontend_id: str,
        tasks: BackgroundTasks,
        connect_timeout_s: float,
        call_timeout_s: float,
        open_channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
        lane_window: int = 2,
        lane_busy_ack_interval_s: float = 0.0,
        pause_after_s: float = 0.0,
    ) -> None:
        self.frontend_id = frontend_id
        self.lane_window = lane_window  # lane messages a node may have sent and this frontend not handled; 0: any
        self.lane_busy_ack_interval_s = lane_busy_ack_interval_s  # LaneAcknowledgements: credit pacing when busy
        self.pause_after_s = pause_after_s  # RequestSink: a client taking nothing this long pauses its request
        self._open_channel = open_channel
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        self.connections: dict[str, NodeConnection] = {}
        self.sinks: dict[str, RequestSink] = {}  # request id -> inbox, for every request with a sink open
        self._tasks = tasks

    def in_flight(self, node_id: str) -> int:
        """This frontend's requests submitted to the node."""
        conn = self.connections.get(node_id)
        return len(conn.requests) if conn is not None else 0

    async def connect(self, entry: cluster_pb2.NodeEntry) -> NodeConnection:
        """The node's connection with its result lane open (opened on first use)."""
        conn = self.connections.get(entry.node_id)
        if conn is not None and conn.lane_task is not None and _succeeded(conn.lane_ready):
            return conn  # the common case: no timer, no shield per request
        if conn is None:
            channel = self._open_channel(entry.address)
            conn = NodeConnection(entry, channel, cluster_pb2_grpc.NodeStub(channel))
            self.connections[entry.node_id] = conn
        if conn.lane_task is None:
            conn.lane_ready = asyncio.get_running_loop().create_future()
            conn.lane_task = asyncio.create_task(self._read_lane(conn, conn.lane_ready))
        assert conn.lane_ready is not None  # created with the lane task
        await asyncio.wait_for(asyncio.shield(conn.lane_ready), timeout=self.connect_timeout_s)
        return conn

    async def _read_lane(self, conn: NodeConnection, lane_ready: asyncio.Future) -> None:
        """`lane_ready`: the connection's, resolved by the lane's first message."""
        reason = "result lane closed"
        try:
            async with contextlib.aclosing(self._lane_messages(conn)) as lane:
                async for results in lane:
                    if not lane_ready.done():
                        lane_ready.set_result(None)
                        continue
                    self._dispatch(results.events, conn.requests)
        except grpc.aio.AioRpcError as exc:
            reason = f"node {conn.entry.node_id} at {conn.entry.address} was lost ({exc.code().name})"
        except asyncio.CancelledError:
            reason = "frontend is shutting down"
        if not lane_ready.done():
            lane_ready.set_exception(ConnectionError(reason))
        self._fail_requests(conn, reason)
        conn.lane_task = None

    def _dispatch(self, events, held: set[str]) -> None:
        """Each event into its request's inbox. Requests that get their first event go first: their streams wake
        before those catching up on a backlog, so a new request's first token does not wait for their writes.
        `held`: the requests submitted to this lane's node; events for any other request are not its to send."""
        sinks = self.sinks
        now = time.monotonic()  # one clock read per lane message
        later = []
        for event in events:
            sink = sinks.get(event.request_id)
            if sink is None or event.request_id not in held:
                continue
            if sink.first_event_at:
                later.append((sink, event))
            else:
                sink.put(event, now)
        for sink, event in later:
            sink.put(event, now)

    async def _lane_messages(self, conn: NodeConnection):
        """The node's lane messages (its `Lane` call), the first being the "subscribed" one. Each message is
        acknowledged as it is read, so the node has at most `lane_window` of them (0: any number) in the transport
        or unread and folds the rest into its waiting message."""
        call = conn.stub.Lane()
        await call.write(cluster_pb2.LaneCredit(frontend_id=self.frontend_id, window=self.lane_window))
        opened = await call.read()
        if opened is grpc.aio.EOF:
            return
        yield opened
        acknowledgements = conn.acknowledgements = LaneAcknowledgements(
            call, self.lane_busy_ack_interval_s, every=max(1, self.lane_window)
        )
        try:
            while (results := await call.read()) is not grpc.aio.EOF:
                # Scheduled before its events wake their streams, so the node's next message is under way
                # while they work (or, paced, after the busy interval); it folds everything meanwhile.
                acknowledgements.handled(results.step)
                yield results
        finally:
            conn.acknowledgements = None
            acknowledgements.close()
            call.cancel()

    def _fail_requests(self, conn: NodeConnection, reason: str) -> None:
        for request_id in list(conn.requests):
            sink = self.sinks.get(request_id)
            if sink is not None:
                sink.fail(LaneFailure(reason, retryable=True))
        conn.requests.clear()

    def keep_only(self, node_ids) -> None:
        """Drops the connections of nodes no longer in the deployment; their requests fail (retryable)."""
        for node_id in list(self.connections):
            if node_id not in node_ids:
                self._drop_connection(node_id, "node left the deployment")

    def _drop_connection(self, node_id: str, reason: str) -> None:
        conn = self.connections.pop(node_id)
        if conn.lane_task is not None:
            conn.lane_task.cancel()
        self._tasks.spawn(conn.submissions.close())
        self._fail_requests(conn, reason)
        self._tasks.spawn(conn.channel.close())

    def open_sink(self, request_id: str) -> RequestSink:
        sink = self.sinks[request_id] = RequestSink(self.pause_after_s)
        return sink

    def close_sink(self, request_id: str, node_id: str) -> None:
        sink = self.sinks.pop(request_id, None)
        if sink is not None and sink.paused:  # it ends paused: its request is cancelled or finished on the node
            metrics.PAUSED_STREAMS.dec()
        conn = self.connections.get(node_id)
        if conn is not None:
            conn.requests.discard(request_id)

    async def submit(
        self, conn: NodeConnection, engine_request: cluster_pb2.EngineRequest, trace: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """Returns once the node took the request; raises SubmitRefused, StreamBroken or TimeoutError. `trace`:
        traceparent/tracestate pairs, carried in the submission's fields."""
        conn.requests.add(engine_request.request_id)
        sink = self.sinks.get(engine_request.request_id)
        if sink is not None:
            sink.set_paused = functools.partial(self.pause, conn, engine_request.request_id)
        request = cluster_pb2.SubmitRequest(request=engine_request)
        for key, value in trace:
            if key in ("traceparent", "tracestate"):
                setattr(request, key, value)
        await conn.submissions.submit(request, self.call_timeout_s)

    def pause(self, conn: NodeConnection, request_id: str, paused: bool) -> bool:
        """Pauses (or resumes) a request on its node, on the lane's call; False when the lane has no call to say
        it on (the lane is reopening)."""
        acknowledgements = conn.acknowledgements
        if paused:
            if acknowledgements is None:
                return False
            acknowledgements.pause(request_id, resume=False)
            metrics.CLIENT_PAUSES.inc()
            metrics.PAUSED_STREAMS.inc()
            return True
        metrics.PAUSED_STREAMS.dec()
        if acknowledgements is not None:  # else its lane broke meanwhile: the node cancelled its requests
            acknowledgements.pause(request_id, resume=True)
        return True

    def cancel(self, conn: NodeConnection, request_id: str, output_index: int | None = None) -> None:
        request = cluster_pb2.CancelRequest(request_id=request_id)
        if output_index is not None:
            request.output_index = output_index
        self._tasks.spawn(conn.stub.Cancel(request, timeout=self.call_timeout_s))

    def fail_all(self, failure: LaneFailure) -> None:
        for sink in self.sinks.values():
            sink.fail(failure)

    async def close(self) -> None:
        for conn in self.connections.values():
            if conn.lane_task is not None:
                conn.lane_task.cancel()
            await conn.submissions.close()
            await conn.channel.close()
