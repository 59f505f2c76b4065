"""The project's client library: channels that survive a frontend restart.

Pre-acceptance refusals are safe to retry (SEMANTICS.md): `UNAVAILABLE` from a
draining frontend, or from pygrpc-native's listener while it stops (it sends no
GOAWAY, so an old connection gets `UNAVAILABLE` instead of moving on). The
service config below retries them transparently; a stream that has already
delivered a message is never retried by gRPC.
"""

from __future__ import annotations

import json

import grpc
from grpc_health.v1 import health_pb2_grpc

from .api.openengine.v1 import openengine_pb2_grpc

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


def channel_options(retries: bool = True) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    if retries:
        options += [("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]
    else:
        options += [("grpc.enable_retries", 0)]
    return options


class Client:
    """Blocking client: `Client(target).inference.Generate(request)` etc."""

    def __init__(self, target: str, *, retries: bool = True) -> None:
        self.channel = grpc.insecure_channel(target, options=channel_options(retries))
        self.inference = openengine_pb2_grpc.InferenceStub(self.channel)
        self.control = openengine_pb2_grpc.ControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same retry policy."""

    def __init__(self, target: str, *, retries: bool = True) -> None:
        self.channel = grpc.aio.insecure_channel(target, options=channel_options(retries))
        self.inference = openengine_pb2_grpc.InferenceStub(self.channel)
        self.control = openengine_pb2_grpc.ControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
