"""Protobuf wire encoding by hand, for the two hot paths that skip message objects: the engine
worker's step messages and the frontend's token deltas. Protobuf parsers read these bytes like any
serialized message; each user has a test comparing its bytes with protobuf's own."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

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


_F = FieldDescriptor
_WIRE_TYPES = {  # field type -> wire type: 0 varint, 1 64-bit, 2 length-delimited, 5 32-bit
    **dict.fromkeys(
        (
            _F.TYPE_INT64,
            _F.TYPE_UINT64,
            _F.TYPE_INT32,
            _F.TYPE_UINT32,
            _F.TYPE_BOOL,
            _F.TYPE_ENUM,
            _F.TYPE_SINT32,
            _F.TYPE_SINT64,
        ),
        0,
    ),
    **dict.fromkeys((_F.TYPE_DOUBLE, _F.TYPE_FIXED64, _F.TYPE_SFIXED64), 1),
    **dict.fromkeys((_F.TYPE_STRING, _F.TYPE_MESSAGE, _F.TYPE_BYTES), 2),
    **dict.fromkeys((_F.TYPE_FLOAT, _F.TYPE_FIXED32, _F.TYPE_SFIXED32), 5),
}


def field_tag(message_class, field_name: str) -> bytes:
    """The encoded tag of one field, read from the generated descriptor (never a literal that could drift)."""
    field = message_class.DESCRIPTOR.fields_by_name[field_name]
    wire_type = 2 if field.is_packed else _WIRE_TYPES[field.type]
    return varint(field.number << 3 | wire_type)
