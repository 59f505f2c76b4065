"""HTTP/2 framing (RFC 9113), HPACK literals (RFC 7541) and gRPC's message prefix, standard library only:
what a client needs to make gRPC calls over h2c without an HTTP/2 library."""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_BYTES = 9
# frame types
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
# flags
END_STREAM = ACK = 0x1
END_HEADERS, PADDED = 0x4, 0x8
# settings
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x3, 0x4
DEFAULT_WINDOW, MAX_WINDOW = 65535, 2**31 - 1
# error codes
CANCEL = 0x8


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream_id) + payload


def frame_header(buffer: bytes | bytearray, offset: int = 0) -> tuple[int, int, int, int]:
    """(payload length, type, flags, stream id) of the frame header at buffer[offset:offset + 9]."""
    return (
        int.from_bytes(buffer[offset : offset + 3], "big"),
        buffer[offset + 3],
        buffer[offset + 4],
        int.from_bytes(buffer[offset + 5 : offset + 9], "big") & 0x7FFF_FFFF,
    )


def unpadded(payload: bytes) -> bytes:
    """The data of a PADDED frame's payload (pad length byte and padding removed)."""
    return payload[1 : len(payload) - payload[0]] if payload else payload


def hpack_int(value: int, prefix_bits: int = 7, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix; `first` holds the bits above the prefix."""
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


def hpack_literal(name: str, value: str) -> bytes:
    """Literal header field without indexing, new name, no Huffman coding (RFC 7541 6.2.2)."""
    name_bytes, value_bytes = name.encode(), value.encode()
    return b"\x00" + hpack_int(len(name_bytes)) + name_bytes + hpack_int(len(value_bytes)) + value_bytes


def header_block(headers: list[tuple[str, str]]) -> bytes:
    """Every header a literal: no dynamic table on either side, so no encoder state."""
    return b"".join(hpack_literal(name, value) for name, value in headers)


def grpc_message(message: bytes) -> bytes:
    """One uncompressed gRPC message as it goes in DATA frames: flag byte 0, 4-byte length, message."""
    return struct.pack(">BI", 0, len(message)) + message
