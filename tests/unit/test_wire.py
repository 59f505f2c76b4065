"""The hand-written wire encodings (common/wire) against the specifications' examples and protobuf's own
encoder and parser."""

from __future__ import annotations

import pytest

from openengine_serve.api.openengine.v1 import generation_pb2 as pb
from openengine_serve.common.wire import http2 as h2
from openengine_serve.common.wire import protobuf as wire


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16_383, 16_384, 2**31 - 1, 2**32 - 1])
def test_varint_is_protobufs_encoding(value):
    # TokenIds.ids is a packed repeated uint32: its payload is the bare varint
    serialized = pb.TokenIds(ids=[value]).SerializeToString()
    assert serialized == wire.length_delimited(wire.field_tag(pb.TokenIds, "ids"), wire.varint(value))
    parsed = pb.TokenIds()
    parsed.ParseFromString(serialized)
    assert list(parsed.ids) == [value]


@pytest.mark.parametrize("value", [0, 127, 128, 300, 2**32, 2**63 - 1, 2**64 - 1])
def test_read_varint_reads_what_varint_writes(value):
    encoded = wire.varint(value)
    assert wire.read_varint(b"\x05" + encoded + b"\x01", 1) == (value, 1 + len(encoded))


def test_varint_spec_example():
    assert wire.varint(150) == b"\x96\x01"  # protobuf encoding guide
    assert wire.read_varint(b"\x00\x96\x01", 1) == (150, 3)


def test_a_truncated_or_overlong_varint_is_an_error():
    with pytest.raises(IndexError):
        wire.read_varint(b"\x96", 0)
    assert wire.read_varint(b"\xff" * 9 + b"\x01", 0) == (2**64 - 1, 10)
    with pytest.raises(ValueError, match="64 bits"):
        wire.read_varint(b"\xff" * 10 + b"\x01", 0)


def test_field_tags_follow_the_descriptor():
    request_id = wire.field_tag(pb.GenerateResponse, "request_id")
    assert pb.GenerateResponse(request_id="r").SerializeToString() == wire.length_delimited(request_id, b"r")
    finished = pb.GenerateResponse.DESCRIPTOR.fields_by_name["finished"].number
    assert wire.field_tag(pb.GenerateResponse, "finished") == wire.key(finished, wire.LENGTH_DELIMITED)


def test_skip_passes_every_wire_type():
    # field 1 varint, field 2 fixed64, field 3 bytes, field 4 fixed32, then field 5 varint 7
    data = b"\x08\x96\x01" + b"\x11" + bytes(8) + b"\x1a\x02ab" + b"\x25" + bytes(4) + b"\x28\x07"
    pos, seen = 0, []
    while pos < len(data):
        tag, pos = wire.read_varint(data, pos)
        seen.append(tag >> 3)
        if tag >> 3 == 5:
            assert wire.read_varint(data, pos) == (7, len(data))
            break
        pos = wire.skip(data, pos, tag & 7)
    assert seen == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="wire type 3"):
        wire.skip(b"", 0, 3)


def test_hpack_integers_rfc7541_examples():
    assert h2.hpack_int(10, 5) == bytes([10])
    assert h2.hpack_int(1337, 5) == bytes([31, 154, 10])
    assert h2.hpack_int(42, 8) == bytes([42])
    assert h2.hpack_int(127) == bytes([127, 0])
    assert h2.hpack_int(10, 5, first=0b1110_0000) == bytes([0b1110_1010])


def test_literal_header_encoding():
    assert h2.hpack_literal("te", "trailers") == b"\x00\x02te\x08trailers"
    assert h2.header_block([("a", "b"), ("te", "trailers")]) == b"\x00\x01a\x01b" + h2.hpack_literal("te", "trailers")


def test_frame_layout():
    frame = h2.frame(h2.HEADERS, h2.END_HEADERS, 1, b"abc")
    assert frame == b"\x00\x00\x03\x01\x04\x00\x00\x00\x01abc"
    assert h2.frame_header(b"xx" + frame, 2) == (3, h2.HEADERS, h2.END_HEADERS, 1)
    assert h2.frame_header(b"\x00\x00\x00\x00\x00\xff\xff\xff\xff") == (0, h2.DATA, 0, 2**31 - 1)  # reserved bit


def test_padding_and_grpc_prefix():
    assert h2.unpadded(b"\x02abc\x00\x00") == b"abc"
    assert h2.grpc_message(b"\x0a\x09readiness") == b"\x00\x00\x00\x00\x0b\x0a\x09readiness"
