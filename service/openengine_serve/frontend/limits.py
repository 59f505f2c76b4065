"""Stated limits of the public port, enforced the same way on both gRPC servers.

- request message size: the gRPC transport's own limit (`grpc.max_receive_message_length`); both servers
  answer RESOURCE_EXHAUSTED "Received message larger than max (<size> vs. <limit>)";
- request metadata size and concurrent calls per connection: checked by an interceptor, which answers
  RESOURCE_EXHAUSTED naming the knob. The transports get a backstop above these limits so that the
  interceptor's clear answer is the one clients see: twice the stream limit, and for metadata a fixed
  TRANSPORT_MAX_METADATA_BYTES (1 MiB, at least 4x the largest allowed OPENENGINE_MAX_METADATA_BYTES).
  Only a header block above that cap is refused by the transport itself, differently by the two servers
  (grpcio: RESOURCE_EXHAUSTED "received metadata size exceeds hard limit"; pygrpc-native's HTTP/2 layer:
  HTTP 431, a stream reset or a GOAWAY of the connection). The cap bounds what one connection's header
  block can hold in memory (the default request message limit is 16 times as much).
Probes (`grpc.health.v1`) and reflection are not counted.
"""

from __future__ import annotations

import collections
import inspect

import grpc

from . import metrics
from .auth import OPEN_PREFIXES, cached_wrapper, handler_kind, refusal
from .connection_age import REFUSAL, ConnectionAges

HPACK_ENTRY_OVERHEAD = 32  # bytes HTTP/2 adds per header field when it counts a header list's size
# The transports' header-list limit. Both count more than the interceptor does (pseudo-headers, HPACK
# framing), so it must stay well above the knob's maximum (config: 256 KiB).
TRANSPORT_MAX_METADATA_BYTES = 1024 * 1024


def metadata_size(metadata) -> int:
    return sum(len(k) + len(v) + HPACK_ENTRY_OVERHEAD for k, v in metadata or ())


def transport_options(config) -> tuple[tuple[str, int], ...]:
    return (
        ("grpc.max_receive_message_length", config.max_request_bytes),
        ("grpc.max_metadata_size", TRANSPORT_MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", TRANSPORT_MAX_METADATA_BYTES),
        ("grpc.max_concurrent_streams", 2 * config.max_concurrent_streams),
    )


class LimitsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self, max_metadata_bytes: int, max_concurrent_streams: int, ages: ConnectionAges | None = None
    ) -> None:
        self.max_metadata_bytes = max_metadata_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self.ages = ages  # pygrpc-native with OPENENGINE_MAX_CONNECTION_AGE_S (connection_age.py)
        self.open_calls: collections.Counter[str] = collections.Counter()  # by connection (peer address)
        # The counting wrapper of each handler, built once: the servers hand the same handler object for every
        # call of a method (and the key check one per method and key).
        self._counted_by_handler: dict = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        size = metadata_size(handler_call_details.invocation_metadata)
        if size > self.max_metadata_bytes:
            return refusal(
                handler,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request metadata is {size} bytes, over the limit of {self.max_metadata_bytes} "
                "(OPENENGINE_MAX_METADATA_BYTES)",
            )
        return cached_wrapper(self._counted_by_handler, handler, self._counted, handler)

    def _counted(self, handler):
        kind = handler_kind(handler)
        behavior = getattr(handler, kind)
        limit = self.max_concurrent_streams
        open_calls = self.open_calls
        ages = self.ages
        over = (
            f"more than {limit} concurrent calls on one connection (OPENENGINE_MAX_CONCURRENT_STREAMS); "
            "open another connection or wait for a call to end"
        )

        async def counted(request, context):
            peer = context.peer()
            if open_calls[peer] >= limit:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, over)
            if ages is not None and not ages.open(peer):
                metrics.CONNECTION_AGE_REFUSALS.inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
            open_calls[peer] += 1
            try:
                return await behavior(request, context)
            finally:
                if ages is not None:
                    ages.close(peer)
                remaining = open_calls[peer] - 1
                if remaining:
                    open_calls[peer] = remaining
                else:
                    del open_calls[peer]

        # Public handlers are coroutines (Generate writes with context.write); async generators
        # (SubscribeKvEvents) are passed through uncounted: they end at once.
        return handler._replace(**{kind: counted}) if not _is_async_gen(behavior) else handler


def _is_async_gen(behavior) -> bool:
    return inspect.isasyncgenfunction(behavior)


def interceptors(config, ages: ConnectionAges | None = None) -> tuple[LimitsInterceptor, ...]:
    return (LimitsInterceptor(config.max_metadata_bytes, config.max_concurrent_streams, ages),)
