"""The public port's stated limits, enforced with a status naming them, on both gRPC servers."""

from __future__ import annotations

import uuid

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2 as G, server_pb2
from openengine_serve.client import Client

from . import processes
from .conftest import SERVERS

MAX_REQUEST_BYTES, MAX_METADATA_BYTES, MAX_STREAMS = 4096, 2048, 3


@pytest.fixture(scope="module", params=SERVERS)
def limited(request, cluster):
    coord, _ = cluster
    fe = processes.frontend(coord.target, request.param, "--max-request-bytes", str(MAX_REQUEST_BYTES),
                            "--max-metadata-bytes", str(MAX_METADATA_BYTES),
                            "--max-concurrent-streams", str(MAX_STREAMS)).start()
    try:
        fe.wait_ready(60)
        yield fe
    finally:
        fe.stop()


def generate_request(prompt: str = "Hello", max_tokens: int = 4) -> G.GenerateRequest:
    return G.GenerateRequest(request_id=f"lim-{uuid.uuid4()}", model="Qwen/Qwen3-0.6B", prompt=prompt,
                             stopping=G.StoppingOptions(max_tokens=max_tokens, ignore_eos=True))


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_an_oversized_request_message_is_refused_naming_the_limit(limited):
    with Client(limited.target, retries=False) as client:
        err = refusal(lambda: list(client.inference.Generate(generate_request("word " * 1000), timeout=10)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"vs. {MAX_REQUEST_BYTES})" in err.details()
        assert list(client.inference.Generate(generate_request("word " * 100), timeout=30))[-1].HasField("usage")


def test_oversized_metadata_is_refused_naming_the_limit(limited):
    with Client(limited.target, retries=False) as client:
        err = refusal(lambda: client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10,
                                                           metadata=(("x-padding", "p" * 2500),)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "OPENENGINE_MAX_METADATA_BYTES" in err.details() and f"limit of {MAX_METADATA_BYTES}" in err.details()
        assert client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10,
                                            metadata=(("x-padding", "p" * 1000),)).instance_id


def test_concurrent_calls_per_connection_are_limited(limited):
    with Client(limited.target, retries=False) as client, Client(limited.target, retries=False) as other:
        streams = [client.inference.Generate(generate_request(max_tokens=3000), timeout=60) for _ in range(MAX_STREAMS)]
        for stream in streams:
            assert next(stream).HasField("token")
        err = refusal(lambda: client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "OPENENGINE_MAX_CONCURRENT_STREAMS" in err.details() and f"more than {MAX_STREAMS}" in err.details()
        assert other.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10).instance_id  # own connection
        streams[0].cancel()
        processes.wait_for(lambda: _answers(client), 10, "a slot after a call ended")
        for stream in streams[1:]:
            stream.cancel()


def _answers(client: Client) -> bool:
    try:
        return bool(client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10).instance_id)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False
