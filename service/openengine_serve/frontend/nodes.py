"""The frontend's data plane: one connection per node, its result lane, and each open request's inbox.

Per-token traffic never touches the coordinator: a node streams one
StepResults message per engine step on this frontend's lane, and the lane
reader hands each event to the waiting request's sink. A lane that breaks
ends every request on that node with a retryable failure.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from .tasks import BackgroundTasks


@dataclass(frozen=True)
class LaneFailure:
    """Ends a request's stream with one terminal EngineError (node lost, stall, drain deadline)."""
    message: str
    retryable: bool
    draining: bool = False


class RequestSink:
    """One request's inbox: the lane reader appends OutputEvents (or a LaneFailure); the stream takes
    everything queued at once, so a stream that fell behind catches up in one message, not one per token."""

    __slots__ = ("items", "waiter", "last_event_at", "failed")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.last_event_at = time.monotonic()
        self.failed = False

    def put(self, item) -> None:
        self.items.append(item)
        self.last_event_at = time.monotonic()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, failure: LaneFailure) -> None:
        if not self.failed:
            self.failed = True
            self.put(failure)

    async def take(self) -> list:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items = list(self.items)
        self.items.clear()
        return items


@dataclass
class NodeConnection:
    entry: cluster_pb2.NodeEntry
    channel: grpc.aio.Channel
    stub: cluster_pb2_grpc.NodeStub
    lane_ready: asyncio.Future | None = None
    lane_task: asyncio.Task | None = None
    requests: set[str] = field(default_factory=set)


class NodeConnections:
    def __init__(self, frontend_id: str, tasks: BackgroundTasks, connect_timeout_s: float,
                 call_timeout_s: float,
                 open_channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel) -> None:
        self.frontend_id = frontend_id
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
        if conn is None:
            channel = self._open_channel(entry.address)
            conn = NodeConnection(entry, channel, cluster_pb2_grpc.NodeStub(channel))
            self.connections[entry.node_id] = conn
        if conn.lane_task is None:
            conn.lane_ready = asyncio.get_running_loop().create_future()
            conn.lane_task = asyncio.create_task(self._read_lane(conn))
        await asyncio.wait_for(asyncio.shield(conn.lane_ready), timeout=self.connect_timeout_s)
        return conn

    async def _read_lane(self, conn: NodeConnection) -> None:
        reason = "result lane closed"
        try:
            stream = conn.stub.Results(cluster_pb2.ResultsRequest(frontend_id=self.frontend_id))
            async for results in stream:
                if not conn.lane_ready.done():
                    conn.lane_ready.set_result(None)
                    continue
                sinks = self.sinks
                for event in results.events:
                    sink = sinks.get(event.request_id)
                    if sink is not None:
                        sink.put(event)
        except grpc.aio.AioRpcError as exc:
            reason = f"node {conn.entry.node_id} at {conn.entry.address} was lost ({exc.code().name})"
        except asyncio.CancelledError:
            reason = "frontend is shutting down"
        if not conn.lane_ready.done():
            conn.lane_ready.set_exception(ConnectionError(reason))
        self._fail_requests(conn, reason)
        conn.lane_task = None

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
        self._fail_requests(conn, reason)
        self._tasks.spawn(conn.channel.close())

    def open_sink(self, request_id: str) -> RequestSink:
        sink = self.sinks[request_id] = RequestSink()
        return sink

    def close_sink(self, request_id: str, node_id: str) -> None:
        self.sinks.pop(request_id, None)
        conn = self.connections.get(node_id)
        if conn is not None:
            conn.requests.discard(request_id)

    async def submit(self, conn: NodeConnection, engine_request: cluster_pb2.EngineRequest,
                     trace: tuple[tuple[str, str], ...] = ()) -> None:
        conn.requests.add(engine_request.request_id)
        await conn.stub.Submit(cluster_pb2.SubmitRequest(request=engine_request), timeout=self.call_timeout_s,
                               metadata=trace)

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
            await conn.channel.close()
