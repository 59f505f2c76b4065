"""A minimal HTTP/2 gRPC client for the load generator's one call (`Generate`, server streaming), on the event loop.

grpc.aio wakes the load generator's event loop once per received message (its completion queue is polled by
a thread), and a wake-up costs tens of µs of CPU on some VMs (docs/benchmarks.md, "Limits on small VMs").
This client parses frames in `data_received` and hands each gRPC message's bytes to the stream that waits for
it, with nothing in between. It implements what this call
needs and nothing more: plaintext only (h2c with prior knowledge, as grpc does), request headers as HPACK
literals (no encoder state), response headers never decoded (their end of stream is what counts: a stream
that ends without the `finished` message is an error to the caller), connection flow control (the receive
windows are opened wide once; the send window is respected), the peer's MAX_CONCURRENT_STREAMS (streams wait
for a slot), PING answered, RST_STREAM and GOAWAY failing the streams they concern, and RST_STREAM(CANCEL) sent
when a reader is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import struct

from openengine_serve.common.wire import http2 as h2

EOF = object()  # what `read` returns after the last message (the caller may pass grpc.aio.EOF instead)


class StreamError(Exception):
    """The stream ended abnormally; `kind` names how (for the load generator's error counts)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class Stream:
    __slots__ = ("connection", "stream_id", "request", "messages", "buffer", "waiter", "ended", "error")

    def __init__(self, connection: Connection, request: bytes) -> None:
        self.connection = connection
        self.stream_id = 0
        self.request = request
        self.messages: collections.deque[bytes] = collections.deque()
        self.buffer = b""
        self.waiter: asyncio.Future | None = None
        self.ended = False
        self.error: str | None = None

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def feed(self, data: bytes) -> None:
        """DATA payload: whole gRPC messages (5-byte prefix each) are queued; a partial one waits for more."""
        if not self.buffer and len(data) >= 5 and int.from_bytes(data[1:5], "big") == len(data) - 5:
            self.messages.append(data[5:])  # the common case: one frame, one message
        else:
            buffer = self.buffer + data
            while len(buffer) >= 5:
                size = int.from_bytes(buffer[1:5], "big")
                if len(buffer) < 5 + size:
                    break
                self.messages.append(buffer[5 : 5 + size])
                buffer = buffer[5 + size :]
            self.buffer = buffer
        self._wake()

    def end(self, error: str | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.error = error
            self.connection.closed_stream(self)
            self._wake()

    async def read(self, eof=EOF):
        """The next message's bytes, `eof` after the last; StreamError when the stream failed."""
        while True:
            if self.messages:
                return self.messages.popleft()
            if self.ended:
                if self.error:
                    raise StreamError(self.error)
                return eof
            self.waiter = self.connection.loop.create_future()
            try:
                await self.waiter
            except asyncio.CancelledError:
                self.connection.reset(self)
                raise
            finally:
                self.waiter = None


class Connection(asyncio.Protocol):
    """One HTTP/2 connection (one TCP connection), many concurrent Generate streams."""

    def __init__(self, authority: str, path: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.loop = asyncio.get_running_loop()
        self.headers = h2.header_block(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", authority),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *metadata,
            ]
        )
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.streams: dict[int, Stream] = {}
        self.waiting: collections.deque[Stream] = collections.deque()
        self.next_id = 1
        self.max_streams = 2**31
        self.send_window = h2.DEFAULT_WINDOW
        self.unacknowledged = 0  # DATA bytes received since our last WINDOW_UPDATE
        self.failed: str | None = None
        self.settled = self.loop.create_future()  # the peer's first SETTINGS arrived

    @classmethod
    async def open(cls, target: str, path: str, metadata=()) -> Connection:
        host, _, port = target.rpartition(":")
        _, connection = await asyncio.get_running_loop().create_connection(
            lambda: cls(target, path, metadata), host.strip("[]"), int(port)
        )
        await connection.settled
        return connection

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport
        settings = struct.pack(">HIHI", h2.SETTINGS_ENABLE_PUSH, 0, h2.SETTINGS_INITIAL_WINDOW_SIZE, h2.MAX_WINDOW)
        transport.write(
            h2.PREFACE
            + h2.frame(h2.SETTINGS, 0, 0, settings)
            + h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", h2.MAX_WINDOW - h2.DEFAULT_WINDOW))
        )

    def connection_lost(self, exc) -> None:
        self._fail("connection_lost")

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        offset, size = 0, len(buffer)
        while size - offset >= h2.FRAME_HEADER_BYTES:
            length, kind, flags, stream_id = h2.frame_header(buffer, offset)
            end = offset + h2.FRAME_HEADER_BYTES + length
            if end > size:
                break
            payload = buffer[end - length : end]
            offset = end
            if kind == h2.DATA:
                self.unacknowledged += length
                stream = self.streams.get(stream_id)
                if flags & h2.PADDED:
                    payload = h2.unpadded(payload)
                if stream is not None:
                    if payload:
                        stream.feed(payload)
                    if flags & h2.END_STREAM:
                        stream.end()
            elif kind == h2.HEADERS:
                if flags & h2.END_STREAM and stream_id in self.streams:
                    self.streams[stream_id].end()
            else:
                self._control(kind, flags, stream_id, payload)
        self.buffer = buffer[offset:]
        if self.unacknowledged > h2.MAX_WINDOW // 2:
            assert self.transport is not None
            self.transport.write(h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacknowledged)))
            self.unacknowledged = 0

    def _control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        assert self.transport is not None  # frames arrive after connection_made
        if kind == h2.SETTINGS and not flags & h2.ACK:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack(">HI", payload[i : i + 6])
                if key == h2.SETTINGS_MAX_CONCURRENT_STREAMS:
                    self.max_streams = value
            self.transport.write(h2.frame(h2.SETTINGS, h2.ACK, 0))
            if not self.settled.done():
                self.settled.set_result(None)
            self._start_waiting()
        elif kind == h2.PING and not flags & h2.ACK:
            self.transport.write(h2.frame(h2.PING, h2.ACK, 0, payload))
        elif kind == h2.WINDOW_UPDATE and stream_id == 0:
            self.send_window += int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            self._start_waiting()
        elif kind == h2.RST_STREAM and stream_id in self.streams:
            self.streams[stream_id].end(f"rst_stream_{int.from_bytes(payload[:4], 'big')}")
        elif kind == h2.GOAWAY:
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            self.failed = "goaway"
            for sid in [sid for sid in self.streams if sid > last]:
                self.streams[sid].end("goaway")
            while self.waiting:
                self.waiting.popleft().end("goaway")

    # ------------------------------------------------------------ streams

    def generate(self, request: bytes, **_ignored) -> Stream:
        """Starts one call (now, or when a stream slot and send window are free); read it with `read`."""
        stream = Stream(self, request)
        if self.failed:
            stream.ended, stream.error = True, self.failed
            return stream
        self.waiting.append(stream)
        self._start_waiting()
        return stream

    def _start_waiting(self) -> None:
        while self.waiting and len(self.streams) < self.max_streams:
            stream = self.waiting[0]
            body = h2.grpc_message(stream.request)
            if len(body) > self.send_window:
                return  # the peer's next WINDOW_UPDATE starts it
            self.waiting.popleft()
            self.send_window -= len(body)
            stream.stream_id = self.next_id
            self.next_id += 2
            self.streams[stream.stream_id] = stream
            assert self.transport is not None  # streams start after the peer's SETTINGS
            self.transport.write(
                h2.frame(h2.HEADERS, h2.END_HEADERS, stream.stream_id, self.headers)
                + h2.frame(h2.DATA, h2.END_STREAM, stream.stream_id, body)
            )

    def closed_stream(self, stream: Stream) -> None:
        if self.streams.pop(stream.stream_id, None) is not None:
            self._start_waiting()

    def reset(self, stream: Stream) -> None:
        """The reader gave up: RST_STREAM(CANCEL) so the server stops the call."""
        if stream.ended:
            return
        if stream.stream_id in self.streams and self.transport is not None and not self.transport.is_closing():
            self.transport.write(h2.frame(h2.RST_STREAM, 0, stream.stream_id, struct.pack(">I", h2.CANCEL)))
        elif stream in self.waiting:
            self.waiting.remove(stream)
        stream.end("cancelled")

    def _fail(self, kind: str) -> None:
        self.failed = self.failed or kind
        for stream in list(self.streams.values()) + list(self.waiting):
            stream.end(kind)
        self.waiting.clear()
        if not self.settled.done():
            self.settled.set_exception(ConnectionError(kind))

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.write(h2.frame(h2.GOAWAY, 0, 0, struct.pack(">II", 0, 0)))
            self.transport.close()
