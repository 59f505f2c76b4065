"""The project's client library: calls that survive a frontend restart.

Pre-acceptance refusals are safe to retry (SEMANTICS.md): `UNAVAILABLE` from a
draining frontend, or from pygrpc-native's listener while it stops. Two layers:
- every channel carries a gRPC service-config retry policy for UNAVAILABLE
  (gRPC never retries a stream that already delivered a message);
- `generate()` additionally retries a refused stream on a *fresh connection*.
  That matters for pygrpc-native: it sends no GOAWAY while stopping, so the old
  connection keeps reaching the stopping process, and with several processes
  sharing a port (SO_REUSEPORT) a new connection can land on any of them.
"""

from __future__ import annotations

import json
import time
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .api.openengine.v1 import generation_pb2, openengine_pb2_grpc

RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": "openengine.v1.Inference"}, {"service": "openengine.v1.Control"},
             {"service": "grpc.health.v1.Health"}],
    "retryPolicy": RETRY_POLICY,
}]})


RECONNECT_ATTEMPTS = 16   # a fresh connection lands on a stopping process with p = 1/W: 16 tries leave ~1e-5
RECONNECT_BACKOFF_S = (0.05, 0.5)


def channel_options(retries: bool = True, target: str = "") -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", 16 * 1024 * 1024),
                                         # its own connection: channels must not share one through the
                                         # global subchannel pool, or a reconnect would reuse it
                                         ("grpc.use_local_subchannel_pool", 1)]
    if target.startswith("dns:"):
        # a name with one address per frontend (a headless Service): a connection to each, calls spread over them
        options.append(("grpc.lb_policy_name", "round_robin"))
    if retries:
        options += [("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]
    else:
        options += [("grpc.enable_retries", 0)]
    return options


def check_health(target: str, service: str = "readiness", timeout: float = 1.0) -> int:
    """One grpc.health.v1 Check: the ServingStatus, or grpc.RpcError when the target does not answer."""
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def is_serving(target: str, service: str = "readiness", timeout: float = 1.0) -> bool:
    try:
        return check_health(target, service, timeout) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class Client:
    """Blocking client: `Client(target).inference.Generate(request)` etc."""

    def __init__(self, target: str, *, retries: bool = True) -> None:
        self.target = target
        self.retries = retries
        self._connect()

    def _connect(self) -> None:
        self.channel = grpc.insecure_channel(self.target, options=channel_options(self.retries, self.target))
        self.inference = openengine_pb2_grpc.InferenceStub(self.channel)
        self.control = openengine_pb2_grpc.ControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, request: generation_pb2.GenerateRequest, *, timeout: float | None = None,
                 metadata=()) -> Iterator[generation_pb2.GenerateResponse]:
        """Streams one generation; a refusal before the first message is retried on a fresh connection."""
        for attempt in range(RECONNECT_ATTEMPTS):
            received = False
            try:
                for response in self.inference.Generate(request, timeout=timeout, metadata=metadata):
                    received = True
                    yield response
                return
            except grpc.RpcError as exc:
                if received or exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == RECONNECT_ATTEMPTS - 1:
                    raise
            self.channel.close()
            time.sleep(min(RECONNECT_BACKOFF_S[0] * 2 ** attempt, RECONNECT_BACKOFF_S[1]))
            self._connect()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same retry policy."""

    def __init__(self, target: str, *, retries: bool = True) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=channel_options(retries, target))
        self.inference = openengine_pb2_grpc.InferenceStub(self.channel)
        self.control = openengine_pb2_grpc.ControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
