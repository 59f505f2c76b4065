"""OPENENGINE_MAX_CONNECTION_AGE_S on pygrpc-native: make clients on old connections move.

grpcio sends GOAWAY at the age (grpc.max_connection_age_ms). pygrpc-native 0.5 has no GOAWAY, connection age,
idle timeout or per-connection close, so the frontend does it from Python, per connection (gRPC peer
address):
1. a connection is aged once its first call seen here is older than the age;
2. from then on, new calls on it are refused with UNAVAILABLE before anything starts (retry-safe: the
   client's retry, or the project's client reconnecting, goes elsewhere); calls already open run to their end.
   A refusal is held until the connection is closed (at most REFUSAL_HOLD_S): answered at once, a client's
   retry policy could spend all its attempts on this connection before step 3 closes it on a busy machine.
   A refusal that is still held when the connection closes reaches its client as the connection's end
   (UNAVAILABLE too);
3. once it has no open call, QUIET_S without one, and no unread bytes of a call arriving, its socket is
   shut down. The client sees the connection end (no GOAWAY), reconnects, and is balanced anew (a
   Service's new connection, or a `dns:///` client re-resolving).
Shutting down a socket the Rust server owns is what a client's disconnect looks like to it: it ends the
connection normally.
Neither half works alone: under steady load a connection is never quiet long enough to be closed safely
(a response handed to the Rust side may not have reached the kernel yet), and a refusal alone leaves the
connection up, so a standard client's retry lands on it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
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

QUIET_S = 0.05  # no call on the connection this long: the last response has left the process
RESCAN_S = 0.2  # a connection aged before the table knew it waits at most this for a fresh look
REFUSAL_HOLD_S = 1.0  # a refused call waits at most this for its connection to close
FORGET_CLOSED_S = 5.0  # a closed connection's calls that were already on their way are still refused this long
REFUSAL = (
    "this connection is older than OPENENGINE_MAX_CONNECTION_AGE_S and is being closed; the call was "
    "not started: retry it on a new connection"
)


@dataclass
class _Connection:
    first_call: float
    last_activity: float
    open_calls: int = 0
    closed_at: float = 0.0
    closed: asyncio.Event | None = None  # made when a refusal first waits for the close


class ConnectionAges:
    """The sweep is event-driven: each connection is looked at when it can first be due (its age), then when its
    last open call has ended and again after each quiet spell; between those moments, and with no connection,
    it sleeps. Calls cost a dictionary update, nothing per message."""

    def __init__(self, max_age_s: float, local_port: int, clock=time.monotonic) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._connections: dict[str, _Connection] = {}
        self._sockets = PeerSockets(local_port, clock)
        self._checks: list[tuple[float, str]] = []  # heap of (when, peer): when a connection may be due
        self._sooner: asyncio.Event | None = None  # set when a check earlier than the sweep's next wake-up is added

    def _check_at(self, when: float, peer: str) -> None:
        if not self._checks or when < self._checks[0][0]:
            if self._sooner is not None:
                self._sooner.set()
        heapq.heappush(self._checks, (when, peer))

    def open(self, peer: str) -> bool:
        """A call starts on `peer`'s connection; False: refuse it (the connection is aged or closed)."""
        now = self._clock()
        connection = self._connections.get(peer)
        if connection is None:
            connection = self._connections[peer] = _Connection(now, now)
            self._check_at(now + self.max_age_s, peer)
        if connection.closed_at or now >= connection.first_call + self.max_age_s:
            # not activity: a client calling again at once must not keep its connection from closing
            return False
        connection.last_activity = now
        connection.open_calls += 1
        return True

    async def hold_refusal(self, peer: str, hold_s: float = REFUSAL_HOLD_S) -> None:
        """Waits until `peer`'s connection, whose call `open` refused, is closed (at most `hold_s`)."""
        connection = self._connections.get(peer)
        if connection is None or connection.closed_at:
            return
        if connection.closed is None:
            connection.closed = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(connection.closed.wait(), hold_s)

    def close(self, peer: str) -> None:
        """The call `open` admitted has ended."""
        connection = self._connections.get(peer)
        if connection is not None:
            connection.open_calls -= 1
            connection.last_activity = now = self._clock()
            if connection.open_calls <= 0 and now >= connection.first_call + self.max_age_s:
                self._check_at(now + QUIET_S, peer)

    def next_check(self) -> float | None:
        """When the sweep next has something to look at (None: nothing until a call comes)."""
        return self._checks[0][0] if self._checks else None

    def due_now(self) -> list[str]:
        """The connections to close now, of those whose check has come (see `due`)."""
        now = self._clock()
        peers = set()
        while self._checks and self._checks[0][0] <= now:
            peers.add(heapq.heappop(self._checks)[1])
        return self.due(peers)

    def due(self, peers) -> list[str]:
        """Of `peers`, the aged connections without open calls, quiet for QUIET_S; forgets long-closed ones.
        Those that are not due yet are looked at again when they can be (a connection with open calls when
        its last one ends)."""
        now = self._clock()
        due = []
        for peer in list(peers):
            connection = self._connections.get(peer)
            if connection is None:
                continue
            if connection.closed_at:
                if now >= connection.closed_at + FORGET_CLOSED_S:
                    del self._connections[peer]
                else:
                    self._check_at(connection.closed_at + FORGET_CLOSED_S, peer)
            elif now < connection.first_call + self.max_age_s:  # the same sums as the checks' times
                self._check_at(connection.first_call + self.max_age_s, peer)
            elif connection.open_calls <= 0:
                if now >= connection.last_activity + QUIET_S:
                    due.append(peer)
                else:
                    self._check_at(connection.last_activity + QUIET_S, peer)
        return due

    async def sweep_loop(self) -> None:
        self._sooner = asyncio.Event()
        while True:
            when = self.next_check()
            if when is None:
                await self._sooner.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._sooner.wait(), max(0.0, when - self._clock()))
            self._sooner.clear()
            due = self.due_now()
            if due:
                self.sweep(due)

    def sweep(self, due: list[str]) -> None:
        found, gone = self._sockets.find(due)
        for peer in gone:  # the client has left already
            self._mark_closed(peer)
        for peer, sock in found.items():
            if not shut_down_unless_reading(sock):  # a call arriving: look again after another quiet spell
                self._connections[peer].last_activity = now = self._clock()
                self._check_at(now + QUIET_S, peer)
                continue
            self._mark_closed(peer)
            metrics.CONNECTIONS_MOVED.inc()
            log_event(logger, "connection closed at its maximum age", logging.DEBUG, peer=peer)
        for peer in set(due) - set(found) - set(gone):  # its socket not found yet: the next allowed look
            self._check_at(self._clock() + RESCAN_S, peer)

    def _mark_closed(self, peer: str) -> None:
        connection = self._connections[peer]
        connection.closed_at = now = self._clock()
        if connection.closed is not None:
            connection.closed.set()  # the held refusals end
        self._check_at(now + FORGET_CLOSED_S, peer)


class PeerSockets:
    """Finds this process's TCP sockets accepted on `local_port`, by gRPC peer. The Rust server holds the
    originals; a duplicate's shutdown shuts the connection down. Looking through every file descriptor costs
    a few system calls each, so it happens on demand at most every RESCAN_S; in between,
    descriptors found are reused after checking they still are the same connection."""

    def __init__(self, local_port: int, clock=time.monotonic) -> None:
        self.local_port = local_port
        self._clock = clock
        self._fds: dict[tuple[str, int], int] = {}
        self._scanned_at = float("-inf")

    def find(self, peers: list[str]) -> tuple[dict[str, socket.socket], list[str]]:
        """(duplicates of the sockets found, peers that have no socket any more); peers neither found nor known
        gone wait for the next allowed look."""
        found: dict[str, socket.socket] = {}
        missing, gone = [], []
        for peer in peers:
            address = peer_address(peer)
            sock = self._open(self._fds.get(address), address) if address else None
            if sock is not None:
                found[peer] = sock
            elif address is None:
                gone.append(peer)  # not a TCP client: nothing to close
            else:
                missing.append(peer)
        if not missing or self._clock() - self._scanned_at < RESCAN_S:
            return found, gone
        self.scan()
        for peer in missing:
            address = peer_address(peer)
            assert address is not None  # a missing peer is a TCP client
            sock = self._open(self._fds.get(address), address)
            if sock is None:
                gone.append(peer)
            else:
                found[peer] = sock
        return found, gone

    def addresses(self) -> set[tuple[str, int]]:
        """The client addresses of the connections found by the last scan."""
        return set(self._fds)

    def open_address(self, address: tuple[str, int]) -> socket.socket | None:
        """A duplicate of the socket of the connection from `address`, if the last scan found it and it is open."""
        return self._open(self._fds.get(address), address)

    def _open(self, fd: int | None, address) -> socket.socket | None:
        """A duplicate of `fd` if it still is the connection from `address`."""
        if fd is None:
            return None
        sock = _duplicate(fd)
        if sock is not None and self._address_of(sock) == address:
            return sock
        if sock is not None:
            sock.close()
        self._fds.pop(address, None)
        return None

    def scan(self) -> None:
        self._scanned_at = self._clock()
        self._fds = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    continue
            except OSError:
                continue
            sock = _duplicate(int(name))
            if sock is None:
                continue
            address = self._address_of(sock)
            sock.close()
            if address is not None:
                self._fds[address] = int(name)

    def _address_of(self, sock: socket.socket) -> tuple[str, int] | None:
        try:
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.type == socket.SOCK_STREAM
                and sock.getsockname()[1] == self.local_port
            ):
                return _normalized(sock.getpeername())
        except OSError:
            pass  # a listener, or not connected
        return None


def _duplicate(fd: int) -> socket.socket | None:
    try:
        return socket.socket(fileno=os.dup(fd))
    except OSError:
        return None


def shut_down_unless_reading(sock: socket.socket) -> bool:
    """Shuts down the connection of `sock` (a duplicate, closed here) unless bytes of a call are arriving;
    True when it is shut (or was closed already)."""
    try:
        if _unread(sock):
            return False
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed meanwhile
    finally:
        sock.close()  # our duplicate only
    return True


def _unread(sock: socket.socket) -> bool:
    """Bytes of a call arriving that the server has not read yet (SIOCINQ). Bytes already queued to send are
    still delivered after a shutdown, before the FIN."""
    buffer = bytearray(struct.pack("i", 0))
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buffer)
    return struct.unpack("i", buffer)[0] > 0


def peer_address(peer: str) -> tuple[str, int] | None:
    """gRPC's peer string ("ipv4:10.1.2.3:5000", "ipv6:[::1]:5000") as (host, port)."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = address.rpartition(":")
    return _normalized((host.strip("[]"), int(port)))


def _normalized(address) -> tuple[str, int]:
    host = address[0]
    return (host[7:] if host.startswith("::ffff:") else host), address[1]
