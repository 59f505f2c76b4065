"""OPENENGINE_MAX_CONNECTION_AGE_S on pygrpc-native: make clients on old connections move.

grpcio sends GOAWAY at the age (grpc.max_connection_age_ms). pygrpc-native 0.5 has no GOAWAY, connection age,
idle timeout or per-connection close, so the frontend does it from Python, per connection (gRPC peer
address):
1. a connection is aged once its first call seen here is older than the age;
2. from then on, new calls on it are refused with UNAVAILABLE before anything starts (retry-safe: the
   client's retry, or the project's client reconnecting, goes elsewhere); calls already open run to their end;
3. once it has no open call, nothing unread or unsent in the kernel, and QUIET_S without a call, its socket
   is shut down. The client sees the connection end (no GOAWAY), reconnects, and is balanced anew (a
   Service's new connection, or a `dns:///` client re-resolving).
Shutting down a socket the Rust server owns is what a client's disconnect looks like to it: it ends the
connection normally.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from dataclasses import dataclass

from ..common.logging_setup import log_event
from . import metrics

logger = logging.getLogger("openengine_serve.frontend")

QUIET_S = 0.05         # no call on the connection this long: the last response has left the process
SWEEP_S = 0.05         # how often aged connections are checked
FORGET_CLOSED_S = 5.0  # a closed connection's calls that were already on their way are still refused this long
REFUSAL = ("this connection is older than OPENENGINE_MAX_CONNECTION_AGE_S and is being closed; the call was "
           "not started: retry it on a new connection")


@dataclass
class _Connection:
    first_call: float
    last_activity: float
    open_calls: int = 0
    closed_at: float = 0.0


class ConnectionAges:
    def __init__(self, max_age_s: float, local_port: int, clock=time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.local_port = local_port
        self._clock = clock
        self._connections: dict[str, _Connection] = {}

    def open(self, peer: str) -> bool:
        """A call starts on `peer`'s connection; False: refuse it (the connection is aged or closed)."""
        now = self._clock()
        connection = self._connections.get(peer)
        if connection is None:
            connection = self._connections[peer] = _Connection(now, now)
        if connection.closed_at or now - connection.first_call >= self.max_age_s:
            # not activity: a client calling again at once must not keep its connection from closing
            return False
        connection.last_activity = now
        connection.open_calls += 1
        return True

    def close(self, peer: str) -> None:
        """The call `open` admitted has ended."""
        connection = self._connections.get(peer)
        if connection is not None:
            connection.open_calls -= 1
            connection.last_activity = self._clock()

    def due(self) -> list[str]:
        """Aged connections without open calls, quiet for QUIET_S; forgets long-closed ones."""
        now = self._clock()
        due = []
        for peer, connection in list(self._connections.items()):
            if connection.closed_at:
                if now - connection.closed_at >= FORGET_CLOSED_S:
                    del self._connections[peer]
            elif (now - connection.first_call >= self.max_age_s and connection.open_calls <= 0
                  and now - connection.last_activity >= QUIET_S):
                due.append(peer)
        return due

    def mark_closed(self, peer: str) -> None:
        self._connections[peer].closed_at = self._clock()

    def keep_open(self, peer: str) -> None:
        """Bytes were still in flight: look again after another quiet spell."""
        self._connections[peer].last_activity = self._clock()

    async def sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            due = self.due()
            if due:
                self.sweep(due)

    def sweep(self, due: list[str]) -> None:
        sockets = _sockets_by_peer(self.local_port, set(due))
        for peer in due:
            sock = sockets.pop(peer, None)
            if sock is None:        # the client has gone already
                self.mark_closed(peer)
                continue
            try:
                if _unread_or_unsent(sock):
                    self.keep_open(peer)
                    continue
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass                # closed meanwhile
            finally:
                sock.close()        # our duplicate only
            self.mark_closed(peer)
            metrics.CONNECTIONS_MOVED.inc()
            log_event(logger, "connection closed at its maximum age", logging.DEBUG, peer=peer)
        for sock in sockets.values():
            sock.close()


def _unread_or_unsent(sock: socket.socket) -> bool:
    """A request arriving (bytes the server has not read yet) or a response still leaving."""
    buffer = bytearray(struct.pack("i", 0))
    for request in (termios.FIONREAD, termios.TIOCOUTQ):  # SIOCINQ, SIOCOUTQ
        fcntl.ioctl(sock.fileno(), request, buffer)
        if struct.unpack("i", buffer)[0]:
            return True
    return False


def peer_address(peer: str) -> tuple[str, int] | None:
    """gRPC's peer string ("ipv4:10.1.2.3:5000", "ipv6:[::1]:5000") as (host, port)."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = address.rpartition(":")
    return _normalized((host.strip("[]"), int(port)))


def _sockets_by_peer(local_port: int, peers: set[str]) -> dict[str, socket.socket]:
    """Duplicates of this process's TCP sockets accepted on `local_port` from `peers` (the Rust server holds
    the originals; shutting down a duplicate shuts down the connection)."""
    wanted = {address: peer for peer in peers if (address := peer_address(peer)) is not None}
    found: dict[str, socket.socket] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        peer = None
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM \
                    and sock.getsockname()[1] == local_port:
                peer = wanted.get(_normalized(sock.getpeername()))
        except OSError:
            pass                    # a listener, or not connected
        if peer is None:
            sock.close()
        else:
            found[peer] = sock
    return found


def _normalized(address) -> tuple[str, int]:
    host = address[0]
    return (host[7:] if host.startswith("::ffff:") else host), address[1]
