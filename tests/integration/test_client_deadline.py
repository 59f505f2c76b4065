"""The client library's promises against a real gRPC server on loopback: `generate(timeout=T)` ends by T
(plus a little) with DEADLINE_EXCEEDED however often it is refused, and a stream that delivered a message
is never sent again."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2, openengine_pb2_grpc
from openengine_serve.client import AsyncClient, Client

TIMEOUT_S = 3.0
SLACK_S = 0.5


class RefusingInference(openengine_pb2_grpc.InferenceServicer):
    """Answers every Generate with UNAVAILABLE, after `messages_first` messages."""

    def __init__(self) -> None:
        self.messages_first = 0
        self.calls = 0
        self._lock = threading.Lock()

    def Generate(self, request, context):
        with self._lock:
            self.calls += 1
        for _ in range(self.messages_first):
            yield generation_pb2.GenerateResponse(token=generation_pb2.TokenOutput(text="x"))
        context.abort(grpc.StatusCode.UNAVAILABLE, "refusing every call")


@pytest.fixture(scope="module")
def refusing():
    servicer = RefusingInference()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    openengine_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture
def server(refusing):
    servicer, target = refusing
    servicer.messages_first = 0
    servicer.calls = 0
    return servicer, target


def request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(request_id="deadline-test", model="m", prompt="hello")


def assert_ended_at_deadline(exc: grpc.RpcError, started: float, servicer: RefusingInference) -> None:
    elapsed = time.monotonic() - started
    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, f"{exc.code()}: {exc.details()}"
    # not sooner: it kept retrying until the deadline; not later: no attempt outlived it
    assert TIMEOUT_S - 0.1 <= elapsed <= TIMEOUT_S + SLACK_S, f"ended after {elapsed:.2f} s"
    assert servicer.calls > 1, "no retry was made"


def test_blocking_client_ends_at_its_deadline(server):
    servicer, target = server
    started = time.monotonic()
    with Client(target) as client, pytest.raises(grpc.RpcError) as raised:
        list(client.generate(request(), timeout=TIMEOUT_S))
    assert_ended_at_deadline(raised.value, started, servicer)


async def test_async_client_ends_at_its_deadline(server):
    servicer, target = server
    started = time.monotonic()
    async with AsyncClient(target) as client:
        with pytest.raises(grpc.RpcError) as raised:
            async for _ in client.generate(request(), timeout=TIMEOUT_S):
                pass
    assert_ended_at_deadline(raised.value, started, servicer)


def test_blocking_client_does_not_resend_a_stream_that_delivered_a_message(server):
    servicer, target = server
    servicer.messages_first = 1
    received = []
    with Client(target) as client, pytest.raises(grpc.RpcError) as raised:
        for response in client.generate(request(), timeout=TIMEOUT_S):
            received.append(response)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(received) == 1 and servicer.calls == 1


async def test_async_client_does_not_resend_a_stream_that_delivered_a_message(server):
    servicer, target = server
    servicer.messages_first = 1
    received = []
    async with AsyncClient(target) as client:
        with pytest.raises(grpc.RpcError) as raised:
            async for response in client.generate(request(), timeout=TIMEOUT_S):
                received.append(response)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(received) == 1 and servicer.calls == 1


def test_cli_generate_retries_until_its_deadline(server):
    """`openengine-serve generate` goes through Client.generate: refused calls are retried until --timeout."""
    servicer, target = server
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "generate",
            "--target",
            target,
            "--prompt",
            "hello",
            "--model",
            "m",
            "--timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: DEADLINE_EXCEEDED"), result.stderr
    assert servicer.calls > 1
