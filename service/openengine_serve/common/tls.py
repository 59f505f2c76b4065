"""TLS for the public port (grpcio only), client credentials, and optional mutual TLS between components.

Server certificates are reloaded without a restart: grpc core asks the fetcher
for a new certificate configuration before each new handshake, and the fetcher
returns one only when a file changed (a Kubernetes Secret or cert-manager
rotation). Connections already open keep their session, so open streams are
not dropped. Internal client certificates follow their files too
(`ReloadingChannel`): calls started after a change go out on a channel built
from the new files, so new connections present the new certificate.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import cast

import grpc

from .config import ConfigError
from .logging_setup import log_event

logger = logging.getLogger("openengine_serve")

NATIVE_TLS_CONFLICT = (
    "TLS is configured (OPENENGINE_TLS_CERT_FILE/--tls-cert-file) but OPENENGINE_GRPC_SERVER=pygrpc-native "
    "cannot serve TLS (pygrpc-native 0.5 has no secure port). Either use the grpcio server "
    "(OPENENGINE_GRPC_SERVER=grpcio), or terminate TLS in front of the frontend (the Compose profile `tls`, "
    'or an ingress/sidecar; see README "Security") and unset the TLS files here.'
)
CLIENT_CA_ALONE = "OPENENGINE_TLS_CLIENT_CA_FILE needs OPENENGINE_TLS_CERT_FILE and OPENENGINE_TLS_KEY_FILE"


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} cannot be read: {exc.strerror}") from None


def _file_state(paths: tuple[str, ...]) -> tuple:
    """What changes when a file is replaced, also through a symlink swap (how Kubernetes updates Secrets)."""
    state: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
            state.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            state.append(None)
    return tuple(state)


class ReloadingServerCertificate:
    """The certificate configuration fetcher of a dynamic grpc server credential."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "", variable_prefix: str = "TLS") -> None:
        if bool(cert_file) != bool(key_file):
            raise ConfigError(
                f"OPENENGINE_{variable_prefix}_CERT_FILE and OPENENGINE_{variable_prefix}_KEY_FILE must be set together"
            )
        self.paths = tuple(p for p in (cert_file, key_file, client_ca_file) if p)
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self.prefix = variable_prefix
        self._lock = threading.Lock()
        self._state = _file_state(self.paths)
        self.initial = self._configuration()

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        p = self.prefix
        chain = read_file(self.cert_file, f"OPENENGINE_{p}_CERT_FILE")
        key = read_file(self.key_file, f"OPENENGINE_{p}_KEY_FILE")
        ca = (
            read_file(
                self.client_ca_file, f"OPENENGINE_{p}_CLIENT_CA_FILE" if p == "TLS" else f"OPENENGINE_{p}_CA_FILE"
            )
            if self.client_ca_file
            else None
        )
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by grpc core before a handshake; None keeps the current configuration."""
        with self._lock:
            state = _file_state(self.paths)
            if state == self._state:
                return None
            try:
                configuration = self._configuration()
            except ConfigError as exc:  # mid-rotation (one file written, not the other): retry next handshake
                log_event(
                    logger, "TLS certificate reload failed; keeping the current one", logging.WARNING, error=str(exc)
                )
                return None
            self._state = state
            log_event(logger, "TLS certificate reloaded", cert_file=self.cert_file)
            return configuration

    def credentials(self) -> grpc.ServerCredentials:
        # grpcio keeps the configuration it has when the fetcher returns None; the stub does not allow None
        fetcher = cast("Callable[[], grpc.ServerCertificateConfiguration]", self)
        return grpc.dynamic_ssl_server_credentials(
            self.initial, fetcher, require_client_authentication=bool(self.client_ca_file)
        )


def channel_credentials(
    ca_file: str = "", cert_file: str = "", key_file: str = "", variable_prefix: str = "TLS"
) -> grpc.ChannelCredentials:
    """Client TLS: `ca_file` verifies the server (empty: the system roots); cert/key present a client certificate."""
    if bool(cert_file) != bool(key_file):
        raise ConfigError("a client certificate needs both its certificate and its key file")
    p = variable_prefix
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca_file, f"{p} CA file") if ca_file else None,
        private_key=read_file(key_file, f"{p} key file") if key_file else None,
        certificate_chain=read_file(cert_file, f"{p} certificate file") if cert_file else None,
    )


# ---------------------------------------------------------------- internal plane (coordinator, node, frontend)


def internal_tls_enabled(config) -> bool:
    files = (config.internal_tls_cert_file, config.internal_tls_key_file, config.internal_tls_ca_file)
    if any(files) and not all(files):
        raise ConfigError(
            "internal mutual TLS needs all three of OPENENGINE_INTERNAL_TLS_CERT_FILE, "
            "OPENENGINE_INTERNAL_TLS_KEY_FILE and OPENENGINE_INTERNAL_TLS_CA_FILE"
        )
    return all(files)


def check_internal_tls(config) -> None:
    """At start: internal TLS is all three files or none, and they can be read (ConfigError otherwise)."""
    if internal_tls_enabled(config):
        ReloadingServerCertificate(
            config.internal_tls_cert_file,
            config.internal_tls_key_file,
            config.internal_tls_ca_file,
            variable_prefix="INTERNAL_TLS",
        )


def add_internal_port(server, address: str, config) -> None:
    """Binds an internal server: mutual TLS (client certificates signed by the internal CA required) or plaintext."""
    if internal_tls_enabled(config):
        fetcher = ReloadingServerCertificate(
            config.internal_tls_cert_file,
            config.internal_tls_key_file,
            config.internal_tls_ca_file,
            variable_prefix="INTERNAL_TLS",
        )
        server.add_secure_port(address, fetcher.credentials())
    else:
        server.add_insecure_port(address)


# gRPC's default reconnection backoff grows to 120 s: after a coordinator outage of a minute, its nodes and
# frontends would come back up to a minute after it. Internal peers are few and close; they retry every 2 s at most.
INTERNAL_CHANNEL_OPTIONS = (("grpc.max_reconnect_backoff_ms", 2_000),)


def internal_channel(address: str, config, options=()) -> grpc.aio.Channel:
    """A grpc.aio channel to another component, presenting this component's certificate when internal TLS is on
    (re-read when its files change: `ReloadingChannel`)."""
    options = [*INTERNAL_CHANNEL_OPTIONS, *options]
    if not internal_tls_enabled(config):
        return grpc.aio.insecure_channel(address, options=options)
    if config.internal_tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.internal_tls_server_name))

    def open_channel() -> grpc.aio.Channel:
        credentials = channel_credentials(
            config.internal_tls_ca_file,
            config.internal_tls_cert_file,
            config.internal_tls_key_file,
            variable_prefix="OPENENGINE_INTERNAL_TLS",
        )
        return grpc.aio.secure_channel(address, credentials, options=options)

    paths = (config.internal_tls_cert_file, config.internal_tls_key_file, config.internal_tls_ca_file)
    return cast(grpc.aio.Channel, ReloadingChannel(open_channel, paths))  # it forwards the channel's calls


class ReloadingChannel:
    """A grpc.aio channel whose TLS files (client certificate, key, CA) are re-read when they change.

    grpcio has no client credentials that reload, so when a file changed (checked at most every
    CHECK_INTERVAL_S, on the next call) calls from then on go out on a new channel built from the files, whose
    connections present the new certificate. Calls already open stay on the channel they started on: retired
    channels are closed with this one. Stubs keep the multi-callables they were given; those follow the current
    channel on each call. A file read mid-rotation (certificate and key written one after the other) is read
    again at the next change."""

    CHECK_INTERVAL_S = 1.0

    def __init__(self, open_channel: Callable[[], grpc.aio.Channel], paths: tuple[str, ...]) -> None:
        self._open_channel = open_channel
        self._paths = paths
        self._state = _file_state(paths)
        self._channel = open_channel()
        self._retired: list[grpc.aio.Channel] = []
        self._checked_at = time.monotonic()

    def current(self) -> grpc.aio.Channel:
        """The channel new calls use, rebuilt first when a file changed."""
        now = time.monotonic()
        if now - self._checked_at < self.CHECK_INTERVAL_S:
            return self._channel
        self._checked_at = now
        state = _file_state(self._paths)
        if state != self._state:
            try:
                channel = self._open_channel()
            except ConfigError as exc:  # a file missing mid-rotation: keep the current one, try at the next check
                log_event(
                    logger,
                    "internal TLS client reload failed; keeping the current files",
                    logging.WARNING,
                    error=str(exc),
                )
                return self._channel
            self._state = state
            self._retired.append(self._channel)
            self._channel = channel
            log_event(logger, "internal TLS client certificate reloaded", cert_file=self._paths[0])
        return self._channel

    def unary_unary(self, *args, **kwargs):
        return _FollowingMultiCallable(self, "unary_unary", args, kwargs)

    def unary_stream(self, *args, **kwargs):
        return _FollowingMultiCallable(self, "unary_stream", args, kwargs)

    def stream_unary(self, *args, **kwargs):
        return _FollowingMultiCallable(self, "stream_unary", args, kwargs)

    def stream_stream(self, *args, **kwargs):
        return _FollowingMultiCallable(self, "stream_stream", args, kwargs)

    async def close(self, grace: float | None = None) -> None:
        for channel in (*self._retired, self._channel):
            await channel.close(grace)

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def __getattr__(self, name: str):
        return getattr(self.current(), name)  # get_state, channel_ready, wait_for_state_change


class _FollowingMultiCallable:
    """A stub's multi-callable on a ReloadingChannel: each call goes out on the channel current at that time."""

    __slots__ = ("_owner", "_kind", "_args", "_kwargs", "_channel", "_callable")

    def __init__(self, owner: ReloadingChannel, kind: str, args: tuple, kwargs: dict) -> None:
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs
        self._channel = owner.current()
        self._callable = getattr(self._channel, kind)(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        channel = self._owner.current()
        if channel is not self._channel:
            self._channel = channel
            self._callable = getattr(channel, self._kind)(*self._args, **self._kwargs)
        return self._callable(*args, **kwargs)


def add_public_port(server, address: str, config) -> None:
    """The frontend's public port: TLS (mutual when a client CA is set) or plaintext."""
    if config.tls_cert_file or config.tls_key_file:
        fetcher = ReloadingServerCertificate(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
        server.add_secure_port(address, fetcher.credentials())
    elif config.tls_client_ca_file:
        raise ConfigError(CLIENT_CA_ALONE)
    else:
        server.add_insecure_port(address)


def check_public_tls(config, grpc_server: str) -> None:
    """At start, before anything heavy: the TLS files are readable, and the selected server can serve TLS."""
    if not (config.tls_cert_file or config.tls_key_file or config.tls_client_ca_file):
        return
    if grpc_server == "pygrpc-native":
        raise NativeTlsConflict(NATIVE_TLS_CONFLICT)
    if not (config.tls_cert_file or config.tls_key_file):
        raise ConfigError(CLIENT_CA_ALONE)
    ReloadingServerCertificate(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)


class NativeTlsConflict(ConfigError):
    """pygrpc-native selected with TLS configured."""
