"""The frontend's batched Reserve/Release: one stream to the coordinator, one message per event-loop tick.

Every reservation and release asked for during one tick of the event loop goes
out as one `ReservationBatch` on the frontend's `Reservations` stream; the
coordinator answers each batch with one `ReservationReplies` (one outcome per
reservation, in order), so the replies are matched to batches by position.
While a batch is unanswered, the next ticks' requests gather and go out
together once it is answered: under load the batches grow instead of the messages.

Releases need no answer: they ride on the next batch, and they are kept until
the batch that carried them is answered. When the stream breaks, every
reservation not yet answered fails with `StreamBroken` (the caller routes on its
own, as when the coordinator cannot be reached) and the unanswered releases are
sent again on the next stream (a release of an unknown id is a no-op there).
Requests already accepted are not affected: their reservations stay on the
coordinator until released. The next reservation or `flush` opens a new stream.
The batching itself is `batched_stream.BatchedStream`'s.
"""

from __future__ import annotations

from collections.abc import Callable

from ..api.openengine_internal.v1 import cluster_pb2
from .batched_stream import MAX_BATCH, MAX_UNANSWERED, BatchCall, BatchedStream, Refused, StreamBroken

__all__ = ["MAX_BATCH", "ReservationBatcher", "ReservationCall", "ReservationRefused", "StreamBroken"]

ReservationCall = BatchCall  # a grpc.aio stream-stream call of Reservations


class ReservationRefused(Refused):
    """The coordinator refused the reservation; `code` is the gRPC status code the unary Reserve would use."""


# Releases kept while the coordinator cannot be reached; beyond this the oldest are dropped.
MAX_KEPT_RELEASES = 100_000


class ReservationBatcher(BatchedStream):
    """Coalesces reservations and releases per tick onto one stream (see the module docstring)."""

    kind = "reservation"
    calls_name = "reservations"
    riders_name = "releases"
    refusal = ReservationRefused
    # A coordinator that restarted no longer knows the dropped ones; one that did not keeps those reservations
    # until this frontend expires.
    max_kept_riders = MAX_KEPT_RELEASES

    def __init__(
        self,
        frontend_id: str,
        open_call: Callable[[], ReservationCall],
        max_batch: int = MAX_BATCH,
        max_unanswered: int = MAX_UNANSWERED,
    ) -> None:
        super().__init__(open_call, max_batch, max_unanswered)
        self.frontend_id = frontend_id

    async def reserve(
        self, request: cluster_pb2.ReserveRequest, timeout_s: float | None = None
    ) -> cluster_pb2.NodeEntry:
        """The node the coordinator picked; raises ReservationRefused, StreamBroken, or TimeoutError after
        `timeout_s`.

        `request.frontend_id` is not sent: the batch names the frontend once.
        """
        return await self._call_batched(request, timeout_s)

    def release(self, request_id: str) -> None:
        self._ride(request_id)

    @property
    def pending_releases(self) -> int:
        return self._pending_riders

    def _batch(self, requests: list[cluster_pb2.ReserveRequest], riders: list[str]) -> cluster_pb2.ReservationBatch:
        for request in requests:
            request.frontend_id = ""  # named once by the batch
        return cluster_pb2.ReservationBatch(frontend_id=self.frontend_id, release=riders, reserve=requests)

    def _outcomes(self, reply: cluster_pb2.ReservationReplies):
        return reply.outcome

    def _result(self, outcome: cluster_pb2.ReservationOutcome) -> cluster_pb2.NodeEntry:
        return outcome.node
