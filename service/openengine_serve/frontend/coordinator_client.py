"""The frontend's control plane: registration and heartbeats, the node table, and the coordinator's calls.

When the coordinator cannot be reached the frontend keeps serving from its last
known node table (health reports DEGRADED); `reserve` then raises
`CoordinatorUnreachable` and the caller routes on its own.

Reserve and Release go over the batched `Reservations` stream
(`reservation_stream.py`); the other calls are unary.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from ..common.logging_setup import log_event
from .refusal import DuplicateRequest, NotServed, Overloaded, Refusal, Unavailable
from .reservation_stream import ReservationBatcher, ReservationRefused, StreamBroken

logger = logging.getLogger("openengine_serve.frontend")

READY = cluster_pb2.NODE_STATE_READY
UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# The coordinator's refusals of a Reserve (coordinator/server.py REFUSAL_CODES), back to their kind.
RESERVE_REFUSALS: dict[grpc.StatusCode, type[Refusal]] = {
    grpc.StatusCode.ALREADY_EXISTS: DuplicateRequest,
    grpc.StatusCode.NOT_FOUND: NotServed,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
}


class CoordinatorUnreachable(Exception):
    """A Reserve found no coordinator (UNAVAILABLE or deadline): route from the last known node table."""


class CoordinatorClient:
    def __init__(self, frontend_id: str, address: str, advertised_address: str, heartbeat_s: float,
                 call_timeout_s: float, live_requests: Callable[[], int],
                 on_node_table: Callable[[dict[str, cluster_pb2.NodeEntry]], None],
                 open_channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel) -> None:
        self.frontend_id = frontend_id
        self.address = address
        self.advertised_address = advertised_address
        self.heartbeat_s = heartbeat_s
        self.call_timeout_s = call_timeout_s
        self.reachable = False
        self.nodes: dict[str, cluster_pb2.NodeEntry] = {}  # the last known table
        self.table_updated = asyncio.Event()  # set at each node table the coordinator sends (readiness follows it)
        self._channel = open_channel(address)
        self._stub = cluster_pb2_grpc.CoordinatorStub(self._channel)
        # The stub is looked up at each stream opening (unit tests replace it).
        self.reservations = ReservationBatcher(frontend_id, lambda: self._stub.Reservations())
        self._live_requests = live_requests
        self._on_node_table = on_node_table

    def ready_nodes(self) -> list[cluster_pb2.NodeEntry]:
        return [n for n in self.nodes.values() if n.state == READY]

    async def heartbeat_loop(self) -> None:
        registered = False
        while True:
            try:
                if not registered:
                    reply = await self._stub.RegisterFrontend(cluster_pb2.RegisterFrontendRequest(
                        frontend_id=self.frontend_id, address=self.advertised_address), timeout=self.call_timeout_s)
                    self._set_nodes(reply.nodes)
                    registered = True
                    log_event(logger, "registered with coordinator", frontend_id=self.frontend_id)
                reply = await self._stub.FrontendHeartbeat(cluster_pb2.FrontendHeartbeatRequest(
                    frontend_id=self.frontend_id, live_requests=self._live_requests()), timeout=self.call_timeout_s)
                registered = reply.known
                self._set_nodes(reply.nodes)
                self._set_reachable(True)
                self.reservations.flush()  # releases kept since a broken stream, when no request came since
            except grpc.aio.AioRpcError as exc:
                self._set_reachable(False, exc)
                registered = False
            await asyncio.sleep(self.heartbeat_s)

    def _set_reachable(self, reachable: bool, exc: grpc.aio.AioRpcError | None = None, detail: str = "") -> None:
        if reachable != self.reachable:
            log_event(logger, "coordinator reachable" if reachable else "coordinator unreachable",
                      logging.INFO if reachable else logging.WARNING, coordinator=self.address,
                      **({"code": exc.code().name} if exc else {"detail": detail} if detail else {}))
        self.reachable = reachable

    def _set_nodes(self, entries) -> None:
        self.nodes = {n.node_id: n for n in entries}
        self._on_node_table(self.nodes)
        self.table_updated.set()

    async def reserve(self, request_id: str, routing_key: str, target_rank: int | None, prompt_tokens: int,
                      num_sequences: int, trace: tuple[tuple[str, str], ...] = (),
                      owner: str = "") -> cluster_pb2.NodeEntry:
        """The node the coordinator picked; raises a Refusal, or CoordinatorUnreachable. `owner`: the API key
        name that starts the request, so that only it (or an admin) can abort it.

        Batched with the other reservations of this event-loop tick; the deadline is per reservation. `trace`
        (traceparent/tracestate pairs) rides in the reservation, since a batch has no per-request metadata.
        """
        request = cluster_pb2.ReserveRequest(request_id=request_id, routing_key=routing_key,
                                             prompt_tokens=prompt_tokens, num_sequences=num_sequences, owner=owner)
        for key, value in trace:
            if key in ("traceparent", "tracestate"):
                setattr(request, key, value)
        if target_rank is not None:
            request.target_rank = target_rank
        try:
            async with asyncio.timeout(self.call_timeout_s):  # no extra task per call, unlike wait_for
                node = await self.reservations.reserve(request)
        except ReservationRefused as exc:
            self._set_reachable(True)
            raise reserve_refusal(exc.code, exc.message) from None
        except (StreamBroken, TimeoutError) as exc:
            self._set_reachable(False, detail=str(exc) or "reserve deadline exceeded")
            raise CoordinatorUnreachable(str(exc) or "DEADLINE_EXCEEDED") from None
        self._set_reachable(True)
        return node

    def release(self, request_id: str) -> None:
        """Rides on the next batch (this tick's, or the next reservation's)."""
        self.reservations.release(request_id)

    async def abort(self, request: cluster_pb2.ClusterAbortRequest) -> cluster_pb2.ClusterAbortReply:
        return await self._stub.Abort(request, timeout=self.call_timeout_s)

    async def cluster_load(self) -> cluster_pb2.ClusterLoad:
        """The coordinator's view of load, or the last known node table when it cannot be reached."""
        try:
            return await self._stub.GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError:
            return cluster_pb2.ClusterLoad(nodes=list(self.nodes.values()))

    async def close(self) -> None:
        await self.reservations.close()
        await self._channel.close()


def reserve_refusal(code: grpc.StatusCode, message: str) -> Exception:
    """A refused reservation as the caller sees it: UNAVAILABLE (no node ready) counts as unreachable, as it
    always did for the unary Reserve (the caller routes from its own table); the others keep their kind."""
    if code in UNREACHABLE_CODES:
        return CoordinatorUnreachable(f"{code.name}: {message}")
    return RESERVE_REFUSALS.get(code, Unavailable)(message or code.name)
