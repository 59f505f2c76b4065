"""Stated limits of the public port, enforced the same way on both gRPC servers.

- request message size, per method: Generate's bound (`generate_message_limit`: from the request bounds) is
  the gRPC transport's own limit (`grpc.max_receive_message_length`; both servers answer RESOURCE_EXHAUSTED
  "Received message larger than max (<size> vs. <limit>)"); every other method (health, reflection,
  Control) takes SMALL_MESSAGE_BYTES, checked on the received bytes before they are parsed (`bounded`:
  neither server has a per-method limit), answered RESOURCE_EXHAUSTED naming the method and its limit;
- health Watch streams: at most OPENENGINE_MAX_HEALTH_WATCHES_PER_CONNECTION on one connection and
  OPENENGINE_MAX_HEALTH_WATCHES on the worker, keyless callers included (RESOURCE_EXHAUSTED naming the knob);
- request metadata size and concurrent calls per connection, health watches and reflection streams included:
  checked by an interceptor, which answers RESOURCE_EXHAUSTED naming the knob. The transports get a backstop
  above these limits so that the interceptor's clear answer is the one clients see: twice the stream limit,
  and for metadata a fixed TRANSPORT_MAX_METADATA_BYTES (1 MiB, at least 4x the largest allowed
  OPENENGINE_MAX_METADATA_BYTES). Only a header block above that cap is refused by the transport itself,
  differently by the two servers (grpcio: RESOURCE_EXHAUSTED "received metadata size exceeds hard limit";
  pygrpc-native's HTTP/2 layer: HTTP 431, a stream reset or a GOAWAY of the connection). The cap bounds what
  one connection's header block can hold in memory (the default request message limit is 16 times as much).
- client connections per worker (OPENENGINE_MAX_CONNECTIONS, ConnectionTable): a call on a connection
  beyond the limit is refused with RESOURCE_EXHAUSTED naming it; health probes are answered on any
  connection (a worker at its maximum must stay live and ready). Backstop at twice the limit: grpcio
  refuses the connection itself (`grpc.max_allowed_incoming_connections`: the client sees UNAVAILABLE
  "Socket closed" at once); pygrpc-native has no such option, so the frontend shuts down the sockets of
  connections beyond it that have no call admitted, within a second.
- idle connections (OPENENGINE_MAX_CONNECTION_IDLE_S): grpcio sends GOAWAY (`grpc.max_connection_idle_ms`);
  pygrpc-native has no such option, so the frontend shuts the socket down (checked every second).
pygrpc-native serves reflection through an internal grpc.aio server on a Unix socket, where the client's
address is unknown (peer "unix:"): its reflection streams of all connections together are held to the
per-connection limit, and are not counted as a connection.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import time
from dataclasses import dataclass

import grpc

from ..common.logging_setup import log_event
from . import metrics
from .auth import cached_wrapper, handler_kind, refusal
from .connection_age import REFUSAL, ConnectionAges, PeerSockets, peer_address, shut_down_unless_reading

logger = logging.getLogger("openengine_serve.frontend")

HPACK_ENTRY_OVERHEAD = 32  # bytes HTTP/2 adds per header field when it counts a header list's size
# The transports' header-list limit. Both count more than the interceptor does (pseudo-headers, HPACK
# framing), so it must stay well above the knob's maximum (config: 256 KiB).
TRANSPORT_MAX_METADATA_BYTES = 1024 * 1024


def metadata_size(metadata) -> int:
    return sum(len(k) + len(v) + HPACK_ENTRY_OVERHEAD for k, v in metadata or ())


HEALTH_PREFIX = "/grpc.health.v1.Health/"
TCP_PEERS = ("ipv4:", "ipv6:")  # gRPC peer strings of client connections (not pygrpc-native's "unix:" fallback)
SCAN_S = 1.0  # how often the connection table is checked against this process's sockets
GRPC_NO_IDLE_LIMIT_MS = 2**31 - 1  # grpc-core's "infinite" for grpc.max_connection_idle_ms


GENERATE_METHOD = "/openengine.v1.Inference/Generate"
WATCH_METHOD = "/grpc.health.v1.Health/Watch"
SMALL_MESSAGE_BYTES = 4096  # every request message but Generate's: a health service, a model name, a request id
DEFAULT_MAX_PROMPT_BYTES = 512 * 1024  # a text prompt's bound when OPENENGINE_MAX_PROMPT_BYTES is 0 (at most)
STOP_TEXT_BYTES = 4096  # validation.MAX_STOP_TEXT_BYTES
OTHER_FIELDS_BYTES = 65536  # request id (1 KiB), cache salt, model, candidates, stop ids, protobuf framing: slack


def generate_message_limit(config) -> int:
    """OPENENGINE_MAX_REQUEST_BYTES, or derived from what a Generate request may legitimately carry: its text
    prompt (a token-id prompt is smaller: at most 3 bytes an id below 2^21), its guide, its stop text and the
    rest (644 KiB with the default settings)."""
    if config.max_request_bytes:
        return config.max_request_bytes
    prompt = config.max_prompt_bytes or DEFAULT_MAX_PROMPT_BYTES
    return prompt + config.max_guide_bytes + STOP_TEXT_BYTES + OTHER_FIELDS_BYTES


def transport_options(config) -> tuple[tuple[str, int], ...]:
    return (
        ("grpc.max_receive_message_length", generate_message_limit(config)),
        ("grpc.max_metadata_size", TRANSPORT_MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", TRANSPORT_MAX_METADATA_BYTES),
        ("grpc.max_concurrent_streams", 2 * config.max_concurrent_streams),
    )


def grpcio_transport_options(config) -> tuple[tuple[str, int], ...]:
    """The connection limits grpcio enforces itself (pygrpc-native rejects these options: ConnectionTable)."""
    idle_ms = round(config.max_connection_idle_s * 1000) or GRPC_NO_IDLE_LIMIT_MS
    return (
        ("grpc.max_allowed_incoming_connections", 2 * config.max_connections),
        ("grpc.max_connection_idle_ms", min(idle_ms, GRPC_NO_IDLE_LIMIT_MS)),
    )


@dataclass
class _Client:
    seen_at: float
    last_activity: float  # a call started or ended
    admitted: bool = False
    open_calls: int = 0


class ConnectionTable:
    """This worker's client connections, by gRPC peer: at most `max_connections` get calls admitted. Every
    SCAN_S the table is checked against the process's sockets (in a thread: it reads every descriptor), which
    frees the places of connections that have gone. With `closes` (pygrpc-native, which has neither a
    connection limit nor an idle timeout) connections idle for `idle_s`, and those beyond twice the limit that
    have no call admitted, are shut down."""

    def __init__(
        self, max_connections: int, idle_s: float, local_port: int, closes: bool, clock=time.monotonic
    ) -> None:
        self.max_connections = max_connections
        self.idle_s = idle_s
        self.closes = closes
        self._clock = clock
        self._clients: dict[str, _Client] = {}
        self._admitted = 0
        self._sockets = PeerSockets(local_port, clock)
        self._first_seen: dict[tuple[str, int], float] = {}  # sockets on which no call has come yet
        self.refusal = (
            f"this frontend worker serves its maximum of {max_connections} client connections "
            "(OPENENGINE_MAX_CONNECTIONS); retry later or on another frontend"
        )

    def call_started(self, peer: str, capped: bool = True) -> bool:
        """False: `peer` is a connection beyond max_connections; refuse the call. A call that is not `capped`
        (a health probe) is never refused: it counts as activity only."""
        now = self._clock()
        client = self._clients.get(peer)
        if client is None:
            client = self._clients[peer] = _Client(now, now)
        if capped and not client.admitted:
            if self._admitted >= self.max_connections:
                return False
            client.admitted = True
            self._admitted += 1
        client.open_calls += 1
        client.last_activity = now
        return True

    def call_ended(self, peer: str) -> None:
        client = self._clients.get(peer)
        if client is not None:
            client.open_calls -= 1
            client.last_activity = self._clock()

    async def sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SCAN_S)
            scanned_at = self._clock()
            await asyncio.to_thread(self._sockets.scan)
            self.sweep(self._sockets.addresses(), scanned_at)

    def sweep(self, live: set[tuple[str, int]], scanned_at: float) -> None:
        """Forgets connections that are gone; with `closes`, shuts down the idle ones and those beyond the
        backstop."""
        by_address: dict[tuple[str, int], str] = {}
        for peer, client in list(self._clients.items()):
            address = peer_address(peer)
            if address in live:
                by_address[address] = peer
            elif client.seen_at < scanned_at and client.open_calls <= 0:  # known before the scan: gone
                del self._clients[peer]
                self._admitted -= client.admitted
        self._first_seen = {a: self._first_seen.get(a, scanned_at) for a in live if a not in by_address}
        if self.closes:
            self._close(by_address, scanned_at)

    def _close(self, by_address: dict[tuple[str, int], str], now: float) -> None:
        idle = []
        if self.idle_s:
            idle = [a for a, seen in self._first_seen.items() if now - seen >= self.idle_s]
            idle += [
                address
                for address, peer in by_address.items()
                if self._clients[peer].open_calls <= 0 and now - self._clients[peer].last_activity >= self.idle_s
            ]
        excess = len(self._first_seen) + len(by_address) - 2 * self.max_connections
        beyond = []
        if excess > 0:
            refused = [a for a, peer in by_address.items() if not self._clients[peer].admitted]
            beyond = [a for a in [*self._first_seen, *refused] if a not in idle][:excess]
        for address in idle + beyond:
            sock = self._sockets.open_address(address)
            if sock is not None and shut_down_unless_reading(sock):
                reason = "idle" if address in idle else "beyond twice OPENENGINE_MAX_CONNECTIONS"
                log_event(
                    logger, "client connection closed", logging.DEBUG, peer=f"{address[0]}:{address[1]}", reason=reason
                )


class _TooLarge:
    """What `bounded`'s deserializer hands the handler instead of a message over its method's limit."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


def bounded(handler, method: str, limit: int):
    """The handler with its request messages held to `limit` bytes: a larger one is never parsed, and the call
    is refused (RESOURCE_EXHAUSTED) naming the method and the limit."""
    deserialize = handler.request_deserializer
    kind = handler_kind(handler)
    behavior = getattr(handler, kind)

    def checked(data: bytes):
        if len(data) > limit:
            return _TooLarge(len(data))
        return deserialize(data) if deserialize is not None else data

    def message(request: _TooLarge) -> str:
        return f"request message is {request.size} bytes, over the limit of {limit} bytes for {method}"

    def refuse(request: _TooLarge, context) -> None:
        # The call ends with this status when the handler returns (grpc.aio keeps memory of aborted calls).
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details(message(request))

    if kind in ("stream_unary", "stream_stream"):  # reflection: every message of the stream is checked

        async def each(requests, context):
            async for request in requests:
                if type(request) is _TooLarge:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message(request))
                yield request

        if inspect.isasyncgenfunction(behavior):

            async def guarded(requests, context):
                async for response in behavior(each(requests, context), context):
                    yield response
        else:

            async def guarded(requests, context):
                return await behavior(each(requests, context), context)
    elif inspect.isasyncgenfunction(behavior):

        async def guarded(request, context):
            if type(request) is _TooLarge:
                refuse(request, context)
                return
            async for response in behavior(request, context):
                yield response
    else:

        async def guarded(request, context):
            if type(request) is _TooLarge:
                return refuse(request, context)
            return await behavior(request, context)

    return handler._replace(request_deserializer=checked, **{kind: guarded})


class LimitsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        max_metadata_bytes: int,
        max_concurrent_streams: int,
        ages: ConnectionAges | None = None,
        connections: ConnectionTable | None = None,
        max_watches: int = 64,
        max_watches_per_connection: int = 4,
    ) -> None:
        self.max_metadata_bytes = max_metadata_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self.max_watches = max_watches
        self.max_watches_per_connection = max_watches_per_connection
        self.watches: collections.Counter[str] = collections.Counter()  # health Watch streams, by connection
        self._bounded_by_handler: dict = {}
        self.ages = ages  # pygrpc-native with OPENENGINE_MAX_CONNECTION_AGE_S (connection_age.py)
        self.connections = connections
        self.open_calls: collections.Counter[str] = collections.Counter()  # by connection (peer address)
        self._too_many_streams = (
            f"more than {max_concurrent_streams} concurrent calls on one connection "
            "(OPENENGINE_MAX_CONCURRENT_STREAMS); open another connection or wait for a call to end"
        )
        # The counting wrapper of each handler, built once: the servers hand the same handler object for every
        # call of a method (and the key check one per method and key).
        self._counted_by_handler: dict = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        size = metadata_size(handler_call_details.invocation_metadata)
        if size > self.max_metadata_bytes:
            return refusal(
                handler,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request metadata is {size} bytes, over the limit of {self.max_metadata_bytes} "
                "(OPENENGINE_MAX_METADATA_BYTES)",
            )
        # Probes are not held to the connection limit: a worker serving its maximum must still answer its
        # kubelet (each probe comes on a connection of its own). The backstop bounds their connections.
        method = handler_call_details.method
        capped = not method.startswith(HEALTH_PREFIX)
        if method != GENERATE_METHOD:
            handler = cached_wrapper(self._bounded_by_handler, handler, bounded, handler, method, SMALL_MESSAGE_BYTES)
        if method == WATCH_METHOD:
            return self._watch(handler)
        return cached_wrapper(self._counted_by_handler, handler, self._counted, handler, capped)

    def _watch(self, handler):
        """A health Watch: counted with every call of its connection, then per connection and per worker among
        the watches."""
        watch = cached_wrapper(self._counted_by_handler, handler, self._watch_counted, handler)
        return cached_wrapper(self._counted_by_handler, watch, self._counted, watch, False)

    def _watch_counted(self, handler):
        behavior = handler.unary_stream
        watches = self.watches

        async def watch(request, context):
            peer = context.peer()
            if watches[peer] >= self.max_watches_per_connection:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"more than {self.max_watches_per_connection} health Watch streams on one connection "
                    "(OPENENGINE_MAX_HEALTH_WATCHES_PER_CONNECTION); close one, or poll with Check",
                )
            if watches.total() >= self.max_watches:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this frontend worker has its maximum of {self.max_watches} health Watch streams open "
                    "(OPENENGINE_MAX_HEALTH_WATCHES); poll with Check",
                )
            watches[peer] += 1
            try:
                await behavior(request, context)  # grpc_health's Watch writes with context.write
            finally:
                watches[peer] -= 1
                if not watches[peer]:
                    del watches[peer]

        return handler._replace(unary_stream=watch)

    async def _start(self, peer: str, context, capped: bool) -> None:
        """Counts a call on `peer`'s connection, or aborts it (RESOURCE_EXHAUSTED, UNAVAILABLE when aged)."""
        tcp = peer.startswith(TCP_PEERS)
        connections = self.connections if tcp else None
        if connections is not None and not connections.call_started(peer, capped):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, connections.refusal)
        if self.open_calls[peer] >= self.max_concurrent_streams:
            if connections is not None:
                connections.call_ended(peer)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self._too_many_streams)
        if self.ages is not None and tcp and not self.ages.open(peer):
            if connections is not None:
                connections.call_ended(peer)
            metrics.CONNECTION_AGE_REFUSALS.inc()
            await self.ages.hold_refusal(peer)
            await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
        self.open_calls[peer] += 1

    def _end(self, peer: str) -> None:
        if peer.startswith(TCP_PEERS):
            if self.ages is not None:
                self.ages.close(peer)
            if self.connections is not None:
                self.connections.call_ended(peer)
        remaining = self.open_calls[peer] - 1
        if remaining:
            self.open_calls[peer] = remaining
        else:
            del self.open_calls[peer]

    def _counted(self, handler, capped: bool):
        kind = handler_kind(handler)
        behavior = getattr(handler, kind)
        start, end = self._start, self._end

        if inspect.isasyncgenfunction(behavior):  # e.g. reflection's stream

            async def counted(request, context):
                peer = context.peer()
                await start(peer, context, capped)
                try:
                    async for response in behavior(request, context):
                        yield response
                finally:
                    end(peer)

        else:  # a coroutine (Generate writes with context.write, Health.Watch too)

            async def counted(request, context):
                peer = context.peer()
                await start(peer, context, capped)
                try:
                    return await behavior(request, context)
                finally:
                    end(peer)

        return handler._replace(**{kind: counted})


def interceptors(
    config, ages: ConnectionAges | None = None, connections: ConnectionTable | None = None
) -> tuple[LimitsInterceptor, ...]:
    return (
        LimitsInterceptor(
            config.max_metadata_bytes,
            config.max_concurrent_streams,
            ages,
            connections,
            config.max_health_watches,
            config.max_health_watches_per_connection,
        ),
    )
