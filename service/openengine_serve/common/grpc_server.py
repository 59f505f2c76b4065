"""gRPC server construction: grpc.aio everywhere, pygrpc-native for the public frontend on request.

pygrpc-native (a drop-in `grpc.aio` server doing HTTP/2 in Rust) differs from
grpc.aio in ways that matter here (README table): it rejects some server options
at construction, and `grpc.so_reuseport` is off unless set. One option list
serves both; options the native server rejects are never passed to it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from .cpu_budget import cpu_budget, native_io_threads
from .extras import DependencyError
from .logging_setup import log_event

GRPCIO = "grpcio"
NATIVE = "pygrpc-native"
NATIVE_DISTRIBUTION = "pygrpc-native"
# Pinned: NativeStreamSender relies on this release's call context (see there); pyproject.toml pins the same.
NATIVE_VERSION = "0.5.0"
NATIVE_REQUIREMENT = f"pygrpc-native=={NATIVE_VERSION}"
NATIVE_INSTALL_COMMAND = "pip install 'openengine-serve[native]'"

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Internal replies carry a refusal's status as its number (refusal_code): the status it names.
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

# Applied to every server, both implementations.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # Several frontend workers share one port; pygrpc-native needs it explicitly.
    ("grpc.so_reuseport", 1),
)
# grpc.aio only: pygrpc-native raises at construction on these.
GRPCIO_ONLY_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.max_connection_idle_ms", 15 * 60_000),)


@dataclass(frozen=True)
class ServerImplementation:
    name: str  # "grpcio" or "pygrpc-native"
    version: str
    cpu_budget: float = 0.0  # CPUs this process may use (min of affinity and cgroup quota); 0 = not derived
    io_threads: int = 0  # pygrpc-native's Rust I/O threads; 0 = its own default (and always for grpcio)

    def describe(self) -> dict[str, str | float]:
        """For the start-up log line and ServerInfo.extra."""
        fields: dict[str, str | float] = {"grpc_server": self.name, "grpc_server_version": self.version}
        if self.cpu_budget:
            fields["cpu_budget"] = self.cpu_budget
        if self.io_threads:
            fields["io_threads"] = self.io_threads
        return fields


def check_native_dependency() -> str:
    """Checks pygrpc-native is installed in the pinned version without importing it; returns the version."""
    try:
        version = importlib.metadata.version(NATIVE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DependencyError(
            f"OPENENGINE_GRPC_SERVER=pygrpc-native needs the optional package {NATIVE_REQUIREMENT}, "
            f"which is not installed. Install it with: {NATIVE_INSTALL_COMMAND}"
        ) from None
    if version != NATIVE_VERSION:
        raise DependencyError(
            f"OPENENGINE_GRPC_SERVER=pygrpc-native found pygrpc-native {version}, but {NATIVE_REQUIREMENT} "
            f"is required. Install it with: pip install '{NATIVE_REQUIREMENT}'"
        )
    return version


def resolve_implementation(name: str, io_threads: int = 0, sharing: int = 1) -> ServerImplementation:
    """io_threads > 0 fixes pygrpc-native's I/O threads; 0 derives them from the CPU budget, of which this
    process gets 1/sharing (frontend workers share their pod's or container's CPUs)."""
    budget = cpu_budget().shared_by(sharing)
    if name == NATIVE:
        version = check_native_dependency()
        return ServerImplementation(NATIVE, version, budget.cpus, native_io_threads(budget, io_threads))
    if name == GRPCIO:
        return ServerImplementation(GRPCIO, grpc.__version__, budget.cpus)
    raise DependencyError(f"unknown gRPC server {name!r}; allowed: {GRPCIO}, {NATIVE}")


def create_server(
    implementation: ServerImplementation = ServerImplementation(GRPCIO, grpc.__version__),
    interceptors=(),
    options: tuple[tuple[str, int], ...] = (),
    max_connection_age_s: float = 0.0,
    max_connection_age_grace_s: float = 0.0,
    grpcio_options: tuple[tuple[str, int], ...] = (),
) -> grpc.aio.Server:
    """`options` override SERVER_OPTIONS entries of the same name (the frontend's stated limits);
    `grpcio_options` override GRPCIO_ONLY_OPTIONS' and are given to grpc.aio only (pygrpc-native rejects them).
    max_connection_age_s > 0 (grpc.aio only): connections older than that get GOAWAY, so clients reconnect
    and reach frontends added since; open calls get max_connection_age_grace_s to finish."""
    common = tuple(dict(SERVER_OPTIONS + tuple(options)).items())
    if implementation.name == NATIVE:
        if max_connection_age_s:
            raise ValueError("pygrpc-native has no maximum connection age (grpc.max_connection_age_ms)")
        import pygrpc_native.aio  # checked by resolve_implementation before anything heavy

        # Its Rust I/O threads share the CPUs with the Python loop: sized from the CPU budget (cpu_budget.py).
        io_threads = implementation.io_threads or native_io_threads(cpu_budget())
        return pygrpc_native.aio.Server(options=list(common), interceptors=list(interceptors), io_threads=io_threads)
    age_options = (
        (
            ("grpc.max_connection_age_ms", round(max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", round(max_connection_age_grace_s * 1000)),
        )
        if max_connection_age_s
        else ()
    )
    grpcio_only = tuple(dict(GRPCIO_ONLY_OPTIONS + tuple(grpcio_options)).items())
    return grpc.aio.server(options=list(common + grpcio_only + age_options), interceptors=list(interceptors))


def create_internal_server(interceptors=()) -> grpc.aio.Server:
    """Coordinator and node: always grpc.aio, whatever OPENENGINE_GRPC_SERVER says (it is the frontend's)."""
    if "OPENENGINE_GRPC_SERVER" in os.environ:
        log_event(
            logging.getLogger("openengine_serve"),
            "OPENENGINE_GRPC_SERVER is ignored: internal components always run grpc.aio",
            value=os.environ["OPENENGINE_GRPC_SERVER"],
        )
    return create_server(interceptors=interceptors)


SEND_RETRY_MIN_S = 0.001  # NativeStreamSender.write: sleeps between tries while the client's buffer is full
SEND_RETRY_MAX_S = 0.1


class NativeStreamSender:
    """Sends on a pygrpc-native server-streaming call without its thread pool.

    pygrpc-native's own `context.write` tries to hand the message to its Rust I/O thread (`stream_try_send`)
    and, when the client's buffer is full, waits for room in a blocking `stream_send` on the event loop's
    default executor (a handful of threads: min(32, CPUs + 4)). A client that stopped reading holds one of
    those threads until its call ends, so a few of them block the executor, and then every other stream whose
    client's buffer is momentarily full waits behind them. `write` waits for room by trying again after a
    short sleep instead, on the call's own task.

    pygrpc-native has no public way from a call context to its call id and front (`stream_try_send`, public,
    needs both), so this reads the attributes of the pinned release's `aio._Context` (NATIVE_VERSION):
    `_server._front`, `_server._encode`, `_server._send_limit`, `_call.call_id`, `_closed`, `_initial_sent`.
    tests/unit/test_native_sender.py serves a real call with it and fails when those change."""

    __slots__ = ("_context", "_server", "_call", "_try_send", "_call_id", "_limit", "_sent", "_full")

    def __init__(self, context, server, try_send, call_id: int, sent: int, full: int) -> None:
        self._context, self._server, self._call = context, server, context._call
        self._try_send, self._call_id = try_send, call_id
        self._limit = server._send_limit or MAX_MESSAGE_BYTES
        self._sent, self._full = sent, full  # pygrpc_native.STREAM_SENT / STREAM_FULL

    @classmethod
    def of(cls, context) -> NativeStreamSender | None:
        """The sender of a pygrpc-native call context; None for grpc.aio (its `context.write` is then used)."""
        server = getattr(context, "_server", None)
        front = getattr(server, "_front", None)
        if front is None:
            return None
        from pygrpc_native import STREAM_FULL, STREAM_SENT  # only reached on pygrpc-native

        return cls(context, server, front.stream_try_send, context._call.call_id, STREAM_SENT, STREAM_FULL)

    def try_send(self, data: bytes) -> bool:
        """A synchronous send of one serialized message: True when it was sent, False when it was not (the
        client's buffer is full, the call ended, or it is over the send limit); the caller then hands those
        bytes to `write`. Called outside the call's own task (the frontend's lane reader): it never blocks."""
        if self._context._closed or len(data) > self._limit:
            return False
        try:
            return self._try_send(self._call_id, data) == self._sent
        except Exception:  # noqa: BLE001 - e.g. the server is stopping: `write` reports it on the call's task
            return False

    async def write(self, message) -> None:
        """`context.write` of pygrpc-native (same encoding, send limit and closed call), waiting for room in
        sleeps of a quarter of the time waited so far (1 ms .. SEND_RETRY_MAX_S): a client that reads again
        after a pause of t gets its next message within ~t/4, and a client that stopped reading costs a few
        wake-ups a second."""
        context = self._context
        if context._closed:
            return
        data = self._server._encode(self._call, context, message)  # fails the call itself when it cannot
        if data is None:
            context._closed = True
            return
        context._initial_sent = True
        status = self._try_send(self._call_id, data)
        waited = 0.0
        while status == self._full:
            delay = min(SEND_RETRY_MAX_S, max(SEND_RETRY_MIN_S, waited / 4))
            await asyncio.sleep(delay)
            waited += delay
            status = self._try_send(self._call_id, data)
        if status != self._sent:
            context._closed = True


def stream_writer(context) -> tuple[Callable[[object], Awaitable[None]], Callable[[bytes], bool] | None]:
    """(write, send_now) of a server-streaming call: pygrpc-native's NativeStreamSender, else grpc.aio's
    `context.write` and no synchronous send (every grpc.aio send is awaited)."""
    sender = NativeStreamSender.of(context)
    if sender is None:
        return context.write, None
    return sender.write, sender.try_send


def nonblocking_send(context) -> Callable[[bytes], bool] | None:
    """NativeStreamSender.try_send of a pygrpc-native call context, else None."""
    sender = NativeStreamSender.of(context)
    return None if sender is None else sender.try_send
