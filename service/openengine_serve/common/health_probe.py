"""One `grpc.health.v1.Health/Check` call over plain HTTP/2 with the standard library only.

Healthchecks run every few seconds in every container; importing grpcio alone costs
~0.2 s of CPU, this costs almost nothing. It sends the same request grpcio would
(h2c, one stream, `te: trailers`, a grpc-timeout) and reads the response message.
It does not decode response headers (HPACK): a response message is what a
successful Check returns, so a well-formed message gives the ServingStatus, and
anything else (trailers-only error such as NOT_FOUND for an unknown service,
RST_STREAM, GOAWAY, a target it cannot dial itself) raises `ProbeInconclusive`,
after which the caller asks grpcio, which names the failure.
"""

from __future__ import annotations

import socket
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
FLAG_END_STREAM = FLAG_ACK = 0x1
FLAG_END_HEADERS, FLAG_PADDED = 0x4, 0x8
STREAM_ID = 1
CHECK_PATH = "/grpc.health.v1.Health/Check"
SERVING = 1
STATUS_NAMES = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")
MAX_FRAME_BYTES = 1 << 20


class ProbeInconclusive(Exception):
    """No well-formed Check response (or a target this probe cannot dial): ask grpcio instead."""


def status_name(status: int) -> str:
    return STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else str(status)


def check(target: str, service: str, timeout: float) -> int:
    """The ServingStatus the target answers for `service`. Raises TimeoutError when it does not answer in
    time, OSError when it cannot be reached, ProbeInconclusive otherwise."""
    host, port = split_target(target)
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", CHECK_PATH),
            (":authority", target.removeprefix("dns:///")),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("grpc-timeout", f"{max(1, min(int(timeout * 1000), 99_999_999))}m"),
        ]
        request = _protobuf_string(1, service.encode())
        sock.sendall(
            PREFACE
            + _frame(SETTINGS, 0, 0, b"")
            + _frame(HEADERS, FLAG_END_HEADERS, STREAM_ID, b"".join(_hpack_literal(n, v) for n, v in headers))
            + _frame(DATA, FLAG_END_STREAM, STREAM_ID, struct.pack(">BI", 0, len(request)) + request)
        )
        body = bytearray()
        reader = _FrameReader(sock, deadline)
        while True:
            kind, flags, stream, payload = reader.next_frame()
            if kind == SETTINGS and not flags & FLAG_ACK:
                sock.sendall(_frame(SETTINGS, FLAG_ACK, 0, b""))
            elif kind == PING and not flags & FLAG_ACK:
                sock.sendall(_frame(PING, FLAG_ACK, 0, payload))
            elif kind == GOAWAY or (kind == RST_STREAM and stream == STREAM_ID):
                raise ProbeInconclusive("the server ended the call")
            elif stream == STREAM_ID and kind in (DATA, HEADERS):
                if kind == DATA:
                    body += payload[1 : len(payload) - payload[0]] if flags & FLAG_PADDED and payload else payload
                if flags & FLAG_END_STREAM:
                    return _serving_status(bytes(body))


def split_target(target: str) -> tuple[str, int]:
    """host:port, [v6]:port or dns:///host:port; other gRPC target forms are left to grpcio."""
    address = target.removeprefix("dns:///")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in address or (":" in host and not host.startswith("[")):
        raise ProbeInconclusive(f"target {target!r} is not host:port")
    return host.strip("[]"), int(port)


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int = 7) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out, value = [limit], value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes(out + [value])


def _hpack_literal(name: str, value: str) -> bytes:
    """Literal header field without indexing, new name, no Huffman coding (RFC 7541 6.2.2)."""
    name_bytes, value_bytes = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(name_bytes)) + name_bytes + _hpack_int(len(value_bytes)) + value_bytes


def _protobuf_string(field_number: int, value: bytes) -> bytes:
    if not value:
        return b""
    return _varint(field_number << 3 | 2) + _varint(len(value)) + value


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ProbeInconclusive("malformed response message")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _serving_status(body: bytes) -> int:
    """The `status` (field 1) of the one uncompressed HealthCheckResponse in a gRPC response body."""
    if len(body) < 5 or body[0] != 0 or struct.unpack(">I", body[1:5])[0] != len(body) - 5:
        raise ProbeInconclusive("no response message")
    message, pos, status = body[5:], 0, 0
    while pos < len(message):
        tag, pos = _read_varint(message, pos)
        wire_type = tag & 7
        if wire_type == 0:
            value, pos = _read_varint(message, pos)
            if tag >> 3 == 1:
                status = value
        elif wire_type == 2:
            length, pos = _read_varint(message, pos)
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ProbeInconclusive("malformed response message")
    if pos != len(message):
        raise ProbeInconclusive("malformed response message")
    return status


class _FrameReader:
    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline, self.buffer = sock, deadline, bytearray()

    def _fill(self, size: int) -> None:
        while len(self.buffer) < size:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer in time")
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ProbeInconclusive("the server closed the connection")
            self.buffer += chunk

    def next_frame(self) -> tuple[int, int, int, bytes]:
        self._fill(9)
        length = int.from_bytes(self.buffer[:3], "big")
        if length > MAX_FRAME_BYTES:
            raise ProbeInconclusive("oversized frame")
        self._fill(9 + length)
        kind, flags = self.buffer[3], self.buffer[4]
        stream = int.from_bytes(self.buffer[5:9], "big") & 0x7FFF_FFFF
        payload = bytes(self.buffer[9 : 9 + length])
        del self.buffer[: 9 + length]
        return kind, flags, stream, payload
