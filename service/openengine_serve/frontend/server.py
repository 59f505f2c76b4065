"""One frontend worker process: the public OpenEngine gRPC server."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import grpc
from grpc_reflection.v1alpha import reflection

from ..api.openengine.v1 import generation_pb2, openengine_pb2, openengine_pb2_grpc
from ..common.config import FrontendConfig
from ..common.grpc_server import GRPCIO, ServerImplementation, create_server
from ..common.health import Health
from ..common.lifecycle import bind_address
from ..common.tls import add_public_port
from ..common.logging_setup import log_event
from ..common.vocab import load_encoding
from . import auth, limits, metrics
from .cluster import Cluster, LaneFailure
from .service import Frontend
from .stream import serialize_response
from .supervisor import READY_FILE_VARIABLE

logger = logging.getLogger("openengine_serve.frontend")

DRAIN_ERROR_GRACE_S = 1.0  # time for the terminal DRAINING errors to reach clients before the server stops
PUBLIC_SERVICES = tuple(s.full_name for s in openengine_pb2.DESCRIPTOR.services_by_name.values())


async def serve(config: FrontendConfig, implementation: ServerImplementation, stop: asyncio.Event) -> int:
    frontend_id = config.frontend_id or f"frontend-{socket.gethostname()}-{os.getpid()}"
    encoding = load_encoding()
    cluster = Cluster(frontend_id, config.coordinator_address, f"{socket.gethostname()}:{config.port}",
                      config.heartbeat_s, config.stall_timeout_s, internal_tls=config)  # security hook
    health = Health(readiness_aliases=PUBLIC_SERVICES)
    frontend = Frontend(config, frontend_id, implementation, encoding, cluster, health)

    # security hook: API keys, then the stated limits
    server = create_server(implementation, interceptors=auth.interceptors(config) + limits.interceptors(config),
                           options=limits.transport_options(config))
    add_inference_service(frontend, server)
    openengine_pb2_grpc.add_ControlServicer_to_server(frontend, server)
    health.register(server)
    reflection.enable_server_reflection((*PUBLIC_SERVICES, "grpc.health.v1.Health", reflection.SERVICE_NAME), server)
    add_public_port(server, bind_address(config.host, config.port), config)  # security hook: TLS
    await server.start()
    await health.start()
    if ready_file := os.environ.get(READY_FILE_VARIABLE):  # tells a supervisor this worker is serving
        open(ready_file, "w").close()
    metrics.SERVER_INFO.labels(implementation=implementation.name, version=implementation.version).set(1)
    log_event(logger, "frontend listening", frontend_id=frontend_id, port=config.port,
              grpc_server=implementation.name, grpc_server_version=implementation.version, model=config.model)

    heartbeat = asyncio.create_task(cluster.heartbeat_loop())
    readiness = asyncio.create_task(_follow_readiness(cluster, health))
    watchdog = asyncio.create_task(cluster.stall_watchdog())
    await stop.wait()

    # Drain: readiness drops first and new Generate calls get UNAVAILABLE (retry-safe). grpc.aio closes its
    # listener and sends GOAWAY as soon as stop() begins, so it is stopped at once with the whole drain as
    # grace: clients move to another process. pygrpc-native keeps its listener until stop() returns and does
    # not shorten a grace already given, so it is stopped only once the streams are done. Any stream still
    # open at the deadline ends with a terminal DRAINING error, which gets DRAIN_ERROR_GRACE_S to go out.
    await health.start_drain()
    log_event(logger, "draining", open_streams=len(cluster.sinks), timeout_s=config.drain_timeout_s)
    early_stop = None
    if implementation.name == GRPCIO:
        early_stop = asyncio.create_task(server.stop(grace=config.drain_timeout_s + DRAIN_ERROR_GRACE_S))
    deadline = time.monotonic() + config.drain_timeout_s
    while cluster.sinks and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if cluster.sinks:
        log_event(logger, "drain deadline reached", logging.WARNING, open_streams=len(cluster.sinks))
        cluster.fail_all(LaneFailure("frontend is shutting down: drain deadline reached; retry the request",
                                     retryable=True, draining=True))
    # Ends what is left (e.g. health Watch streams) after a short grace; shortens grpc.aio's first stop.
    await server.stop(grace=DRAIN_ERROR_GRACE_S)
    if early_stop is not None:
        await early_stop
    for task in (heartbeat, readiness, watchdog):
        task.cancel()
    await cluster.close()
    log_event(logger, "frontend stopped", frontend_id=frontend_id)
    return 0


def add_inference_service(frontend: Frontend, server) -> None:
    """openengine.v1.Inference as generated, except that Generate's responses go through
    `serialize_response`, which passes the hand-serialized token deltas through unchanged."""
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        frontend.Generate, request_deserializer=generation_pb2.GenerateRequest.FromString,
        response_serializer=serialize_response)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("openengine.v1.Inference", handlers),))
    server.add_registered_method_handlers("openengine.v1.Inference", handlers)


async def _follow_readiness(cluster: Cluster, health: Health) -> None:
    """SERVING while at least one node is ready. A coordinator outage alone keeps it SERVING (Control.Health
    says DEGRADED): the last known node table still routes, and dropping every frontend would stop all traffic."""
    while True:
        await health.set_ready(bool(cluster.ready_nodes()))
        await asyncio.sleep(0.2)
