"""NativeStreamSender: pygrpc-native's call context with a stand-in front (the Rust I/O side)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import grpc
import pygrpc_native.aio as native_aio  # the `native` extra (scripts/bootstrap.sh installs it)
from pygrpc_native._native import STREAM_CLOSED, STREAM_FULL, STREAM_SENT

from openengine_serve.api.openengine.v1 import generation_pb2
from openengine_serve.common.grpc_server import NativeStreamSender, nonblocking_send, stream_writer
from openengine_serve.frontend.stream import serialize_response


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
