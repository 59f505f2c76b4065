"""One frontend worker process: the public OpenEngine gRPC server, and how its parts are wired together."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket

from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from ..api.openengine.v1 import openengine_pb2
from ..api.openengine_internal.v1 import cluster_pb2
from ..common.config import FrontendConfig
from ..common.grpc_server import GRPCIO, ServerImplementation, create_server
from ..common.health_service import Health
from ..common.lifecycle import bind_address, freeze_startup_objects
from ..common.logging_setup import log_event
from ..common.tls import add_public_port, internal_channel
from . import auth, limits, metrics
from .connection_age import ConnectionAges
from .control import Control
from .coordinator_client import CoordinatorClient
from .fallback_routing import FallbackRouter
from .inference import Inference
from .inference_probe import InferenceProbe
from .kv_events import KvEventRelay
from .nodes import LaneFailure, NodeConnections
from .public_api import add_public_service
from .ready_file import mark_worker_ready
from .requests import Requests
from .served_model import ServedModel
from .stream import serialize_response
from .tasks import BackgroundTasks
from .watchdog import measure_loop_lag, stall_watchdog

logger = logging.getLogger("openengine_serve.frontend")

DRAIN_ERROR_GRACE_S = 1.0  # time for the terminal DRAINING errors to reach clients before the server stops
NATIVE_FLUSH_S = 0.2  # pygrpc-native: after the last stream ended, before stop() closes its connections
# A lane message that merged a backlog (node/server.py: ResultLane) can pass gRPC's default 4 MiB
# (lane_max_backlog_steps x max_batch token records); the node is a trusted peer: no receive limit.
NODE_CHANNEL_OPTIONS = (("grpc.max_receive_message_length", -1),)
PUBLIC_SERVICES = tuple(s.full_name for s in openengine_pb2.DESCRIPTOR.services_by_name.values())
REFLECTED_SERVICES = (*PUBLIC_SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)


async def serve(config: FrontendConfig, implementation: ServerImplementation, stop: asyncio.Event) -> int:
    frontend_id = config.frontend_id or f"frontend-{socket.gethostname()}-{os.getpid()}"
    tasks = BackgroundTasks()
    open_internal_channel = functools.partial(internal_channel, config=config)  # security hook: internal TLS
    model = ServedModel(config, open_internal_channel)
    nodes = NodeConnections(
        frontend_id,
        tasks,
        config.node_connect_timeout_s,
        config.node_call_timeout_s,
        open_channel=functools.partial(open_internal_channel, options=NODE_CHANNEL_OPTIONS),
        lane_window=config.lane_window,
        lane_busy_ack_interval_s=config.lane_busy_ack_interval_ms / 1000,
        pause_after_s=config.client_pause_after_s,
    )

    def on_node_table(table: dict[str, cluster_pb2.NodeEntry]) -> None:
        nodes.keep_only(table)
        model.on_node_table(table)
        metrics.observe_node_load(table.values())

    coordinator = CoordinatorClient(
        frontend_id,
        config.coordinators(),
        f"{config.reachable_host()}:{config.port}",
        config.heartbeat_s,
        config.coordinator_timeout_s,
        live_requests=lambda: requests.open_count,
        on_node_table=on_node_table,
        open_channel=open_internal_channel,
    )
    requests = Requests(frontend_id, coordinator, nodes, FallbackRouter())
    health = Health(readiness_aliases=PUBLIC_SERVICES)
    inference = Inference(config, model, requests, health, implementation.name, lora_for=coordinator.lora_for)
    probe = InferenceProbe(frontend_id, inference, config.probe_timeout_s)

    # grpcio sends GOAWAY at the maximum connection age itself; pygrpc-native cannot (connection_age.py)
    ages = (
        ConnectionAges(config.max_connection_age_s, config.port)
        if config.max_connection_age_s and implementation.name != GRPCIO
        else None
    )
    # grpcio limits connections and closes idle ones itself; pygrpc-native cannot (limits.py: ConnectionTable)
    connections = limits.ConnectionTable(
        config.max_connections, config.max_connection_idle_s, config.port, closes=implementation.name != GRPCIO
    )
    keys = auth.key_store(config)  # shared by both APIs
    # security hook: API keys, then the stated limits
    server = create_server(
        implementation,
        interceptors=auth.interceptors(keys) + limits.interceptors(config, ages, connections),
        options=limits.transport_options(config),
        max_connection_age_s=0.0 if ages else config.max_connection_age_s,
        max_connection_age_grace_s=config.drain_timeout_s,
        grpcio_options=limits.grpcio_transport_options(config),
    )
    kv_events = KvEventRelay(
        coordinator.ready_nodes,
        functools.partial(open_internal_channel, options=NODE_CHANNEL_OPTIONS),
        config.reachable_host(),
        config.port,
    )
    control = Control(config, frontend_id, implementation, coordinator, health, probe, model, kv_events)
    add_public_services(server, inference, control)
    health.register(server)
    reflection.enable_server_reflection(REFLECTED_SERVICES, server, pool=public_descriptor_pool())
    add_public_port(server, bind_address(config.host, config.port), config)  # security hook: TLS
    await server.start()
    http = None
    if config.http_port:
        from .http.app import OpenAIApi
        from .http.server import HttpServer

        http = HttpServer(OpenAIApi(inference, keys).app, config)
        await http.start()
    await health.start()
    freeze_startup_objects()  # modules, protobuf descriptors
    mark_worker_ready()
    metrics.SERVER_INFO.labels(implementation=implementation.name, version=implementation.version).set(1)
    # The level is passed so that describe()'s fields cannot be taken for it.
    log_event(
        logger,
        "frontend listening",
        logging.INFO,
        frontend_id=frontend_id,
        port=config.port,
        http_port=config.http_port,
        **implementation.describe(),
    )

    background = [
        asyncio.create_task(coordinator.heartbeat_loop()),
        asyncio.create_task(_follow_readiness(coordinator, model, health)),
        asyncio.create_task(stall_watchdog(nodes.sinks, config.stall_timeout_s, config.client_stall_timeout_s)),
        asyncio.create_task(measure_loop_lag()),
        asyncio.create_task(connections.sweep_loop()),
    ]
    if ages is not None:
        background.append(asyncio.create_task(ages.sweep_loop()))
    await stop.wait()
    await _drain(config, implementation, server, health, requests)
    if http is not None:
        await http.stop()  # its streams ended with the drain; new requests got 503 meanwhile
    for task in background:
        task.cancel()
    await nodes.close()
    await coordinator.close()
    log_event(logger, "frontend stopped", frontend_id=frontend_id)
    return 0


async def _drain(
    config: FrontendConfig, implementation: ServerImplementation, server, health: Health, requests: Requests
) -> None:
    """Readiness drops first and new Generate calls get UNAVAILABLE (retry-safe). grpc.aio closes its
    listener and sends GOAWAY as soon as stop() begins, so it is stopped at once with the whole drain as
    grace: clients move to another process. pygrpc-native keeps its listener until stop() returns and does
    not shorten a grace already given, so it is stopped only once the streams are done. Any stream still
    open at the deadline ends with a terminal DRAINING error, which gets DRAIN_ERROR_GRACE_S to go out."""
    await health.start_drain()
    log_event(logger, "draining", open_streams=requests.open_count, timeout_s=config.drain_timeout_s)
    early_stop = None
    if implementation.name == GRPCIO:
        early_stop = asyncio.create_task(server.stop(grace=config.drain_timeout_s + DRAIN_ERROR_GRACE_S))
    if not await requests.wait_idle(config.drain_timeout_s):
        log_event(logger, "drain deadline reached", logging.WARNING, open_streams=requests.open_count)
        requests.fail_all(
            LaneFailure(
                "frontend is shutting down: drain deadline reached; retry the request", retryable=True, draining=True
            )
        )
        if early_stop is None and await requests.wait_idle(DRAIN_ERROR_GRACE_S):
            # pygrpc-native's stop() closes its connections as soon as no handler runs, without waiting for
            # what the handlers queued to be written: the DRAINING errors were cut off (the client saw the
            # socket close mid-stream). The streams have ended; give their last bytes a moment to go out.
            await asyncio.sleep(NATIVE_FLUSH_S)
    # Ends what is left (e.g. health Watch streams) after a short grace; shortens grpc.aio's first stop.
    await server.stop(grace=DRAIN_ERROR_GRACE_S)
    if early_stop is not None:
        await early_stop


def public_descriptor_pool() -> descriptor_pool.DescriptorPool:
    """What reflection may describe: the files of openengine.v1 and of the health service, with their imports.
    This process's default pool also holds the internal cluster.proto, which clients have no business reading."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:  # a file goes in after what it imports
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for file in (openengine_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR):
        add(file)
    return pool


def add_public_services(server, inference: Inference, control: Control) -> None:
    """openengine.v1 Inference and Control; Generate's responses go through `serialize_response`, which
    passes the hand-serialized token deltas through unchanged."""
    services = openengine_pb2.DESCRIPTOR.services_by_name
    add_public_service(server, services["Inference"], inference, {"Generate": serialize_response})
    add_public_service(server, services["Control"], control)


async def _follow_readiness(coordinator: CoordinatorClient, model: ServedModel, health: Health) -> None:
    """SERVING while at least one node is ready and this frontend has that node's model (tokenizer), re-checked
    at every node table the coordinator sends and when the model is loaded. A coordinator outage alone keeps it
    SERVING (Control.Health says DEGRADED): the last known node table still routes, and dropping every frontend
    would stop all traffic."""
    while True:
        await health.set_ready(model.ready_on(coordinator.nodes.values()))
        waits = [asyncio.ensure_future(event.wait()) for event in (coordinator.table_updated, model.changed)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        coordinator.table_updated.clear()
        model.changed.clear()
