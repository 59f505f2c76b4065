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
import os
import time
from dataclasses import dataclass
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


def channel_options(retries: bool = True) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", 16 * 1024 * 1024),
                                         # its own connection: channels must not share one through the
                                         # global subchannel pool, or a reconnect would reuse it
                                         ("grpc.use_local_subchannel_pool", 1)]
    if retries:
        options += [("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]
    else:
        options += [("grpc.enable_retries", 0)]
    return options


@dataclass(frozen=True)
class Credentials:
    """How to reach a secured frontend: TLS (`ca_file` verifies the server; empty with `tls`: the system roots),
    a client certificate for mutual TLS, and an API key sent as `authorization: Bearer <key>`."""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    api_key: str = ""
    tls: bool = False
    server_name: str = ""  # the name checked in the server's certificate instead of the target's host

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca_file or self.cert_file or self.key_file)

    @classmethod
    def from_env(cls, **overrides) -> "Credentials":
        """OPENENGINE_API_KEY fills an api_key not given."""
        values = {k: v for k, v in overrides.items() if v}
        values.setdefault("api_key", os.environ.get("OPENENGINE_API_KEY", ""))
        return cls(**values)


NO_CREDENTIALS = Credentials()


def _auth_metadata(credentials: Credentials) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {credentials.api_key}"),) if credentials.api_key else ()


def _with_metadata(details, extra):
    return details._replace(metadata=tuple(details.metadata or ()) + extra)


class _ApiKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata) -> None:
        self.metadata = metadata

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_metadata(details, self.metadata), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_metadata(details, self.metadata), request)


class _AsyncApiKey(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata) -> None:
        self.metadata = metadata

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.metadata), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.metadata), request)


def _tls_options(options, credentials: Credentials) -> list:
    extra = [("grpc.ssl_target_name_override", credentials.server_name)] if credentials.server_name else []
    return list(options) + extra


def open_channel(target: str, options=(), credentials: Credentials = NO_CREDENTIALS):
    """A blocking channel with the TLS and API key of `credentials`."""
    from .common.tls import channel_credentials

    if credentials.uses_tls:
        channel = grpc.secure_channel(target, channel_credentials(credentials.ca_file, credentials.cert_file,
                                                                  credentials.key_file),
                                      options=_tls_options(options, credentials))
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    metadata = _auth_metadata(credentials)
    return grpc.intercept_channel(channel, _ApiKey(metadata)) if metadata else channel


def open_async_channel(target: str, options=(), credentials: Credentials = NO_CREDENTIALS) -> grpc.aio.Channel:
    from .common.tls import channel_credentials

    metadata = _auth_metadata(credentials)
    interceptors = [_AsyncApiKey(metadata)] if metadata else None
    if credentials.uses_tls:
        return grpc.aio.secure_channel(target, channel_credentials(
            credentials.ca_file, credentials.cert_file, credentials.key_file),
            options=_tls_options(options, credentials), interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)


def check_health(target: str, service: str = "readiness", timeout: float = 1.0,
                 credentials: Credentials = NO_CREDENTIALS) -> int:
    """One grpc.health.v1 Check: the ServingStatus, or grpc.RpcError when the target does not answer."""
    with open_channel(target, credentials=credentials) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def is_serving(target: str, service: str = "readiness", timeout: float = 1.0,
               credentials: Credentials = NO_CREDENTIALS) -> bool:
    try:
        return check_health(target, service, timeout, credentials) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class Client:
    """Blocking client: `Client(target).inference.Generate(request)` etc."""

    def __init__(self, target: str, *, retries: bool = True, credentials: Credentials = NO_CREDENTIALS) -> None:
        self.target = target
        self.retries = retries
        self.credentials = credentials
        self._connect()

    def _connect(self) -> None:
        self.channel = open_channel(self.target, channel_options(self.retries), self.credentials)
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

    def __init__(self, target: str, *, retries: bool = True, credentials: Credentials = NO_CREDENTIALS) -> None:
        self.channel = open_async_channel(target, channel_options(retries), credentials)
        self.inference = openengine_pb2_grpc.InferenceStub(self.channel)
        self.control = openengine_pb2_grpc.ControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
