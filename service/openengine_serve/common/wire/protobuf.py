"""Protobuf wire encoding and decoding by hand (standard library only). Protobuf parsers read these bytes
like any serialized message; each user has a test comparing its bytes with protobuf's own."""

from __future__ import annotations

import functools

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5  # wire types

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


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at data[pos:] and the position after it. IndexError when the data ends inside it,
    ValueError when it is longer than 64 bits."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 64 bits")


def skip(data: bytes, pos: int, wire_type: int) -> int:
    """The position after a field's value of `wire_type` starting at data[pos:] (the position may pass the
    end of the data: callers compare it with their end)."""
    if wire_type == VARINT:
        return read_varint(data, pos)[1]
    if wire_type == FIXED64:
        return pos + 8
    if wire_type == LENGTH_DELIMITED:
        length, pos = read_varint(data, pos)
        return pos + length
    if wire_type == FIXED32:
        return pos + 4
    raise ValueError(f"unsupported protobuf wire type {wire_type}")


def key(field_number: int, wire_type: int) -> bytes:
    """A field's encoded tag."""
    return varint(field_number << 3 | wire_type)


def length_delimited(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes or sub-message): tag, length, payload."""
    return tag + varint(len(payload)) + payload


def field_tag(message_class, field_name: str) -> bytes:
    """The encoded tag of one field, read from the generated descriptor (never a literal that could drift)."""
    field = message_class.DESCRIPTOR.fields_by_name[field_name]
    return key(field.number, LENGTH_DELIMITED if field.is_packed else _wire_types()[field.type])


@functools.cache
def _wire_types() -> dict[int, int]:
    """Field type -> wire type (imported here, when a message class is at hand, so the module stays light)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    types = (
        (VARINT, (F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_INT32, F.TYPE_UINT32, F.TYPE_BOOL, F.TYPE_ENUM)),
        (VARINT, (F.TYPE_SINT32, F.TYPE_SINT64)),
        (FIXED64, (F.TYPE_DOUBLE, F.TYPE_FIXED64, F.TYPE_SFIXED64)),
        (LENGTH_DELIMITED, (F.TYPE_STRING, F.TYPE_MESSAGE, F.TYPE_BYTES)),
        (FIXED32, (F.TYPE_FLOAT, F.TYPE_FIXED32, F.TYPE_SFIXED32)),
    )
    return {field_type: wire for wire, field_types in types for field_type in field_types}
