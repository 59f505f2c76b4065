"""Fakes of the frontend's internal gRPC stubs (coordinator and node), for unit tests of one frontend module."""

from __future__ import annotations

import asyncio

import grpc

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.frontend.coordinator_client import CoordinatorClient
from openengine_serve.frontend.nodes import NodeConnection, NodeConnections

READY = cluster_pb2.NODE_STATE_READY


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def node_entry(node_id: str, rank: int = 0, state: int = READY) -> cluster_pb2.NodeEntry:
    return cluster_pb2.NodeEntry(node_id=node_id, address=f"{node_id}.test:1", rank=rank, state=state)


class FakeCoordinatorStub:
    """Reserve answers `node` (or raises `reserve_error`); Release calls are recorded."""

    def __init__(self, node: cluster_pb2.NodeEntry | None = None) -> None:
        self.node = node
        self.reserve_error: grpc.aio.AioRpcError | None = None
        self.reserve_gate: asyncio.Event | None = None  # when set, Reserve waits for it
        self.reserved: list[cluster_pb2.ReserveRequest] = []
        self.released: list[str] = []
        self.aborts: list[cluster_pb2.ClusterAbortRequest] = []
        self.aborted = 0  # what Abort answers it aborted
        self.load = cluster_pb2.ClusterLoad()  # what GetClusterLoad answers
        self.unreachable: grpc.aio.AioRpcError | None = None  # when set, Abort and GetClusterLoad raise it
        self.table: list[cluster_pb2.NodeEntry] = []  # what RegisterFrontend answers
        self.registrations = 0
        # FrontendHeartbeats: each heartbeat is answered with the next of these (a reply, or an error that
        # breaks the stream); none left: it waits for no answer.
        self.heartbeat_replies: list = []
        self.heartbeats: list[cluster_pb2.FrontendHeartbeatRequest] = []
        self.heartbeat_streams = 0

    async def RegisterFrontend(self, request, timeout):
        self.registrations += 1
        return cluster_pb2.RegisterReply(heartbeat_interval_s=1.0, nodes=self.table)

    def FrontendHeartbeats(self) -> FakeHeartbeatCall:
        self.heartbeat_streams += 1
        return FakeHeartbeatCall(self)

    async def Reserve(self, request, timeout, metadata=()):
        self.reserved.append(request)
        if self.reserve_gate is not None:
            await self.reserve_gate.wait()
        if self.reserve_error is not None:
            raise self.reserve_error
        return cluster_pb2.ReserveReply(node=self.node)

    async def Release(self, request, timeout):
        self.released.append(request.request_id)
        return cluster_pb2.ReleaseReply()

    async def Abort(self, request, timeout):
        if self.unreachable is not None:
            raise self.unreachable
        self.aborts.append(request)
        return cluster_pb2.ClusterAbortReply(outcome=cluster_pb2.ABORT_OUTCOME_ABORTED, aborted=self.aborted)

    async def GetClusterLoad(self, request, timeout):
        if self.unreachable is not None:
            raise self.unreachable
        return self.load

    def Reservations(self) -> FakeReservationCall:
        """The batched path, answering each reservation as Reserve would: `reserve_error` UNAVAILABLE or
        DEADLINE_EXCEEDED breaks the stream (as a coordinator that cannot be reached does), another code is a
        refusal in the outcome."""
        return FakeReservationCall(self)


class QueuedReplies:
    """The reading side of a fake stream-stream call: `read` returns (or raises) what was queued."""

    def __init__(self) -> None:
        self.replies: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.ended_with: grpc.StatusCode | None = None  # set: the call is done, with this status

    async def read(self):
        item = await self.replies.get()
        if isinstance(item, Exception):
            raise item
        return item

    def done(self) -> bool:
        return self.ended_with is not None

    async def code(self) -> grpc.StatusCode | None:
        return self.ended_with

    async def details(self) -> str:
        return ""

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeStubCall(QueuedReplies):
    """A stream-stream call over a fake stub: a write after `cancel` fails as grpc.aio's does."""

    def __init__(self, stub) -> None:
        super().__init__()
        self.stub = stub

    def check_open(self) -> None:
        if self.cancelled:
            raise rpc_error(grpc.StatusCode.CANCELLED, "call cancelled")


class FakeHeartbeatCall(FakeStubCall):
    """A FrontendHeartbeats stream-stream call over a FakeCoordinatorStub."""

    async def write(self, heartbeat: cluster_pb2.FrontendHeartbeatRequest) -> None:
        self.check_open()
        self.stub.heartbeats.append(heartbeat)
        if self.stub.heartbeat_replies:
            self.replies.put_nowait(self.stub.heartbeat_replies.pop(0))


class FakeReservationCall(FakeStubCall):
    """A Reservations stream-stream call over a FakeCoordinatorStub."""

    async def write(self, batch: cluster_pb2.ReservationBatch) -> None:
        self.check_open()
        self.stub.released.extend(batch.release)
        reply = cluster_pb2.ReservationReplies()
        for request in batch.reserve:
            unary = cluster_pb2.ReserveRequest()
            unary.CopyFrom(request)
            unary.frontend_id = batch.frontend_id
            try:
                node = (await self.stub.Reserve(unary, timeout=None)).node
                reply.outcome.add(node=node)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.replies.put_nowait(exc)
                    return
                reply.outcome.add(refusal_code=exc.code().value[0], refusal=exc.details())
        self.replies.put_nowait(reply)


class FakeNodeStub:
    """Submissions records each EngineRequest (or refuses it with `submit_error`); Cancel calls are recorded; Lane
    plays `lane_messages` (StepResults from `lane` after the opening message; an exception put there is raised)
    and records the LaneCredits written."""

    def __init__(self) -> None:
        self.submit_error: grpc.aio.AioRpcError | None = None
        self.submitted: list[cluster_pb2.EngineRequest] = []
        self.cancelled: list[tuple[str, int | None]] = []
        self.lane: asyncio.Queue = asyncio.Queue()
        self.credits: list[cluster_pb2.LaneCredit] = []

    def Lane(self) -> FakeLaneCall:
        return FakeLaneCall(self)

    def take(self, request: cluster_pb2.SubmitRequest) -> None:
        """One submission: recorded, or refused with `submit_error`."""
        if self.submit_error is not None:
            raise self.submit_error
        self.submitted.append(request.request)

    def Submissions(self) -> FakeSubmissionCall:
        """Each submission taken (`take`), `submit_error` as a refusal outcome."""
        return FakeSubmissionCall(self)

    async def Cancel(self, request, timeout):
        self.cancelled.append((request.request_id, request.output_index if request.HasField("output_index") else None))
        return cluster_pb2.CancelReply(found=True)

    def lane_messages(self, frontend_id: str):
        """What the Lane call of `frontend_id` sends."""

        async def stream():
            yield cluster_pb2.StepResults()  # the lane is open
            while True:
                item = await self.lane.get()
                if isinstance(item, Exception):
                    raise item
                yield item

        return stream()


class FakeLaneCall:
    """A Lane stream-stream call over a FakeNodeStub: the first LaneCredit opens its lane_messages."""

    def __init__(self, stub: FakeNodeStub) -> None:
        self.stub = stub
        self.messages = None
        self.cancelled = False

    async def write(self, credit: cluster_pb2.LaneCredit) -> None:
        self.stub.credits.append(credit)
        if self.messages is None:
            self.messages = self.stub.lane_messages(credit.frontend_id)

    async def read(self):
        try:
            return await anext(self.messages)
        except StopAsyncIteration:
            return grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeSubmissionCall(FakeStubCall):
    """A Submissions stream-stream call over a FakeNodeStub."""

    async def write(self, batch: cluster_pb2.SubmitBatch) -> None:
        self.check_open()
        reply = cluster_pb2.SubmitOutcomes()
        for request in batch.submit:
            try:
                self.stub.take(request)
                reply.outcome.add()
            except grpc.aio.AioRpcError as exc:
                reply.outcome.add(refusal_code=exc.code().value[0], refusal=exc.details())
        self.replies.put_nowait(reply)


class FakeChannel:
    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def coordinator_client(
    stub: FakeCoordinatorStub,
    nodes: NodeConnections,
    live_requests=lambda: 0,
    more_shards: dict[str, FakeCoordinatorStub] | None = None,
) -> CoordinatorClient:
    """A client of the coordinator `stub` ("coordinator.test:1"), and of `more_shards` (address -> stub)."""
    shards = {"coordinator.test:1": stub, **(more_shards or {})}
    client = CoordinatorClient(
        "fe-test",
        list(shards),
        "fe.test:1",
        heartbeat_s=1.0,
        call_timeout_s=1.0,
        live_requests=live_requests,
        on_node_table=nodes.keep_only,
    )
    for shard in client.shards:
        shard.stub = shards[shard.address]
    return client


def add_fake_node(nodes: NodeConnections, entry: cluster_pb2.NodeEntry) -> tuple[NodeConnection, FakeNodeStub]:
    """A connection whose stub is a fake; NodeConnections.connect opens its lane as for a real one."""
    stub = FakeNodeStub()
    conn = nodes.connections[entry.node_id] = NodeConnection(entry, FakeChannel(), stub)
    return conn, stub


async def settle() -> None:
    """Lets background tasks (release, cancel, lane reader) run."""
    for _ in range(5):
        await asyncio.sleep(0)
