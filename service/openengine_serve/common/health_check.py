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

from .wire import http2 as h2
from .wire import protobuf as pb

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
        request = pb.length_delimited(pb.key(1, pb.LENGTH_DELIMITED), service.encode()) if service else b""
        sock.sendall(
            h2.PREFACE
            + h2.frame(h2.SETTINGS, 0, 0)
            + h2.frame(h2.HEADERS, h2.END_HEADERS, STREAM_ID, h2.header_block(headers))
            + h2.frame(h2.DATA, h2.END_STREAM, STREAM_ID, h2.grpc_message(request))
        )
        body = bytearray()
        reader = _FrameReader(sock, deadline)
        while True:
            kind, flags, stream, payload = reader.next_frame()
            if kind == h2.SETTINGS and not flags & h2.ACK:
                sock.sendall(h2.frame(h2.SETTINGS, h2.ACK, 0))
            elif kind == h2.PING and not flags & h2.ACK:
                sock.sendall(h2.frame(h2.PING, h2.ACK, 0, payload))
            elif kind == h2.GOAWAY or (kind == h2.RST_STREAM and stream == STREAM_ID):
                raise ProbeInconclusive("the server ended the call")
            elif stream == STREAM_ID and kind in (h2.DATA, h2.HEADERS):
                if kind == h2.DATA:
                    body += h2.unpadded(payload) if flags & h2.PADDED else payload
                if flags & h2.END_STREAM:
                    return _serving_status(bytes(body))


def split_target(target: str) -> tuple[str, int]:
    """host:port, [v6]:port or dns:///host:port; other gRPC target forms are left to grpcio."""
    address = target.removeprefix("dns:///")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in address or (":" in host and not host.startswith("[")):
        raise ProbeInconclusive(f"target {target!r} is not host:port")
    return host.strip("[]"), int(port)


def _serving_status(body: bytes) -> int:
    """The `status` (field 1) of the one uncompressed HealthCheckResponse in a gRPC response body."""
    if len(body) < 5 or body[0] != 0 or struct.unpack(">I", body[1:5])[0] != len(body) - 5:
        raise ProbeInconclusive("no response message")
    message, pos, status = body[5:], 0, 0
    try:
        while pos < len(message):
            tag, pos = pb.read_varint(message, pos)
            if tag == 1 << 3 | pb.VARINT:
                status, pos = pb.read_varint(message, pos)
            else:
                pos = pb.skip(message, pos, tag & 7)
    except (IndexError, ValueError):
        raise ProbeInconclusive("malformed response message") from None
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
        self._fill(h2.FRAME_HEADER_BYTES)
        length, kind, flags, stream = h2.frame_header(self.buffer)
        if length > MAX_FRAME_BYTES:
            raise ProbeInconclusive("oversized frame")
        end = h2.FRAME_HEADER_BYTES + length
        self._fill(end)
        payload = bytes(self.buffer[h2.FRAME_HEADER_BYTES : end])
        del self.buffer[:end]
        return kind, flags, stream, payload
