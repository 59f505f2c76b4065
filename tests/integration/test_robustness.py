"""Hostile and slow clients on both servers: undecodable requests get one clear answer, clients that stop
reading are ended and free their engine slots."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2, openengine_pb2, openengine_pb2_grpc

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


CLIENT_STALL_S = 2.0
NOT_READING = 4


@pytest.fixture(scope="module", params=("grpcio", "pygrpc-native"))
def stall_frontend(request, cluster):
    """A frontend of the shared cluster whose client stall timeout is short."""
    from . import processes

    coordinator, _ = cluster
    frontend, metrics_port = processes.with_metrics(processes.frontend(
        coordinator.target, request.param, "--client-stall-timeout-s", str(CLIENT_STALL_S)))
    frontend.start().wait_ready(60)
    yield frontend, metrics_port
    frontend.stop()


def big_request(max_tokens: int = 8000) -> generation_pb2.GenerateRequest:
    """Each token delta carries 20 candidates, so the client's flow-control window fills in a few seconds."""
    req = request(max_tokens=max_tokens)
    req.response.return_output_logprobs = True
    req.response.output_candidates.top_n = 20
    return req


def running_requests(target: str) -> int:
    from openengine_serve.api.openengine.v1 import server_pb2
    from openengine_serve.client import Client

    with Client(target) as client:
        return client.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5).running_requests


def test_clients_that_stop_reading_are_ended_and_free_their_slots(stall_frontend):
    frontend, metrics_port = stall_frontend
    before = metric(scrape(metrics_port), "openengine_frontend_client_stalls_total")
    # No BDP probing: the client's window stays at its initial 64 KiB, as for a client that stopped reading.
    channel = grpc.insecure_channel(frontend.target, options=[("grpc.http2.bdp_probe", 0)])
    generate = channel.unary_stream("/openengine.v1.Inference/Generate",
                                    request_serializer=generation_pb2.GenerateRequest.SerializeToString,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
    try:
        calls = [generate(big_request(), timeout=40) for _ in range(NOT_READING)]
        wait_for(lambda: running_requests(frontend.target) >= NOT_READING, 20, "the streams running")
        started = time.monotonic()
        wait_for(lambda: metric(scrape(metrics_port), "openengine_frontend_client_stalls_total") - before
                 >= NOT_READING, 60, "every non-reading stream counted as stalled")
        wait_for(lambda: running_requests(frontend.target) == 0, 10, "the engine slots freed")
        # 8000 tokens take 16 s at the 2 ms step: the streams were ended, they did not run to their end
        assert time.monotonic() - started < 14
        for call in calls:  # read what the client was sent: its end is a retryable error, or a cancellation
            try:
                responses = list(call)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.CANCELLED, (exc.code(), exc.details())
                assert "accepted no output" in exc.details()
                continue
            assert responses[-1].WhichOneof("event") == "error", responses[-1]
            assert responses[-1].error.retryable and "accepted no output" in responses[-1].error.message
    finally:
        channel.close()
    with grpc.insecure_channel(frontend.target) as fresh:
        responses = list(openengine_pb2_grpc.InferenceStub(fresh).Generate(request(max_tokens=3), timeout=30))
    assert responses[-1].WhichOneof("event") == "finished"


@pytest.mark.parametrize("server", ("grpcio", "pygrpc-native"))
def test_beyond_max_in_flight_generate_is_refused_at_once_with_a_retry_hint(cluster, server):
    from . import processes

    coordinator, _ = cluster
    frontend, metrics_port = processes.with_metrics(processes.frontend(
        coordinator.target, server, "--max-in-flight", "2"))
    frontend.start().wait_ready(60)
    try:
        with grpc.insecure_channel(frontend.target) as channel:
            stub = openengine_pb2_grpc.InferenceStub(channel)
            long_streams = [stub.Generate(request(max_tokens=8000), timeout=60) for _ in range(2)]
            for stream in long_streams:
                next(stream)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request(max_tokens=3), timeout=10))
            assert time.monotonic() - started < 1.0
            error = refused.value
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (error.code(), error.details())
            assert "OPENENGINE_MAX_IN_FLIGHT" in error.details() and "retry in 1000 ms" in error.details()
            assert ("openengine-retry-after-ms", "1000") in (error.trailing_metadata() or ())
            samples = scrape(metrics_port)
            assert metric(samples, "openengine_frontend_in_flight_refusals_total") == 1
            assert "openengine_frontend_event_loop_lag_seconds" in {name for name, _ in samples}
            for stream in long_streams:
                stream.cancel()
            wait_for(lambda: running_requests(frontend.target) == 0, 10, "the cancelled streams' slots freed")
            assert collect_stub(stub, request(max_tokens=3))[-1].WhichOneof("event") == "finished"
    finally:
        frontend.stop()


def collect_stub(stub, req):
    return list(stub.Generate(req, timeout=30))
