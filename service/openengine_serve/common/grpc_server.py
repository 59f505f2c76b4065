"""gRPC server construction: grpc.aio everywhere, pygrpc-native for the public frontend on request.

pygrpc-native (a drop-in `grpc.aio` server doing HTTP/2 in Rust) differs from
grpc.aio in ways that matter here (measured, ../shared/notes): it rejects some
server options at construction, and `grpc.so_reuseport` is off unless set.
One option list serves both; options the native server rejects are never
passed to it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from dataclasses import dataclass

import grpc

from .logging_setup import log_event

GRPCIO = "grpcio"
NATIVE = "pygrpc-native"
NATIVE_DISTRIBUTION = "pygrpc-native"
NATIVE_MINIMUM = (0, 5, 0)  # first release that honours grpc.so_reuseport
NATIVE_BELOW = (1, 0, 0)
NATIVE_REQUIREMENT = "pygrpc-native>=0.5.0,<1"
NATIVE_INSTALL_COMMAND = "pip install 'openengine-serve[native]'"

MAX_MESSAGE_BYTES = 16 * 1024 * 1024

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


def resolve_implementation(name: str) -> ServerImplementation:
    if name == NATIVE:
        return ServerImplementation(NATIVE, check_native_dependency())
    if name == GRPCIO:
        return ServerImplementation(GRPCIO, grpc.__version__)
    raise DependencyError(f"unknown gRPC server {name!r}; allowed: {GRPCIO}, {NATIVE}")


def create_server(implementation: ServerImplementation = ServerImplementation(GRPCIO, grpc.__version__),
                  interceptors=(), options: tuple[tuple[str, int], ...] = ()) -> grpc.aio.Server:
    """`options` override SERVER_OPTIONS entries of the same name (the frontend's stated limits)."""
    common = tuple(dict(SERVER_OPTIONS + tuple(options)).items())
    if implementation.name == NATIVE:
        import pygrpc_native.aio  # checked by resolve_implementation before anything heavy

        # Its Rust I/O threads (2 by default) share the CPUs with the Python loop: a worker limited to one CPU
        # (pinned with taskset or a cpuset) runs one: measured ~7 % less CPU per token than two.
        io_threads = min(2, len(os.sched_getaffinity(0)))
        return pygrpc_native.aio.Server(options=list(common), interceptors=list(interceptors),
                                        io_threads=io_threads)
    return grpc.aio.server(options=list(common + GRPCIO_ONLY_OPTIONS), interceptors=list(interceptors))


def create_internal_server() -> grpc.aio.Server:
    """Coordinator and node: always grpc.aio, whatever OPENENGINE_GRPC_SERVER says (it is the frontend's)."""
    if "OPENENGINE_GRPC_SERVER" in os.environ:
        log_event(logging.getLogger("openengine_serve"),
                  "OPENENGINE_GRPC_SERVER is ignored: internal components always run grpc.aio",
                  value=os.environ["OPENENGINE_GRPC_SERVER"])
    return create_server()
