"""The project's openengine.v1 protos are wire-identical to the published schema
(tests/data/openengine-v1-wire.json)."""

import json

import pytest
from google.protobuf import descriptor

from openengine_serve.api.openengine.v1 import openengine_pb2

from ..conftest import DATA

WIRE = json.loads((DATA / "openengine-v1-wire.json").read_text())
POOL = openengine_pb2.DESCRIPTOR.pool

SCALARS = {
    descriptor.FieldDescriptor.TYPE_DOUBLE: "double",
    descriptor.FieldDescriptor.TYPE_FLOAT: "float",
    descriptor.FieldDescriptor.TYPE_INT64: "int64",
    descriptor.FieldDescriptor.TYPE_UINT64: "uint64",
    descriptor.FieldDescriptor.TYPE_INT32: "int32",
    descriptor.FieldDescriptor.TYPE_UINT32: "uint32",
    descriptor.FieldDescriptor.TYPE_BOOL: "bool",
    descriptor.FieldDescriptor.TYPE_STRING: "string",
    descriptor.FieldDescriptor.TYPE_BYTES: "bytes",
}


def field_type(f: descriptor.FieldDescriptor) -> str:
    if f.message_type is not None:
        return f.message_type.full_name
    if f.enum_type is not None:
        return f.enum_type.full_name
    return SCALARS[f.type]


def field_label(f: descriptor.FieldDescriptor) -> str:
    if f.is_repeated:
        return "repeated"
    return (
        "optional"
        if f.has_presence and f.containing_oneof is not None and f.containing_oneof.name.startswith("_")
        else ""
    )


def real_oneof(f: descriptor.FieldDescriptor) -> str:
    oneof = f.containing_oneof
    return "" if oneof is None or oneof.name.startswith("_") else oneof.name


def package_messages() -> set[str]:
    names = set()
    for file_name in {
        "openengine/v1/" + n
        for n in (
            "error.proto",
            "kv.proto",
            "lifecycle.proto",
            "lora.proto",
            "model.proto",
            "server.proto",
            "generation.proto",
            "openengine.proto",
        )
    }:
        names.update(m.full_name for m in POOL.FindFileByName(file_name).message_types_by_name.values())
    return names


@pytest.mark.parametrize("message", sorted(WIRE["messages"]))
def test_message_fields_match(message):
    desc = POOL.FindMessageTypeByName(message)
    ours = {
        f.name: {"number": f.number, "type": field_type(f), "label": field_label(f), "oneof": real_oneof(f)}
        for f in desc.fields
    }
    assert ours == WIRE["messages"][message]


@pytest.mark.parametrize("enum", sorted(WIRE["enums"]))
def test_enum_values_match(enum):
    desc = POOL.FindEnumTypeByName(enum)
    assert {v.name: v.number for v in desc.values} == WIRE["enums"][enum]


@pytest.mark.parametrize("service", sorted(WIRE["services"]))
def test_service_methods_match(service):
    desc = POOL.FindServiceByName(service)
    ours = {
        m.name: {
            "in": m.input_type.full_name,
            "out": m.output_type.full_name,
            "client_streaming": m.client_streaming,
            "server_streaming": m.server_streaming,
        }
        for m in desc.methods
    }
    assert ours == WIRE["services"][service]


def test_no_message_beyond_the_published_schema():
    assert package_messages() == set(WIRE["messages"])
