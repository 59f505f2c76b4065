"""The public port's stated limits, enforced with a status naming them, on both gRPC servers."""

from __future__ import annotations

import re
import uuid

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import server_pb2
from openengine_serve.client import Client
from openengine_serve.frontend import limits

from . import processes
from .conftest import SERVERS

MAX_REQUEST_BYTES, MAX_METADATA_BYTES, MAX_STREAMS, MAX_PROMPT_BYTES = 4096, 2048, 3, 1000


@pytest.fixture(scope="module", params=SERVERS)
def limited(request, cluster):
    coord, _ = cluster
    fe = processes.frontend(
        coord.target,
        request.param,
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--max-metadata-bytes",
        str(MAX_METADATA_BYTES),
        "--max-concurrent-streams",
        str(MAX_STREAMS),
        "--max-prompt-bytes",
        str(MAX_PROMPT_BYTES),
    ).start()
    try:
        fe.wait_ready(60)
        yield fe
    finally:
        fe.stop()


def generate_request(prompt: str = "Hello", max_tokens: int = 4) -> G.GenerateRequest:
    return G.GenerateRequest(
        request_id=f"lim-{uuid.uuid4()}",
        model="Qwen/Qwen3-0.6B",
        prompt=prompt,
        stopping=G.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


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


def test_a_prompt_over_its_byte_limit_is_refused_naming_it(limited):
    with Client(limited.target, retries=False) as client:
        err = refusal(lambda: list(client.inference.Generate(generate_request("é" * 501), timeout=10)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == (
            f"prompt must be at most {MAX_PROMPT_BYTES} bytes of UTF-8 (OPENENGINE_MAX_PROMPT_BYTES), got 1002 bytes"
        )
        assert list(client.inference.Generate(generate_request("é" * 500), timeout=30))[-1].HasField("usage")


def test_a_long_prompt_is_served_with_its_tokens_counted(stack):
    prompt = "Tell me about the sea. " * 1000  # 23,000 characters: validated in a thread (OFF_LOOP_PROMPT_CHARS)
    with stack.client() as client:
        responses = list(client.inference.Generate(generate_request(prompt), timeout=60))
    from openengine_serve.common.tokenizers import Qwen3Tokenizer

    assert responses[-1].usage.prompt_tokens == len(Qwen3Tokenizer().encode(prompt))


# From just over the limit to far beyond twice it (where pygrpc-native's HTTP/2 layer used to answer HTTP 431,
# seen as UNKNOWN): every size gets the interceptor's answer, identical on both servers.
OVER_LIMIT_PADDING = (
    2500,
    2 * MAX_METADATA_BYTES + 100,
    16 * 1024,
    64 * 1024,
    512 * 1024,
    limits.TRANSPORT_MAX_METADATA_BYTES - 2048,
)


def test_oversized_metadata_is_refused_naming_the_limit(limited):
    with Client(limited.target, retries=False) as client:
        for padding in OVER_LIMIT_PADDING:
            for call in (
                lambda md: client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10, metadata=md),
                lambda md: list(client.inference.Generate(generate_request(), timeout=10, metadata=md)),
            ):
                err = refusal(lambda: call((("x-padding", "p" * padding),)))
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (padding, err.code(), err.details())
                size = int(
                    re.fullmatch(
                        rf"request metadata is (\d+) bytes, over the limit of {MAX_METADATA_BYTES} "
                        r"\(OPENENGINE_MAX_METADATA_BYTES\)",
                        err.details(),
                    ).group(1)
                )
                assert size > padding  # the client's own headers (user-agent) count too
        assert client.control.GetServerInfo(
            server_pb2.GetServerInfoRequest(), timeout=10, metadata=(("x-padding", "p" * 1000),)
        ).instance_id


def test_metadata_beyond_the_transport_cap_is_refused_and_the_server_keeps_serving(limited):
    """Above TRANSPORT_MAX_METADATA_BYTES the transports answer themselves, differently (docs/robustness.md):
    grpcio names its hard limit; pygrpc-native's HTTP/2 layer answers HTTP 431 on a fresh connection."""
    with Client(limited.target, retries=False) as client:
        err = refusal(
            lambda: client.control.GetServerInfo(
                server_pb2.GetServerInfoRequest(),
                timeout=10,
                metadata=(("x-padding", "p" * (limits.TRANSPORT_MAX_METADATA_BYTES + 4096)),),
            )
        )
        if limited.name.endswith("grpcio"):
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
            assert (
                "exceeds hard limit" in err.details() and f"vs. {limits.TRANSPORT_MAX_METADATA_BYTES})" in err.details()
            )
        else:  # the 431 answer, or the stream reset that may overtake it when the machine is busy
            answered_431 = err.code() == grpc.StatusCode.UNKNOWN and "431" in err.details()
            reset = err.code() == grpc.StatusCode.INTERNAL and "RST_STREAM" in err.details()
            assert answered_431 or reset, (err.code(), err.details())
    with Client(limited.target, retries=False) as client:
        assert client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10).instance_id


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


def test_health_watches_and_reflection_streams_count_against_the_stream_limit(limited):
    import threading

    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    done = threading.Event()

    def requests():  # one question, then the stream stays open until the test ends
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        done.wait(30)

    def reflection_stream(client: Client):
        stream = reflection_pb2_grpc.ServerReflectionStub(client.channel).ServerReflectionInfo(requests(), timeout=60)
        assert next(stream).list_services_response.service  # open: it answered
        return stream

    def refused_as_too_many(call) -> None:
        err = refusal(call)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        assert "OPENENGINE_MAX_CONCURRENT_STREAMS" in err.details()

    with Client(limited.target, retries=False) as client:
        watches = [
            client.health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60) for _ in range(MAX_STREAMS)
        ]
        for watch in watches:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        refused_as_too_many(lambda: list(client.inference.Generate(generate_request(), timeout=10)))
        refused_as_too_many(lambda: next(client.health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)))
        for watch in watches:
            watch.cancel()
    with Client(limited.target, retries=False) as client:
        streams = [reflection_stream(client) for _ in range(MAX_STREAMS)]
        # pygrpc-native hands reflection to an internal server that does not know the client's connection: its
        # reflection streams are counted all together there, which holds this connection to the limit too
        refused_as_too_many(lambda: reflection_stream(client))
        done.set()
        for stream in streams:
            stream.cancel()
        processes.wait_for(lambda: _reflects(client), 10, "reflection again after the streams ended")


def _reflects(client: Client) -> bool:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    try:
        answers = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        return bool(next(answers).list_services_response.service)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False


# ------------------------------------------------------------------ per-method message limits (default settings)

SMALL = limits.SMALL_MESSAGE_BYTES
GENERATE_LIMIT = 512 * 1024 + 65536 + 4096 + 65536  # limits.generate_message_limit of the default settings


@pytest.fixture(scope="module", params=SERVERS)
def default_limits(request, cluster):
    """A frontend with the default limits (no key file: the clients below have no key)."""
    coord, _ = cluster
    fe = processes.frontend(coord.target, request.param).start()
    try:
        fe.wait_ready(60)
        yield fe
    finally:
        fe.stop()


def test_each_method_takes_the_messages_it_can_legitimately_carry(default_limits):
    from grpc_health.v1 import health_pb2

    from openengine_serve.api.openengine.v1 import model_pb2

    with Client(default_limits.target, retries=False) as client:
        service = "s" * (SMALL - 3)  # tag and length: a request of exactly the limit
        assert next(client.health.Watch(health_pb2.HealthCheckRequest(service=service), timeout=5)).status
        for call, method in (
            (
                lambda: next(client.health.Watch(health_pb2.HealthCheckRequest(service=service + "s"), timeout=5)),
                "/grpc.health.v1.Health/Watch",
            ),
            (
                lambda: client.health.Check(health_pb2.HealthCheckRequest(service=service + "s"), timeout=5),
                "/grpc.health.v1.Health/Check",
            ),
            (
                lambda: client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model="m" * SMALL), timeout=5),
                "/openengine.v1.Control/GetModelInfo",
            ),
        ):
            err = refusal(call)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert re.fullmatch(
                rf"request message is \d+ bytes, over the limit of {SMALL} bytes for {method}", err.details()
            ), err.details()
        over = generate_request("x" * GENERATE_LIMIT)
        err = refusal(lambda: list(client.inference.Generate(over, timeout=10)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"vs. {GENERATE_LIMIT})" in err.details()
        assert list(client.inference.Generate(generate_request("word " * 20_000), timeout=30))[-1].HasField("usage")


def test_keyless_watch_streams_and_refused_messages_do_not_pin_the_frontends_memory(default_limits):
    """64 Watch streams naming the largest service the limits allow (16 connections of 4, the per-connection
    cap) and 200 maximal Generate messages, refused: the frontend's RSS grows by less than 20 MB (measured:
    grpcio +12 MB, pygrpc-native +4 MB; before, 64 streams of 4 MB services took +600 MB on grpcio)."""
    import psutil
    from grpc_health.v1 import health_pb2

    process = psutil.Process(default_limits.proc.pid)
    rss = lambda: process.memory_info().rss / 2**20  # noqa: E731
    before = rss()
    clients = [Client(default_limits.target, retries=False) for _ in range(16)]
    try:
        service = "s" * (SMALL - 3)
        watches = [c.health.Watch(health_pb2.HealthCheckRequest(service=service)) for c in clients for _ in range(4)]
        for w in watches:
            next(w)
        beyond = refusal(lambda: next(clients[0].health.Watch(health_pb2.HealthCheckRequest(), timeout=5)))
        assert "(OPENENGINE_MAX_HEALTH_WATCHES_PER_CONNECTION)" in beyond.details()
        beyond = refusal(lambda: next(Client(default_limits.target).health.Watch(health_pb2.HealthCheckRequest())))
        assert "maximum of 64 health Watch streams open (OPENENGINE_MAX_HEALTH_WATCHES)" in beyond.details()
        maximal = generate_request("x" * (GENERATE_LIMIT - 200))
        # the largest message the transport takes, refused once read: its prompt is over the model's bound
        for _ in range(200):  # on one connection
            err = refusal(lambda: list(clients[0].inference.Generate(maximal, timeout=10)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        grown = rss() - before
        assert grown < 20, f"frontend RSS {before:.0f} -> {rss():.0f} MB with the streams open"
    finally:
        for c in clients:
            c.close()
