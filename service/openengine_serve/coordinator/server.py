"""The coordinator: soft-state control plane (grpc.aio only), never on the per-token path.

Nodes and frontends register and heartbeat; it picks a node per request and
owns request ids deployment-wide; Abort from any frontend reaches the node
that runs the request. Everything it knows is rebuilt from re-registration
after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from ..common import tracing
from ..common.config import CoordinatorConfig
from ..common.grpc_server import STATUS_BY_NUMBER, create_internal_server
from ..common.health_service import Health
from ..common.lifecycle import bind_address, freeze_startup_objects, start_metrics
from ..common.logging_setup import log_event
from ..common.peer_identity import FRONTEND, NODE, InstanceCheck, role_checks
from ..common.tls import add_internal_port, internal_channel
from ..common.tracing import RESERVE_SPAN
from . import metrics
from .kv_follow import KvFollower
from .loras import LoraTable
from .state import REFUSAL_STATUS, ClusterState, ModelMismatch, RankConflict, TableCursor

logger = logging.getLogger("openengine_serve.coordinator")

REFUSAL_CODES = {kind: STATUS_BY_NUMBER[number] for kind, number in REFUSAL_STATUS.items()}
LORA_LOAD_TIMEOUT_S = 60.0  # a node reads the adapter file in its engine's step loop
# A node's heartbeat replies carry nothing else: shared, never mutated.
_KNOWN = cluster_pb2.HeartbeatReply(known=True)
_UNKNOWN = cluster_pb2.HeartbeatReply(known=False)


class CoordinatorService(cluster_pb2_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.state = ClusterState(
            node_expiry_s=config.node_expiry_s,
            frontend_expiry_s=config.node_expiry_s,
            prefix_routing=config.prefix_routing,
        )
        self.node_channels: dict[str, grpc.aio.Channel] = {}
        self.loras = LoraTable()
        self.heartbeat_streams = {"node": 0, "frontend": 0}  # open now, by peer kind (a metric)

    async def RegisterNode(self, request, context) -> cluster_pb2.RegisterReply:
        await InstanceCheck(context, NODE, "RegisterNode").require(context, request.node.node_id)
        try:
            entry = self.state.register_node(request.node, None if request.auto_rank else request.node.rank)
        except (RankConflict, ModelMismatch) as exc:
            await context.abort(REFUSAL_CODES[type(exc)], str(exc))
        log_event(logger, "node registered", node_id=entry.node_id, address=entry.address, rank=entry.rank)
        return cluster_pb2.RegisterReply(
            heartbeat_interval_s=self.config.heartbeat_s, nodes=self.state.node_entries(), assigned_rank=entry.rank
        )

    async def NodeHeartbeats(self, request_iterator, context):
        """One node's heartbeats: one reply each, in order, except for those marked reply_optional (the node
        reads no reply for them): none when the node is known, else the stream ends, which the node's next
        heartbeat sees (it opens a new stream and asks). The stream ending (node stopped, connection lost,
        coordinator restarting) changes nothing: the node is marked DOWN only once it stayed silent for the
        expiry time (`housekeeping`), as when its heartbeats simply stop."""
        caller = InstanceCheck(context, NODE, "NodeHeartbeats")
        with self._open_stream("node"):
            async for heartbeat in request_iterator:
                await caller.require(context, heartbeat.node_id)
                known = self.state.node_heartbeat(
                    heartbeat.node_id, heartbeat.state, heartbeat.load if heartbeat.HasField("load") else None
                )
                if not heartbeat.reply_optional:
                    yield _KNOWN if known else _UNKNOWN
                elif not known:
                    return

    async def RegisterFrontend(self, request, context) -> cluster_pb2.RegisterReply:
        await InstanceCheck(context, FRONTEND, "RegisterFrontend").require(context, request.frontend_id)
        self.state.register_frontend(request.frontend_id, request.address, request.incarnation)
        log_event(logger, "frontend registered", frontend_id=request.frontend_id, address=request.address)
        return cluster_pb2.RegisterReply(heartbeat_interval_s=self.config.heartbeat_s, nodes=self.state.node_entries())

    async def FrontendHeartbeats(self, request_iterator, context):
        """One frontend's heartbeats, as NodeHeartbeats; each reply brings the frontend's node table up to date:
        the whole table first, then the entries that changed since the previous reply on this stream (load
        figures alone at most every FRONTEND_LOAD_REFRESH_S)."""
        cursor = TableCursor()  # how far this stream's replies brought the frontend's copy of the table
        caller = InstanceCheck(context, FRONTEND, "FrontendHeartbeats")
        with self._open_stream("frontend"):
            async for heartbeat in request_iterator:
                await caller.require(context, heartbeat.frontend_id)
                known = self.state.frontend_heartbeat(heartbeat.frontend_id, heartbeat.live_requests)
                full, nodes = self.state.node_table_since(cursor)
                yield cluster_pb2.HeartbeatReply(
                    known=known,
                    nodes=nodes,
                    full_table=full,
                    loras=self.loras.adapters.values(),
                    lora_models=self.loras.served_models(),
                )

    @contextlib.contextmanager
    def _open_stream(self, peer: str):
        self.heartbeat_streams[peer] += 1
        try:
            yield
        finally:
            self.heartbeat_streams[peer] -= 1

    async def Reserve(self, request, context) -> cluster_pb2.ReserveReply:
        await InstanceCheck(context, FRONTEND, "Reserve").require(context, request.frontend_id)
        with tracing.server_span(RESERVE_SPAN, context, **{"openengine.request_id": request.request_id}) as span:
            try:
                node = self.state.reserve(request)
            except tuple(REFUSAL_CODES) as exc:
                await context.abort(REFUSAL_CODES[type(exc)], str(exc))
            if span is not None:
                span.set_attribute("openengine.node_id", node.node_id)
            return cluster_pb2.ReserveReply(node=node)

    async def Release(self, request, context) -> cluster_pb2.ReleaseReply:
        await InstanceCheck(context, FRONTEND, "Release").require(context, request.frontend_id)
        self.state.release(request.request_id, request.frontend_id)
        return cluster_pb2.ReleaseReply()

    async def Reservations(self, request_iterator, context):
        """The batched Reserve/Release of one frontend: one answer per batch, same rules as the unary calls.

        A stream that ends (frontend gone, connection lost) changes nothing here:
        its accepted reservations stay until released or until the frontend expires.
        """
        caller = InstanceCheck(context, FRONTEND, "Reservations")
        async for batch in request_iterator:
            await caller.require(context, batch.frontend_id)
            if not tracing.enabled():
                yield cluster_pb2.ReservationReplies(outcome=self.state.apply_batch(batch))
                continue
            self.state.apply_releases(batch)
            yield cluster_pb2.ReservationReplies(
                outcome=[self._traced_outcome(r, batch.frontend_id) for r in batch.reserve]
            )

    def _traced_outcome(self, request: cluster_pb2.ReserveRequest, frontend_id: str) -> cluster_pb2.ReservationOutcome:
        """A batched reservation in its own SERVER span, parented by the trace context it carries (as the unary
        Reserve's span is by its call metadata)."""
        carried = (
            (("traceparent", request.traceparent), ("tracestate", request.tracestate)) if request.traceparent else ()
        )
        span = tracing.start_server_span(
            RESERVE_SPAN, carried, {"rpc.system": "grpc", "openengine.request_id": request.request_id}
        )
        outcome = self.state.reservation_outcome(request, frontend_id)
        if outcome.refusal_code:
            tracing.end_span(span, outcome.refusal)
        else:
            span.set_attribute("openengine.node_id", outcome.node.node_id)
            tracing.end_span(span)
        return outcome

    async def Abort(self, request, context) -> cluster_pb2.ClusterAbortReply:
        if request.WhichOneof("target") == "all_requests":
            targets = self.state.live_requests()
        else:
            where, node = self.state.lookup(request.request_id, request.owner)
            if where == "finished":
                return cluster_pb2.ClusterAbortReply(outcome=cluster_pb2.ABORT_OUTCOME_ALREADY_FINISHED)
            if where == "unknown":
                return cluster_pb2.ClusterAbortReply(outcome=cluster_pb2.ABORT_OUTCOME_NOT_FOUND)
            assert node is not None  # a live request's entry
            targets = [(request.request_id, node)]
        replies = await asyncio.gather(*(self._cancel_on_node(rid, node) for rid, node in targets))
        aborted = sum(reply.found or reply.held for reply in replies)
        if request.WhichOneof("target") != "all_requests" and not aborted:
            # Reserved, but it ended on its node and its release (which rides on the frontend's next batch) has
            # not arrived yet; or its node could not be reached. Saying ABORTED would claim an abort that did
            # nothing. (One reserved and not yet submitted is `held`: the node cancels it when it arrives.)
            return cluster_pb2.ClusterAbortReply(outcome=cluster_pb2.ABORT_OUTCOME_ALREADY_FINISHED)
        return cluster_pb2.ClusterAbortReply(outcome=cluster_pb2.ABORT_OUTCOME_ABORTED, aborted=aborted)

    async def _cancel_on_node(self, request_id: str, node: cluster_pb2.NodeEntry) -> cluster_pb2.CancelReply:
        """The node cancels the request, or holds the cancel for when it arrives (see CancelRequest.hold); an
        empty reply when the node cannot be reached."""
        try:
            return await self._node(node).Cancel(
                cluster_pb2.CancelRequest(request_id=request_id, hold=True), timeout=self.config.rpc_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            log_event(
                logger,
                "abort could not reach node",
                logging.WARNING,
                node_id=node.node_id,
                request_id=request_id,
                code=exc.code().name,
            )
            return cluster_pb2.CancelReply()

    def _node(self, node: cluster_pb2.NodeEntry) -> cluster_pb2_grpc.NodeStub:
        channel = self.node_channels.get(node.address)
        if channel is None:
            channel = self.node_channels[node.address] = internal_channel(node.address, self.config)
        return cluster_pb2_grpc.NodeStub(channel)

    async def SetLora(self, request: cluster_pb2.LoraCommand, context) -> cluster_pb2.LoraOutcome:
        name = request.adapter.lora_name
        if request.unload:
            adapter = self.loras.remove(name)
            if adapter is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, self.loras.not_found(name))
            await self._on_ready_nodes(request)  # best effort: a node that misses it frees it on restart
            log_event(logger, "LoRA adapter unloaded", lora_name=name)
            return cluster_pb2.LoraOutcome(adapter=adapter)
        listed = self.loras.adapters.get(name)
        if listed is not None and listed.source_path != request.adapter.source_path:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a LoRA adapter named {name!r} is loaded from {listed.source_path!r}; unload it first",
            )
        nodes = self._lora_nodes()
        if not nodes:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no node serving LoRA is ready to load the adapter; retry")
        results = await self._on_ready_nodes(request, nodes)
        fits, failure = adapter_fits(results)
        if failure is not None:  # a failure other than a model refusing the file, or no model took it
            fits = set()
        listed_for = fits | self.loras.models.get(name, set())
        loaded_elsewhere = [node for node, exc in results if exc is None and node.model.name not in listed_for]
        if loaded_elsewhere:  # the nodes that loaded it for a model it is not listed for unload it again
            await self._on_ready_nodes(cluster_pb2.LoraCommand(adapter=request.adapter, unload=True), loaded_elsewhere)
        if failure is not None:
            node, exc = failure
            await context.abort(exc.code(), f"node {node.node_id}: {exc.details()}")
        adapter, already = self.loras.add(request.adapter, fits)
        models = sorted(self.loras.models[name])
        log_event(logger, "LoRA adapter loaded", lora_name=name, source_path=adapter.source_path, models=models)
        return cluster_pb2.LoraOutcome(adapter=adapter, already_loaded=already, models=models)

    async def _on_ready_nodes(
        self, command: cluster_pb2.LoraCommand, nodes: list[cluster_pb2.NodeEntry] | None = None
    ) -> list[tuple[cluster_pb2.NodeEntry, grpc.aio.AioRpcError | None]]:
        """Sends the command to each node (every ready one serving LoRA by default) at once; each node's error or
        None."""
        if nodes is None:
            nodes = self._lora_nodes()

        async def send(node: cluster_pb2.NodeEntry) -> grpc.aio.AioRpcError | None:
            try:
                await self._node(node).SetLora(command, timeout=LORA_LOAD_TIMEOUT_S)
                return None
            except grpc.aio.AioRpcError as exc:
                return exc

        return list(zip(nodes, await asyncio.gather(*(send(node) for node in nodes)), strict=True))

    def _lora_nodes(self) -> list[cluster_pb2.NodeEntry]:
        """The ready nodes whose engine serves LoRA adapters (of several models, those with OPENENGINE_LORA_DIR)."""
        return [n for n in self.state.node_entries() if n.state == cluster_pb2.NODE_STATE_READY and n.model.max_loras]

    async def GetClusterLoad(self, request, context) -> cluster_pb2.ClusterLoad:
        return self.state.cluster_load()

    async def housekeeping(self) -> None:
        while True:
            self.state.expire()
            await asyncio.sleep(min(0.5, self.config.node_expiry_s / 4))


async def serve(config: CoordinatorConfig, stop: asyncio.Event) -> int:
    service = CoordinatorService(config)
    metrics.register(service.state, service.heartbeat_streams)
    health = Health()
    server = create_internal_server(role_checks(config))
    cluster_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    health.register(server)
    add_internal_port(server, bind_address(config.host, config.port), config)
    await server.start()
    start_metrics(config.metrics_port, host=config.metrics_bind_host())
    await health.start()
    await health.set_ready(True)  # accepting registrations
    freeze_startup_objects()  # a full collection paused every heartbeat and reservation waiting behind it
    log_event(logger, "coordinator listening", port=config.port, grpc_server="grpcio")
    background = [asyncio.create_task(service.housekeeping())]
    if config.prefix_routing == "kv-events":
        follower = KvFollower(service.state, lambda address: internal_channel(address, config))
        background.append(asyncio.create_task(follower.run()))
    await stop.wait()
    await health.start_drain()
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    await server.stop(grace=config.stop_grace_s)
    for channel in service.node_channels.values():
        await channel.close()
    log_event(logger, "coordinator stopped")
    return 0


def adapter_fits(
    results: list[tuple[cluster_pb2.NodeEntry, grpc.aio.AioRpcError | None]],
) -> tuple[set[str], tuple[cluster_pb2.NodeEntry, grpc.aio.AioRpcError] | None]:
    """What a load on the nodes came to: the models all of whose nodes loaded the adapter, and the failure that
    fails the whole load (None: it stands). An adapter fits one base model, so the nodes of another refusing its
    file (INVALID_ARGUMENT) only leave that model out; any other failure (a node at its adapter limit, or not
    answering), or no model taking it, fails the load."""
    by_model: dict[str, list[grpc.aio.AioRpcError | None]] = {}
    for node, exc in results:
        by_model.setdefault(node.model.name, []).append(exc)
    fits = {model for model, errors in by_model.items() if not any(errors)}
    failures = [(node, exc) for node, exc in results if exc is not None]
    other = [(node, exc) for node, exc in failures if exc.code() != grpc.StatusCode.INVALID_ARGUMENT]
    if other:
        return fits, other[0]
    return fits, (failures[0] if not fits else None)
