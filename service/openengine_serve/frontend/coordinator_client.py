"""The frontend's control plane: registration and heartbeats, the node table, and the coordinator's calls.

When the coordinator cannot be reached the frontend keeps serving from its last
known node table (health reports DEGRADED); `reserve` then raises
`CoordinatorUnreachable` and the caller routes on its own.

Reserve and Release go over the batched `Reservations` stream
(`reservation_stream.py`), heartbeats over the `FrontendHeartbeats` stream
(`common/heartbeat_stream.py`); the other calls are unary. With several coordinators
(a comma-separated OPENENGINE_COORDINATOR_ADDRESS) each request id belongs to
one of them: its Reserve, Release and Abort go there; registration, heartbeats,
Abort(all_requests) and GetClusterLoad go to all (docs/coordinator.md).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence

import grpc

from ..api.openengine.v1 import lora_pb2
from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from ..common.heartbeat_stream import HeartbeatStream, PeerHeartbeats
from ..common.logging_setup import log_event
from ..common.routing import owning_coordinator
from .refusal import DuplicateRequest, NotServed, Overloaded, Refusal, Unavailable
from .reservation_stream import ReservationBatcher, ReservationRefused, StreamBroken
from .validation import shown

logger = logging.getLogger("openengine_serve.frontend")

READY = cluster_pb2.NODE_STATE_READY
SET_LORA_TIMEOUT_S = 90.0  # the coordinator loads the adapter on every node first
UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# The coordinator's refusals of a Reserve (coordinator/server.py REFUSAL_CODES), back to their kind.
RESERVE_REFUSALS: dict[grpc.StatusCode, type[Refusal]] = {
    grpc.StatusCode.ALREADY_EXISTS: DuplicateRequest,
    grpc.StatusCode.NOT_FOUND: NotServed,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
}


class CoordinatorUnreachable(Exception):
    """A Reserve found no coordinator (UNAVAILABLE or deadline): route from the last known node table."""


class AbortIncomplete(Exception):
    """Abort(all_requests) reached some of the coordinators only: `aborted` counts what those stopped."""

    def __init__(self, aborted: int, unreachable: list[tuple[str, grpc.StatusCode]]) -> None:
        super().__init__(
            f"aborted {aborted} request(s) on the reachable coordinators; "
            + ", ".join(f"{address} unreachable ({code.name})" for address, code in unreachable)
        )
        self.aborted = aborted
        self.unreachable = unreachable


class CoordinatorShard:
    """One coordinator of the deployment as this frontend sees it: its channel, its reservation stream, whether
    it answers, and the node table it last sent."""

    def __init__(
        self, frontend_id: str, address: str, open_channel: Callable[[str], grpc.aio.Channel], call_timeout_s: float
    ) -> None:
        self.address = address
        self.reachable = False
        self.nodes: dict[str, cluster_pb2.NodeEntry] = {}
        self.loras: list[lora_pb2.LoraAdapter] = []  # the deployment's LoRA adapters it last listed
        self.lora_models: dict[str, frozenset[str]] = {}  # and the models each serves
        self.channel = open_channel(address)
        self.stub = cluster_pb2_grpc.CoordinatorStub(self.channel)
        # The stub is looked up at each stream opening (unit tests replace it).
        self.reservations = ReservationBatcher(frontend_id, lambda: self.stub.Reservations())
        self.heartbeats = HeartbeatStream(lambda: self.stub.FrontendHeartbeats(), call_timeout_s)

    async def close(self) -> None:
        self.heartbeats.close()
        await self.reservations.close()
        await self.channel.close()


class CoordinatorClient:
    """The deployment's coordinators: usually one; with several, each request id belongs to one of them
    (`common/routing.py : owning_coordinator`), and this frontend registers and heartbeats with all of them."""

    def __init__(
        self,
        frontend_id: str,
        addresses: Sequence[str],
        advertised_address: str,
        heartbeat_s: float,
        call_timeout_s: float,
        live_requests: Callable[[], int],
        on_node_table: Callable[[dict[str, cluster_pb2.NodeEntry]], None],
        open_channel: Callable[[str], grpc.aio.Channel] = grpc.aio.insecure_channel,
    ) -> None:
        if not addresses:
            raise ValueError("at least one coordinator address is needed")
        self.frontend_id = frontend_id
        self.incarnation = uuid.uuid4().hex  # tells a coordinator this process from a restarted one of the same id
        self.addresses = tuple(addresses)
        self.address = ",".join(self.addresses)
        self.advertised_address = advertised_address
        self.heartbeat_s = heartbeat_s
        self.call_timeout_s = call_timeout_s
        self.nodes: dict[str, cluster_pb2.NodeEntry] = {}  # the last known table
        self.loras: dict[str, lora_pb2.LoraAdapter] = {}  # the LoRA adapters served, by name, as last listed
        self.lora_models: dict[str, frozenset[str]] = {}  # the models each serves (absent: any)
        self.table_updated = asyncio.Event()  # set at each node table a coordinator sends (readiness follows it)
        self.shards = [
            CoordinatorShard(frontend_id, address, open_channel, call_timeout_s) for address in self.addresses
        ]
        self._shard_by_address = {shard.address: shard for shard in self.shards}
        self._live_requests = live_requests
        self._on_node_table = on_node_table

    @property
    def reachable(self) -> bool:
        return all(shard.reachable for shard in self.shards)

    def unreachable_addresses(self) -> list[str]:
        return [shard.address for shard in self.shards if not shard.reachable]

    def shard_for(self, request_id: str) -> CoordinatorShard:
        """The coordinator that owns the id: its duplicate check, its Abort, its Release."""
        return self._shard_by_address[owning_coordinator(request_id, self.addresses)]

    def ready_nodes(self) -> list[cluster_pb2.NodeEntry]:
        return [n for n in self.nodes.values() if n.state == READY]

    async def heartbeat_loop(self) -> None:
        await asyncio.gather(*(self._heartbeat_loop(shard) for shard in self.shards))

    async def _heartbeat_loop(self, shard: CoordinatorShard) -> None:
        """Registers with one coordinator, then heartbeats on its stream (`common/heartbeat_stream.py :
        PeerHeartbeats`); each reply brings its node table up to date, a failure marks it unreachable."""
        await PeerHeartbeats(
            shard.heartbeats,
            self.heartbeat_s,
            register=lambda: self._register(shard),
            # live_requests is this frontend's total on every coordinator (a gauge to read per coordinator).
            heartbeat=lambda: cluster_pb2.FrontendHeartbeatRequest(
                frontend_id=self.frontend_id, live_requests=self._live_requests()
            ),
            on_reply=lambda heartbeat, reply: self._heartbeat_answered(shard, reply),
            on_register_failed=lambda exc: self._set_reachable(shard, False, exc),
            on_heartbeat_failed=lambda exc: self._set_reachable(shard, False, detail=str(exc)),
            register_at_once_when_forgotten=False,
            register_after_failed_heartbeat=True,
        ).run()

    async def _register(self, shard: CoordinatorShard) -> None:
        reply = await shard.stub.RegisterFrontend(
            cluster_pb2.RegisterFrontendRequest(
                frontend_id=self.frontend_id, address=self.advertised_address, incarnation=self.incarnation
            ),
            timeout=self.call_timeout_s,
        )
        self._set_reachable(shard, True)
        self._set_nodes(shard, reply.nodes)
        log_event(logger, "registered with coordinator", frontend_id=self.frontend_id, coordinator=shard.address)

    def _heartbeat_answered(self, shard: CoordinatorShard, reply: cluster_pb2.HeartbeatReply) -> None:
        self._set_reachable(shard, True)
        self._set_nodes(shard, reply.nodes, merge=not reply.full_table)
        self._set_loras(shard, reply.loras, reply.lora_models)
        shard.reservations.flush()  # releases kept since a broken stream, when no request came since

    def _set_reachable(
        self, shard: CoordinatorShard, reachable: bool, exc: grpc.aio.AioRpcError | None = None, detail: str = ""
    ) -> None:
        if reachable != shard.reachable:
            log_event(
                logger,
                "coordinator reachable" if reachable else "coordinator unreachable",
                logging.INFO if reachable else logging.WARNING,
                coordinator=shard.address,
                **({"code": exc.code().name} if exc else {"detail": detail} if detail else {}),
            )
        shard.reachable = reachable

    def _set_nodes(self, shard: CoordinatorShard, entries, merge: bool = False) -> None:
        """The coordinator's table (`merge`: the entries that changed since its previous one) as this shard's."""
        if merge:
            shard.nodes.update((n.node_id, n) for n in entries)
        else:
            shard.nodes = {n.node_id: n for n in entries}
        if len(self.shards) == 1:
            self.nodes = shard.nodes
        else:
            # Every coordinator has every node (nodes register with all): the tables of those that answer (of all,
            # as last known, when none does); for a node in several, the first listed coordinator's entry.
            self.nodes = {}
            for other in reversed([s for s in self.shards if s.reachable] or self.shards):
                self.nodes.update(other.nodes)
        self._on_node_table(self.nodes)
        self.table_updated.set()

    def _set_loras(self, shard: CoordinatorShard, adapters, lora_models) -> None:
        shard.loras = list(adapters)
        shard.lora_models = {entry.lora_name: frozenset(entry.models) for entry in lora_models}
        self._merge_loras()

    def _merge_loras(self) -> None:
        # With several coordinators, an adapter listed by any (a coordinator that restarted lists none until the
        # next LoadLora); for a name listed by several, the first listed coordinator's entry.
        self.loras = {a.lora_name: a for other in reversed(self.shards) for a in other.loras}
        self.lora_models = {}
        for other in self.shards:
            for name, models in other.lora_models.items():
                self.lora_models[name] = self.lora_models.get(name, frozenset()) | models

    def lora_for(self, name: str, model: str) -> lora_pb2.LoraAdapter:
        """The adapter a request names, for its model. Raises NotServed naming what is loaded."""
        adapter = self.loras.get(name)
        if adapter is None:
            listed = ", ".join(repr(n) for n in sorted(self.loras)) or "none"
            raise NotServed(f"no LoRA adapter named {shown(name)} is loaded (loaded: {listed})")
        models = self.lora_models.get(name)
        if models is not None and model not in models:
            raise NotServed(
                f"the LoRA adapter {shown(name)} serves the model(s) {', '.join(sorted(models))}, not {shown(model)}"
            )
        return adapter

    async def set_lora(self, command: cluster_pb2.LoraCommand) -> cluster_pb2.LoraOutcome:
        """LoadLora or UnloadLora on every coordinator; the first one's outcome. Raises the first gRPC error."""
        replies = await self._each_shard(lambda stub: stub.SetLora(command, timeout=SET_LORA_TIMEOUT_S))
        for reply in replies:
            if isinstance(reply, grpc.aio.AioRpcError):
                raise reply
        outcome = replies[0]
        # This frontend's list follows at once (the other frontends' at their next heartbeat).
        name = command.adapter.lora_name
        for shard, reply in zip(self.shards, replies, strict=True):
            shard.loras = [a for a in shard.loras if a.lora_name != name] + ([] if command.unload else [reply.adapter])
            shard.lora_models.pop(name, None)
            if not command.unload and reply.models:
                shard.lora_models[name] = frozenset(reply.models)
        self._merge_loras()
        return outcome

    async def reserve(
        self,
        request_id: str,
        routing_key: str,
        target_rank: int | None,
        prompt_tokens: int,
        num_sequences: int,
        trace: tuple[tuple[str, str], ...] = (),
        owner: str = "",
        prefix_key: str = "",
        block_hashes: Sequence[bytes] = (),
        model: str = "",
    ) -> cluster_pb2.NodeEntry:
        """The node the id's coordinator picked; raises a Refusal, or CoordinatorUnreachable. `owner`: the API
        key name that starts the request, so that only it (or an admin) can abort it. `prefix_key`: its prompt's
        prefix (requests.prefix_key), which the coordinator prefers to send where that prefix went; `block_hashes`:
        its first KV blocks (requests.prefix_blocks), which it prefers to send where they are cached; `model`: the
        card name of the nodes that may take it ("" any).

        Batched with the other reservations of this event-loop tick; the deadline is per reservation. `trace`
        (traceparent/tracestate pairs) rides in the reservation, since a batch has no per-request metadata.
        """
        request = cluster_pb2.ReserveRequest(
            request_id=request_id,
            routing_key=routing_key,
            prefix_key=prefix_key,
            block_hashes=block_hashes,
            prompt_tokens=prompt_tokens,
            num_sequences=num_sequences,
            owner=owner,
            model=model,
        )
        for key, value in trace:
            if key in ("traceparent", "tracestate"):
                setattr(request, key, value)
        if target_rank is not None:
            request.target_rank = target_rank
        shard = self.shard_for(request_id)
        try:
            node = await shard.reservations.reserve(request, self.call_timeout_s)
        except ReservationRefused as exc:
            self._set_reachable(shard, True)
            raise reserve_refusal(exc.code, exc.message) from None
        except (StreamBroken, TimeoutError) as exc:
            self._set_reachable(shard, False, detail=str(exc) or "reserve deadline exceeded")
            raise CoordinatorUnreachable(str(exc) or "DEADLINE_EXCEEDED") from None
        self._set_reachable(shard, True)
        return node

    def release(self, request_id: str) -> None:
        """Rides on the next batch to the id's coordinator (this tick's, or the next reservation's)."""
        self.shard_for(request_id).reservations.release(request_id)

    async def abort(self, request: cluster_pb2.ClusterAbortRequest) -> cluster_pb2.ClusterAbortReply:
        """One request: its coordinator's answer. All requests: every coordinator's, summed; raises the error
        when none answered, AbortIncomplete when some did."""
        if request.WhichOneof("target") != "all_requests":
            return await self.shard_for(request.request_id).stub.Abort(request, timeout=self.call_timeout_s)
        replies = await self._each_shard(lambda stub: stub.Abort(request, timeout=self.call_timeout_s))
        answered = [reply for reply in replies if not isinstance(reply, grpc.aio.AioRpcError)]
        if not answered:
            raise replies[0]
        aborted = sum(reply.aborted for reply in answered)
        if len(answered) < len(replies):
            raise AbortIncomplete(
                aborted,
                [
                    (shard.address, reply.code())
                    for shard, reply in zip(self.shards, replies)
                    if isinstance(reply, grpc.aio.AioRpcError)
                ],
            )
        return cluster_pb2.ClusterAbortReply(outcome=cluster_pb2.ABORT_OUTCOME_ABORTED, aborted=aborted)

    async def cluster_load(self) -> cluster_pb2.ClusterLoad:
        """The coordinators' view of load, or the last known node table when none can be reached. Nodes report
        their load to every coordinator: the node entries are the first answering coordinator's; the live
        reservations are the sum over coordinators (each counts the ids it owns)."""
        replies = await self._each_shard(
            lambda stub: stub.GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=self.call_timeout_s)
        )
        answered = [reply for reply in replies if not isinstance(reply, grpc.aio.AioRpcError)]
        if not answered:
            return cluster_pb2.ClusterLoad(nodes=list(self.nodes.values()))
        return cluster_pb2.ClusterLoad(
            nodes=answered[0].nodes, live_reservations=sum(reply.live_reservations for reply in answered)
        )

    async def _each_shard(self, call) -> list:
        """`call(stub)` on every coordinator at once; a coordinator's gRPC error is its entry in the list."""
        replies = await asyncio.gather(*(call(shard.stub) for shard in self.shards), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, grpc.aio.AioRpcError):
                raise reply
        return replies

    async def close(self) -> None:
        for shard in self.shards:
            await shard.close()


def reserve_refusal(code: grpc.StatusCode, message: str) -> Exception:
    """A refused reservation as the caller sees it: UNAVAILABLE (no node ready) counts as unreachable, as it
    always did for the unary Reserve (the caller routes from its own table); the others keep their kind."""
    if code in UNREACHABLE_CODES:
        return CoordinatorUnreachable(f"{code.name}: {message}")
    return RESERVE_REFUSALS.get(code, Unavailable)(message or code.name)
