"""Protobuf wire encoding by hand, for the two hot paths that skip message objects: the engine
worker's step messages and the frontend's token deltas. Protobuf parsers read these bytes like any
serialized message; each user has a test comparing its bytes with protobuf's own."""

from __future__ import annotations

_ONE_BYTE = tuple(bytes((value,)) for value in range(128))


def varint(value: int) -> bytes:
    """Base-128 varint of a non-negative int; one table lookup for the common values below 128."""
    if value < 128:
        return _ONE_BYTE[value]
    encoded = bytearray()
    while value >= 128:
        encoded.append((value & 0x7F) | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def length_delimited(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes or sub-message): tag, length, payload."""
    return tag + varint(len(payload)) + payload
