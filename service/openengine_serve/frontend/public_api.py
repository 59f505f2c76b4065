"""Registration of the public openengine.v1 services with one answer to undecodable requests.

Each handler is registered with a pass-through request deserializer and parses
the bytes itself: bytes that are not the method's request message end the call
with INVALID_ARGUMENT naming the message type, identically on grpcio and
pygrpc-native (left to the servers, grpcio answers UNKNOWN with Python's
exception text and pygrpc-native INTERNAL).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass


def _pass_through(raw: bytes) -> bytes:
    return raw


def _parser(input_type):
    """An awaitable parse(raw, context) that aborts the call with INVALID_ARGUMENT on undecodable bytes."""
    from_string = GetMessageClass(input_type).FromString
    name = input_type.full_name

    async def parse(raw: bytes, context):
        try:
            return from_string(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid {name}: {exc}")

    return parse


def _parsing(method, behaviour: Callable) -> Callable:
    """`behaviour` (a servicer method taking the parsed request) behind a parse of the raw request bytes;
    keeps its kind (coroutine or async generator), which the servers dispatch on."""
    parse = _parser(method.input_type)
    if inspect.isasyncgenfunction(behaviour):

        async def stream(raw: bytes, context):
            request = await parse(raw, context)
            async for response in behaviour(request, context):
                yield response

        return stream

    async def call(raw: bytes, context):
        return await behaviour(await parse(raw, context), context)

    return call


def add_public_service(
    server, service: ServiceDescriptor, servicer, response_serializers: Mapping[str, Callable] = {}
) -> None:
    """Registers every method of `service` from `servicer` (the generated servicer's method names);
    `response_serializers` replaces a method's default SerializeToString."""
    handlers = {}
    for method in service.methods:
        serializer = response_serializers.get(method.name) or GetMessageClass(method.output_type).SerializeToString
        handler = _parsing(method, getattr(servicer, method.name))
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(handler, request_deserializer=_pass_through, response_serializer=serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
