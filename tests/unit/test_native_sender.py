"""NativeStreamSender: on a real pygrpc-native call (the assumption it makes about the pinned release), and on
pygrpc-native's call context with a stand-in front (the Rust I/O side)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata

import grpc
import pygrpc_native.aio as native_aio  # the `native` extra (scripts/bootstrap.sh installs it)
import pytest
from pygrpc_native import STREAM_CLOSED, STREAM_FULL, STREAM_SENT

from openengine_serve.api.openengine.v1 import generation_pb2
from openengine_serve.common import grpc_server
from openengine_serve.common.extras import DependencyError
from openengine_serve.common.grpc_server import (
    NATIVE,
    NativeStreamSender,
    check_native_dependency,
    create_server,
    nonblocking_send,
    resolve_implementation,
    stream_writer,
)
from openengine_serve.frontend.stream import serialize_response


async def _serve_one_stream() -> tuple[list[bytes], list[bool]]:
    """A real pygrpc-native server on loopback whose one streaming method sends with stream_writer: one message
    through send_now, one through write. Returns (messages received, whether each call had a send_now)."""
    had_send_now: list[bool] = []

    async def stream(request: bytes, context) -> None:
        write, send_now = stream_writer(context)
        had_send_now.append(send_now is not None)
        if send_now is None or not send_now(b"sent now"):
            await write(b"sent now")
        await write(b"written")

    server = create_server(resolve_implementation(NATIVE))
    server.add_registered_method_handlers("test.Echo", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/test.Echo/Stream")(b"", timeout=10)
            received = [message async for message in call]
    finally:
        await server.stop(None)
    return received, had_send_now


def test_a_real_call_of_the_pinned_release_is_sent_through_the_sender():
    """The attributes of pygrpc-native's call context NativeStreamSender reads (grpc_server.NATIVE_VERSION): a
    release that moved them fails here."""
    assert importlib.metadata.version("pygrpc-native") == grpc_server.NATIVE_VERSION
    received, had_send_now = asyncio.run(_serve_one_stream())
    assert had_send_now == [True], "pygrpc-native's call context changed: the frontend lost its non-blocking send"
    assert received == [b"sent now", b"written"]


def test_another_native_release_is_refused_naming_the_pinned_one(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.1")
    with pytest.raises(DependencyError, match=r"found pygrpc-native 0\.5\.1, but pygrpc-native==0\.5\.0"):
        check_native_dependency()


class Front:
    """Answers stream_try_send from a script of statuses (then SENT); stream_send (the blocking one) must
    never be used."""

    def __init__(self, statuses=()) -> None:
        self.statuses = list(statuses)
        self.tries: list[bytes] = []
        self.sent: list[bytes] = []

    def stream_try_send(self, _call_id, data) -> int:
        self.tries.append(data)
        status = self.statuses.pop(0) if self.statuses else STREAM_SENT
        if status == STREAM_SENT:
            self.sent.append(data)
        return status

    def stream_send(self, _call_id, _data) -> bool:
        raise AssertionError("a blocking send on a thread of the event loop's executor")


def native_context(front: Front):
    server = native_aio.Server()
    server._front = front
    handler = grpc.unary_stream_rpc_method_handler(lambda *_: None, response_serializer=serialize_response)
    call = native_aio._Call(7, "/openengine.v1.Inference/Generate", handler, (), "ipv4:127.0.0.1:1", None)
    return native_aio._Context(server, call)


class NoExecutor(concurrent.futures.ThreadPoolExecutor):
    def submit(self, *args, **kwargs):
        raise AssertionError("the event loop's executor was used")


async def _write_all(write, messages) -> None:
    asyncio.get_running_loop().set_default_executor(NoExecutor())
    for message in messages:
        await write(message)


def test_a_full_client_buffer_is_waited_for_on_the_calls_task_not_in_the_executor():
    front = Front([STREAM_FULL] * 5)
    sender = NativeStreamSender.of(native_context(front))
    finished = generation_pb2.GenerateResponse(request_id="r", finished=generation_pb2.GenerationFinished())
    asyncio.run(_write_all(sender.write, [b"delta", finished]))
    assert front.tries == [b"delta"] * 6 + [finished.SerializeToString()]
    assert front.sent == [b"delta", finished.SerializeToString()]


def test_a_closed_call_is_marked_closed_and_later_writes_send_nothing():
    front = Front([STREAM_CLOSED])
    context = native_context(front)
    sender = NativeStreamSender.of(context)
    asyncio.run(_write_all(sender.write, [b"one", b"two"]))
    assert context._closed and front.tries == [b"one"] and front.sent == []
    assert sender.try_send(b"three") is False and front.tries == [b"one"]


def test_try_send_reports_a_full_buffer_and_refuses_what_is_over_the_send_limit():
    front = Front([STREAM_FULL])
    context = native_context(front)
    context._server._send_limit = 3
    sender = NativeStreamSender.of(context)
    assert sender.try_send(b"a") is False and sender.try_send(b"b") is True
    assert sender.try_send(b"long") is False and front.sent == [b"b"]


def test_grpc_aio_contexts_keep_their_own_write():
    class AioContext:
        async def write(self, message) -> None: ...

    context = AioContext()
    write, send_now = stream_writer(context)
    assert write == context.write and send_now is None and nonblocking_send(context) is None
    write, send_now = stream_writer(native_context(Front()))
    assert send_now is not None and getattr(write, "__self__", None).__class__ is NativeStreamSender
