"""The project's client library: calls that survive a frontend restart.

Pre-acceptance refusals are safe to retry (docs/protocol.md, "What this means for
retries"): `UNAVAILABLE` from a draining frontend, or from pygrpc-native's
listener while it stops. Two layers:
- every channel carries a gRPC service-config retry policy for UNAVAILABLE on
  the unary Control and Health calls;
- `generate()` retries a Generate stream refused before its first message on a
  *fresh connection* (a stream that delivered a message is never retried).
  That matters for pygrpc-native: it sends no GOAWAY while stopping, so the old
  connection keeps reaching the stopping process, and with several processes
  sharing a port (SO_REUSEPORT) a new connection can land on any of them.
`generate(timeout=T)` keeps T as the deadline of the whole call: each attempt
gets only what is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .api.openengine.v1 import generation_pb2, openengine_pb2, openengine_pb2_grpc

RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
# Not Inference.Generate: generate() retries it on a fresh connection, within its deadline. gRPC's own retry
# of that stream (grpcio 1.85.3) hung calls past their deadline, which never fired, when a pygrpc-native
# frontend stopped under load: 5 of 8 rolling-restart runs here; without it, 0 of 12.
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [
                    {"service": service}
                    for service in (
                        openengine_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
                        health.SERVICE_NAME,
                    )
                ],
                "retryPolicy": RETRY_POLICY,
            }
        ]
    }
)


# A fresh connection lands on a stopping process with p = 1/W. With a deadline, the deadline normally ends a
# call first; without one, this bounds the waiting to ~15 s on average (about 30 s at most).
RECONNECT_ATTEMPTS = 64
RECONNECT_BACKOFF_S = (0.05, 0.5)  # the n-th wait is uniform in [0, min(0.5, 0.05 * 2**n)] s ("full jitter")


# Refusals before the first message that generate() retries on a fresh connection. CANCELLED: grpc.aio's
# server.stop() cancels calls that reached the process but not yet the handler (common under load); the frontend
# never saw them, so nothing was generated or lost.
RETRYABLE_BEFORE_FIRST_MESSAGE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class DeadlineExceeded(grpc.RpcError):
    """generate()'s deadline passed between two attempts: the same status a call's own deadline gives."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"DEADLINE_EXCEEDED: {self._details}"


class Attempts:
    """The retry and deadline decisions of one generate() call, shared by Client and AsyncClient.

    `timeout` (seconds, None: none) bounds the whole call. Only RETRYABLE_BEFORE_FIRST_MESSAGE before the first
    message is retried, at most `limit` attempts and never past the deadline.
    """

    def __init__(
        self,
        timeout: float | None,
        *,
        limit: int = RECONNECT_ATTEMPTS,
        backoff_s: tuple[float, float] = RECONNECT_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.timeout = timeout
        self.limit = limit
        self.backoff_s = backoff_s
        self._clock = clock
        self._jitter = jitter
        self.deadline = None if timeout is None else clock() + timeout
        self.made = 0
        self.last_error: grpc.RpcError | None = None

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - self._clock()

    def next_timeout(self) -> float | None:
        """The timeout of the attempt about to start: what is left of the deadline.
        Raises DeadlineExceeded when nothing is left."""
        left = self.remaining()
        if left is not None and left <= 0:
            last = self.last_error
            raise DeadlineExceeded(
                f"generate() did not complete within its {self.timeout:g} s deadline (attempts made: {self.made}"
                + (f"; last: {last.code().name}: {last.details()})" if last is not None else ")")
            )
        self.made += 1
        return left

    def wait_before_retry(self, error: grpc.RpcError, received: bool) -> float:
        """Seconds to wait before the next attempt; re-raises `error` when it must not be retried."""
        if received or error.code() not in RETRYABLE_BEFORE_FIRST_MESSAGE or self.made >= self.limit:
            raise error
        self.last_error = error
        base, cap = self.backoff_s
        wait = self._jitter() * min(cap, base * 2 ** (self.made - 1))
        left = self.remaining()
        return wait if left is None else max(0.0, min(wait, left))


# A connection of the channel's own: channels must not share one through gRPC's global subchannel pool, or a
# reconnect (a health check meant for another process behind the port) would reuse it.
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)


def channel_options(retries: bool = True, target: str = "") -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        OWN_CONNECTION,
    ]
    if target.startswith("dns:"):
        # a name with one address per frontend (a headless Service): a connection to each, calls spread over them
        options.append(("grpc.lb_policy_name", "round_robin"))
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
    def from_env(cls, **overrides) -> Credentials:
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
        channel = grpc.secure_channel(
            target,
            channel_credentials(credentials.ca_file, credentials.cert_file, credentials.key_file),
            options=_tls_options(options, credentials),
        )
    else:
        channel = grpc.insecure_channel(target, options=list(options))
    metadata = _auth_metadata(credentials)
    return grpc.intercept_channel(channel, _ApiKey(metadata)) if metadata else channel


def open_async_channel(target: str, options=(), credentials: Credentials = NO_CREDENTIALS) -> grpc.aio.Channel:
    from .common.tls import channel_credentials

    metadata = _auth_metadata(credentials)
    interceptors = [_AsyncApiKey(metadata)] if metadata else None
    if credentials.uses_tls:
        return grpc.aio.secure_channel(
            target,
            channel_credentials(credentials.ca_file, credentials.cert_file, credentials.key_file),
            options=_tls_options(options, credentials),
            interceptors=interceptors,
        )
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)


def check_health(
    target: str, service: str = "readiness", timeout: float = 1.0, credentials: Credentials = NO_CREDENTIALS
) -> int:
    """One grpc.health.v1 Check on a connection of its own (processes sharing a port answer one each): the
    ServingStatus, or grpc.RpcError when the target does not answer."""
    with open_channel(target, [OWN_CONNECTION], credentials) as channel:
        return (
            health_pb2_grpc.HealthStub(channel)  # type: ignore[attr-defined]  # its stub declares no methods
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            .status
        )


def is_serving(
    target: str, service: str = "readiness", timeout: float = 1.0, credentials: Credentials = NO_CREDENTIALS
) -> bool:
    try:
        return check_health(target, service, timeout, credentials) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class _Connection:
    """A channel to `target` and the stubs on it; `_connect()` replaces both (a fresh connection)."""

    def __init__(
        self, target: str, *, retries: bool = True, credentials: Credentials = NO_CREDENTIALS, options=()
    ) -> None:
        """`options`: more gRPC channel options (e.g. `grpc.dns_min_time_between_resolutions_ms`)."""
        self.target = target
        self.retries = retries
        self.credentials = credentials
        self.extra_options = tuple(options)
        self._connect()

    def _open(self, options):
        raise NotImplementedError

    def _connect(self) -> None:
        self.channel = self._open(channel_options(self.retries, self.target) + list(self.extra_options))
        self.inference = openengine_pb2_grpc.InferenceStub(self.channel)
        self.control = openengine_pb2_grpc.ControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


class Client(_Connection):
    """Blocking client: `Client(target).generate(request, timeout=30)`; the raw stubs are `.inference`,
    `.control` and `.health`."""

    def _open(self, options):
        return open_channel(self.target, options, self.credentials)

    def generate(
        self, request: generation_pb2.GenerateRequest, *, timeout: float | None = None, metadata=()
    ) -> Iterator[generation_pb2.GenerateResponse]:
        """Streams one generation; a refusal before the first message is retried on a fresh connection.
        `timeout` is the deadline of the whole call, counted from now (see `Attempts`)."""
        return self._generate(request, Attempts(timeout), metadata)

    def _generate(self, request, attempts: Attempts, metadata) -> Iterator[generation_pb2.GenerateResponse]:
        while True:
            call = self.inference.Generate(request, timeout=attempts.next_timeout(), metadata=metadata)
            received = False
            try:
                for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as exc:
                wait = attempts.wait_before_retry(exc, received)
            finally:
                call.cancel()  # no-op once the call ended; frees it when the caller stops early
            self.channel.close()
            time.sleep(wait)
            self._connect()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Connection):
    """asyncio client with the same retry policy and the same `generate`."""

    def _open(self, options):
        return open_async_channel(self.target, options, self.credentials)

    def generate(
        self, request: generation_pb2.GenerateRequest, *, timeout: float | None = None, metadata=()
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """As `Client.generate`: `async for response in client.generate(request, timeout=30)`."""
        return self._generate(request, Attempts(timeout), metadata)

    async def _generate(self, request, attempts: Attempts, metadata) -> AsyncIterator[generation_pb2.GenerateResponse]:
        while True:
            call = self.inference.Generate(request, timeout=attempts.next_timeout(), metadata=metadata)
            received = False
            try:
                async for response in call:
                    received = True
                    yield response
                return
            except grpc.RpcError as exc:
                wait = attempts.wait_before_retry(exc, received)
            finally:
                call.cancel()
            await self.channel.close()
            await asyncio.sleep(wait)
            self._connect()

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def served_model(client: Client, model: str | None = None, *, timeout: float = 10.0):
    """ModelInfo of `model`, or of the first model the server names when None (a served model's name or alias)."""
    from .api.openengine.v1 import model_pb2, server_pb2

    if not model:
        server = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=timeout)
        if not server.supported_models:
            raise DeadlineExceeded("the server names no model yet (no ready node); retry")
        model = server.supported_models[0]
    return client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model=model), timeout=timeout)
