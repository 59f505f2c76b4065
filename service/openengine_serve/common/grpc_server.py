"""gRPC server construction: grpc.aio everywhere, pygrpc-native for the public frontend on request.

pygrpc-native (a drop-in `grpc.aio` server doing HTTP/2 in Rust) differs from
grpc.aio in ways that matter here (measured for 0.5.0; README table): it rejects some
server options at construction, and `grpc.so_reuseport` is off unless set.
One option list serves both; options the native server rejects are never
passed to it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from .cpu_budget import cpu_budget, native_io_threads
from .logging_setup import log_event

GRPCIO = "grpcio"
NATIVE = "pygrpc-native"
NATIVE_DISTRIBUTION = "pygrpc-native"
NATIVE_MINIMUM = (0, 5, 0)  # first release that honours grpc.so_reuseport
NATIVE_BELOW = (1, 0, 0)
NATIVE_REQUIREMENT = "pygrpc-native>=0.5.0,<1"
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
GRPCIO_ONLY_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_connection_idle_ms", 15 * 60_000),
)


class DependencyError(RuntimeError):
    """The selected gRPC server cannot run; the message says how to fix it."""


@dataclass(frozen=True)
class ServerImplementation:
    name: str      # "grpcio" or "pygrpc-native"
    version: str
    cpu_budget: float = 0.0   # CPUs this process may use (min of affinity and cgroup quota); 0 = not derived
    io_threads: int = 0       # pygrpc-native's Rust I/O threads; 0 = its own default (and always for grpcio)

    def describe(self) -> dict[str, str | float]:
        """For the start-up log line and ServerInfo.extra."""
        fields: dict[str, str | float] = {"grpc_server": self.name, "grpc_server_version": self.version}
        if self.cpu_budget:
            fields["cpu_budget"] = self.cpu_budget
        if self.io_threads:
            fields["io_threads"] = self.io_threads
        return fields


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def check_native_dependency() -> str:
    """Checks pygrpc-native is installed in a supported version without importing it; returns the version."""
    try:
        version = importlib.metadata.version(NATIVE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DependencyError(
            f"OPENENGINE_GRPC_SERVER=pygrpc-native needs the optional package {NATIVE_REQUIREMENT}, "
            f"which is not installed. Install it with: {NATIVE_INSTALL_COMMAND}") from None
    if not NATIVE_MINIMUM <= _version_tuple(version) < NATIVE_BELOW:
        raise DependencyError(
            f"OPENENGINE_GRPC_SERVER=pygrpc-native found pygrpc-native {version}, but {NATIVE_REQUIREMENT} "
            f"is required. Install a supported version with: pip install '{NATIVE_REQUIREMENT}'")
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


def create_server(implementation: ServerImplementation = ServerImplementation(GRPCIO, grpc.__version__),
                  interceptors=(), options: tuple[tuple[str, int], ...] = (), max_connection_age_s: float = 0.0,
                  max_connection_age_grace_s: float = 0.0) -> grpc.aio.Server:
    """`options` override SERVER_OPTIONS entries of the same name (the frontend's stated limits).
    max_connection_age_s > 0 (grpc.aio only): connections older than that get GOAWAY, so clients reconnect
    and reach frontends added since; open calls get max_connection_age_grace_s to finish."""
    common = tuple(dict(SERVER_OPTIONS + tuple(options)).items())
    if implementation.name == NATIVE:
        if max_connection_age_s:
            raise ValueError("pygrpc-native has no maximum connection age (grpc.max_connection_age_ms)")
        import pygrpc_native.aio  # checked by resolve_implementation before anything heavy

        # Its Rust I/O threads share the CPUs with the Python loop: sized from the CPU budget (cpu_budget.py).
        io_threads = implementation.io_threads or native_io_threads(cpu_budget())
        return pygrpc_native.aio.Server(options=list(common), interceptors=list(interceptors),
                                        io_threads=io_threads)
    age_options = ((("grpc.max_connection_age_ms", round(max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", round(max_connection_age_grace_s * 1000)))
                   if max_connection_age_s else ())
    return grpc.aio.server(options=list(common + GRPCIO_ONLY_OPTIONS + age_options),
                           interceptors=list(interceptors))


def create_internal_server() -> grpc.aio.Server:
    """Coordinator and node: always grpc.aio, whatever OPENENGINE_GRPC_SERVER says (it is the frontend's)."""
    if "OPENENGINE_GRPC_SERVER" in os.environ:
        log_event(logging.getLogger("openengine_serve"),
                  "OPENENGINE_GRPC_SERVER is ignored: internal components always run grpc.aio",
                  value=os.environ["OPENENGINE_GRPC_SERVER"])
    return create_server()


def nonblocking_send(context) -> Callable[[bytes], bool] | None:
    """A synchronous send of one serialized message on a server-streaming call, where the server has one:
    pygrpc-native hands a message to its Rust I/O thread without awaiting anything (`stream_try_send`, what its
    own `context.write` calls first). The function returns True when the message was sent, False when it was not
    (the client's buffer is full, the call ended, or it is over the send limit): the caller then writes those
    bytes with `context.write`, which waits for room or marks the call closed exactly as before. None for
    grpc.aio (every send is awaited) and for a pygrpc-native whose internals differ from the 0.5 series'.

    Called outside the call's own task (the frontend's lane reader), so it must never block."""
    server = getattr(context, "_server", None)
    front = getattr(server, "_front", None)
    call_id = getattr(getattr(context, "_call", None), "call_id", None)
    try_send = getattr(front, "stream_try_send", None)
    if try_send is None or call_id is None or not hasattr(context, "_closed"):
        return None
    from pygrpc_native._native import STREAM_SENT  # only reached on pygrpc-native

    limit = getattr(server, "_send_limit", None) or MAX_MESSAGE_BYTES

    def send(data: bytes) -> bool:
        if context._closed or len(data) > limit:
            return False
        try:
            return try_send(call_id, data) == STREAM_SENT
        except Exception:  # noqa: BLE001 - e.g. the server is stopping: context.write reports it on the call's task
            return False

    return send
