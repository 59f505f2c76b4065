"""Hostile and slow clients on both servers: undecodable requests get one clear answer, clients that stop
reading are ended and free their engine slots."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2, openengine_pb2

from .conftest import collect, request
from .processes import metric, scrape, wait_for

PUBLIC_METHODS = [(service.full_name, method.name, method.input_type.full_name, method.server_streaming)
                  for service in openengine_pb2.DESCRIPTOR.services_by_name.values() for method in service.methods]
UNDECODABLE = b"\xff\xff\xff\xff"  # field 31 of wire type 7: not protobuf


def raw_call(channel: grpc.Channel, service: str, method: str, streaming: bool, payload: bytes):
    """A call with bytes as the request, past any client-side serialization; returns the raised RpcError."""
    path = f"/{service}/{method}"
    identity = dict(request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as caught:
        if streaming:
            list(channel.unary_stream(path, **identity)(payload, timeout=10))
        else:
            channel.unary_unary(path, **identity)(payload, timeout=10)
    return caught.value


@pytest.mark.parametrize("service,method,message,streaming", PUBLIC_METHODS,
                         ids=[f"{s.rsplit('.', 1)[1]}.{m}" for s, m, _, _ in PUBLIC_METHODS])
def test_undecodable_request_is_invalid_argument(stack, service, method, message, streaming):
    with grpc.insecure_channel(stack.frontend.target) as channel:
        error = raw_call(channel, service, method, streaming, UNDECODABLE)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert error.details().startswith(f"request is not a valid {message}: "), error.details()
    for internal in ("DecodeError", "Traceback", "class ", "Exception", "deserializ"):
        assert internal not in error.details()


def test_invalid_utf8_in_a_string_field_is_invalid_argument(stack):
    valid = request().SerializeToString()
    # the prompt is field 3 (length-delimited): replace its first byte by one that starts no UTF-8 character
    prompt = request().prompt.encode()
    mangled = valid.replace(prompt, b"\xc0" + prompt[1:])
    assert mangled != valid
    with grpc.insecure_channel(stack.frontend.target) as channel:
        error = raw_call(channel, "openengine.v1.Inference", "Generate", True, mangled)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert "openengine.v1.GenerateRequest" in error.details()
    with stack.client() as client:  # and the frontend still serves
        assert collect(client, request(max_tokens=3))[-1].WhichOneof("event") == "finished"
