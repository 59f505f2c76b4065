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

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x3, 0x4
MAX_WINDOW = 2**31 - 1
CANCEL = 0x8
EOF = object()  # what `read` returns after the last message (the caller may pass grpc.aio.EOF instead)


class StreamError(Exception):
    """The stream ended abnormally; `kind` names how (for the load generator's error counts)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream_id) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def header_block(headers: list[tuple[str, str]]) -> bytes:
    """HPACK: every header a literal without indexing and with a literal name (no table on either side)."""
    out = bytearray()
    for name, value in headers:
        raw_name, raw_value = name.encode(), value.encode()
        out += b"\x00" + _hpack_int(len(raw_name), 7) + raw_name + _hpack_int(len(raw_value), 7) + raw_value
    return bytes(out)


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
        self.headers = header_block(
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
        self.send_window = 65535
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
        settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)
        transport.write(
            PREFACE
            + _frame(SETTINGS, 0, 0, settings)
            + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65535))
        )

    def connection_lost(self, exc) -> None:
        self._fail("connection_lost")

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        offset, size = 0, len(buffer)
        while size - offset >= 9:
            length = int.from_bytes(buffer[offset : offset + 3], "big")
            end = offset + 9 + length
            if end > size:
                break
            kind, flags = buffer[offset + 3], buffer[offset + 4]
            stream_id = int.from_bytes(buffer[offset + 5 : offset + 9], "big") & 0x7FFFFFFF
            payload = buffer[offset + 9 : end]
            offset = end
            if kind == DATA:
                self.unacknowledged += length
                stream = self.streams.get(stream_id)
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                if stream is not None:
                    if payload:
                        stream.feed(payload)
                    if flags & END_STREAM:
                        stream.end()
            elif kind == HEADERS:
                if flags & END_STREAM and stream_id in self.streams:
                    self.streams[stream_id].end()
            else:
                self._control(kind, flags, stream_id, payload)
        self.buffer = buffer[offset:]
        if self.unacknowledged > MAX_WINDOW // 2:
            self.transport.write(_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacknowledged)))
            self.unacknowledged = 0

    def _control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & ACK:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack(">HI", payload[i : i + 6])
                if key == SETTINGS_MAX_CONCURRENT_STREAMS:
                    self.max_streams = value
            self.transport.write(_frame(SETTINGS, ACK, 0))
            if not self.settled.done():
                self.settled.set_result(None)
            self._start_waiting()
        elif kind == PING and not flags & ACK:
            self.transport.write(_frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE and stream_id == 0:
            self.send_window += int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            self._start_waiting()
        elif kind == RST_STREAM and stream_id in self.streams:
            self.streams[stream_id].end(f"rst_stream_{int.from_bytes(payload[:4], 'big')}")
        elif kind == GOAWAY:
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
            body = b"\x00" + struct.pack(">I", len(stream.request)) + stream.request
            if len(body) > self.send_window:
                return  # the peer's next WINDOW_UPDATE starts it
            self.waiting.popleft()
            self.send_window -= len(body)
            stream.stream_id = self.next_id
            self.next_id += 2
            self.streams[stream.stream_id] = stream
            self.transport.write(
                _frame(HEADERS, END_HEADERS, stream.stream_id, self.headers)
                + _frame(DATA, END_STREAM, stream.stream_id, body)
            )

    def closed_stream(self, stream: Stream) -> None:
        if self.streams.pop(stream.stream_id, None) is not None:
            self._start_waiting()

    def reset(self, stream: Stream) -> None:
        """The reader gave up: RST_STREAM(CANCEL) so the server stops the call."""
        if stream.ended:
            return
        if stream.stream_id in self.streams and self.transport is not None and not self.transport.is_closing():
            self.transport.write(_frame(RST_STREAM, 0, stream.stream_id, struct.pack(">I", CANCEL)))
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
            self.transport.write(_frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0)))
            self.transport.close()
