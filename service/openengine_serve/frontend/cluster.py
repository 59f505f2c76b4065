"""The frontend's view of the deployment: coordinator control calls, node connections, result lanes.

Per-token traffic never touches the coordinator: a node streams one
StepResults message per engine step on this frontend's lane, and the lane
reader hands each event to the waiting request's queue. When the coordinator
cannot be reached the frontend keeps serving from its last known node table
(health reports DEGRADED).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import zlib
from collections import deque
from dataclasses import dataclass, field

import grpc

from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from ..common.logging_setup import log_event
from ..common.tls import internal_channel

logger = logging.getLogger("openengine_serve.frontend")

READY = cluster_pb2.NODE_STATE_READY
COORDINATOR_TIMEOUT_S = 2.0


class RoutingRefused(Exception):
    """The deployment refused the request before acceptance; carries the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


class Cluster:
    def __init__(self, frontend_id: str, coordinator_address: str, advertised_address: str,
                 heartbeat_s: float, stall_timeout_s: float, internal_tls=None) -> None:
        self.frontend_id = frontend_id
        self.stall_timeout_s = stall_timeout_s
        self.advertised_address = advertised_address
        self.heartbeat_s = heartbeat_s
        self.internal_tls = internal_tls  # a config with the internal_tls_* fields; None: plaintext
        self._coordinator_channel = self._channel(coordinator_address)
        self.coordinator = cluster_pb2_grpc.CoordinatorStub(self._coordinator_channel)
        self.coordinator_address = coordinator_address
        self.coordinator_reachable = False
        self.nodes: dict[str, cluster_pb2.NodeEntry] = {}   # last known table
        self.connections: dict[str, NodeConnection] = {}
        self.sinks: dict[str, RequestSink] = {}
        self._round_robin = itertools.count()
        self._background: set[asyncio.Task] = set()

    def _channel(self, address: str) -> grpc.aio.Channel:
        if self.internal_tls is None:
            return grpc.aio.insecure_channel(address)
        return internal_channel(address, self.internal_tls)

    # ---------------------------------------------------------------- control plane

    def ready_nodes(self) -> list[cluster_pb2.NodeEntry]:
        return [n for n in self.nodes.values() if n.state == READY]

    async def heartbeat_loop(self) -> None:
        registered = False
        while True:
            try:
                if not registered:
                    reply = await self.coordinator.RegisterFrontend(cluster_pb2.RegisterFrontendRequest(
                        frontend_id=self.frontend_id, address=self.advertised_address), timeout=COORDINATOR_TIMEOUT_S)
                    self._set_nodes(reply.nodes)
                    registered = True
                    log_event(logger, "registered with coordinator", frontend_id=self.frontend_id)
                reply = await self.coordinator.FrontendHeartbeat(cluster_pb2.FrontendHeartbeatRequest(
                    frontend_id=self.frontend_id, live_requests=len(self.sinks)), timeout=COORDINATOR_TIMEOUT_S)
                registered = reply.known
                self._set_nodes(reply.nodes)
                self._set_reachable(True)
            except grpc.aio.AioRpcError as exc:
                self._set_reachable(False, exc)
                registered = False
            await asyncio.sleep(self.heartbeat_s)

    def _set_reachable(self, reachable: bool, exc: grpc.aio.AioRpcError | None = None) -> None:
        if reachable != self.coordinator_reachable:
            log_event(logger, "coordinator reachable" if reachable else "coordinator unreachable",
                      logging.INFO if reachable else logging.WARNING, coordinator=self.coordinator_address,
                      **({"code": exc.code().name} if exc else {}))
        self.coordinator_reachable = reachable

    def _set_nodes(self, entries) -> None:
        self.nodes = {n.node_id: n for n in entries}
        for node_id in list(self.connections):
            if node_id not in self.nodes:
                self._drop_connection(node_id, "node left the deployment")

    async def reserve(self, request_id: str, routing_key: str, target_rank: int | None, prompt_tokens: int,
                      num_sequences: int, trace: tuple[tuple[str, str], ...] = (),
                      owner: str = "") -> cluster_pb2.NodeEntry:
        request = cluster_pb2.ReserveRequest(request_id=request_id, frontend_id=self.frontend_id,
                                             routing_key=routing_key, prompt_tokens=prompt_tokens,
                                             num_sequences=num_sequences, owner=owner)
        if target_rank is not None:
            request.target_rank = target_rank
        try:
            reply = await self.coordinator.Reserve(request, timeout=COORDINATOR_TIMEOUT_S, metadata=trace)
            self._set_reachable(True)
            return reply.node
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise RoutingRefused(exc.code(), exc.details()) from None
            self._set_reachable(False, exc)
        return self._choose_locally(request_id, routing_key, target_rank)

    def _choose_locally(self, request_id: str, routing_key: str, target_rank: int | None) -> cluster_pb2.NodeEntry:
        """Coordinator down: route from the last known node table; duplicates are caught on this frontend only."""
        if request_id in self.sinks:
            raise RoutingRefused(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
        ready = sorted(self.ready_nodes(), key=lambda n: n.rank)
        if target_rank is not None:
            ready = [n for n in ready if n.rank == target_rank]
            if not ready:
                raise RoutingRefused(grpc.StatusCode.NOT_FOUND,
                                     f"openengine-target-dp-rank {target_rank} names no ready node")
        if not ready:
            raise RoutingRefused(grpc.StatusCode.UNAVAILABLE,
                                 "no ready node is known and the coordinator is unreachable")
        if routing_key:
            return ready[zlib.crc32(routing_key.encode()) % len(ready)]
        in_flight = {n.node_id: len(c.requests) if (c := self.connections.get(n.node_id)) else 0 for n in ready}
        least = min(in_flight.values())
        candidates = [n for n in ready if in_flight[n.node_id] == least]
        return candidates[next(self._round_robin) % len(candidates)]

    def release(self, request_id: str) -> None:
        self.spawn(self.coordinator.Release(cluster_pb2.ReleaseRequest(
            request_id=request_id, frontend_id=self.frontend_id), timeout=COORDINATOR_TIMEOUT_S))

    async def abort(self, request: cluster_pb2.ClusterAbortRequest) -> cluster_pb2.ClusterAbortReply:
        return await self.coordinator.Abort(request, timeout=COORDINATOR_TIMEOUT_S)

    async def cluster_load(self) -> cluster_pb2.ClusterLoad:
        try:
            return await self.coordinator.GetClusterLoad(cluster_pb2.GetClusterLoadRequest(),
                                                         timeout=COORDINATOR_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return cluster_pb2.ClusterLoad(nodes=list(self.nodes.values()))

    # ---------------------------------------------------------------- data plane

    async def connect(self, entry: cluster_pb2.NodeEntry) -> NodeConnection:
        """The node's connection with its result lane open (opened on first use)."""
        conn = self.connections.get(entry.node_id)
        if conn is None:
            channel = self._channel(entry.address)
            conn = NodeConnection(entry, channel, cluster_pb2_grpc.NodeStub(channel))
            self.connections[entry.node_id] = conn
        if conn.lane_task is None:
            conn.lane_ready = asyncio.get_running_loop().create_future()
            conn.lane_task = asyncio.create_task(self._read_lane(conn))
        await asyncio.wait_for(asyncio.shield(conn.lane_ready), timeout=5.0)
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

    def _drop_connection(self, node_id: str, reason: str) -> None:
        conn = self.connections.pop(node_id)
        if conn.lane_task is not None:
            conn.lane_task.cancel()
        self._fail_requests(conn, reason)
        self.spawn(conn.channel.close())

    def open_sink(self, request_id: str) -> RequestSink:
        sink = self.sinks[request_id] = RequestSink()
        return sink

    def close_sink(self, request_id: str, conn: NodeConnection | None) -> None:
        self.sinks.pop(request_id, None)
        if conn is not None:
            conn.requests.discard(request_id)

    async def submit(self, conn: NodeConnection, engine_request: cluster_pb2.EngineRequest,
                     trace: tuple[tuple[str, str], ...] = ()) -> None:
        conn.requests.add(engine_request.request_id)
        await conn.stub.Submit(cluster_pb2.SubmitRequest(request=engine_request), timeout=5.0, metadata=trace)

    def cancel(self, conn: NodeConnection, request_id: str, output_index: int | None = None) -> None:
        request = cluster_pb2.CancelRequest(request_id=request_id)
        if output_index is not None:
            request.output_index = output_index
        self.spawn(conn.stub.Cancel(request, timeout=5.0))

    def fail_all(self, failure: LaneFailure) -> None:
        for sink in self.sinks.values():
            sink.fail(failure)

    async def stall_watchdog(self) -> None:
        """A request that hears nothing from its node for stall_timeout_s ends with a retryable error:
        no stream may hang, whatever went wrong below."""
        while True:
            await asyncio.sleep(min(1.0, self.stall_timeout_s / 4))
            silent_since = time.monotonic() - self.stall_timeout_s
            for request_id, sink in list(self.sinks.items()):
                if sink.last_event_at < silent_since:
                    log_event(logger, "request stalled", logging.WARNING, request_id=request_id,
                              silent_s=self.stall_timeout_s)
                    sink.fail(LaneFailure(f"no progress from the engine for {self.stall_timeout_s:g} s; "
                                          "retry the request", retryable=True))

    def spawn(self, coro) -> None:
        """Fire-and-forget an internal call; its failure is logged, never raised into a stream."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log_event(logger, "background call failed", logging.DEBUG, error=repr(task.exception()))

    async def close(self) -> None:
        for conn in self.connections.values():
            if conn.lane_task is not None:
                conn.lane_task.cancel()
            await conn.channel.close()
        await self._coordinator_channel.close()
