"""Property-based fuzzing of the public API on both servers (hypothesis): random valid-shape GenerateRequests
(odd numbers, NaN/inf, long and non-ASCII text, unknown fields), bit flips of valid requests, random
bytes, and random openengine-*/traceparent metadata. Every call ends within its deadline with OK or one of
the documented codes; afterwards the frontend is still ready and a normal request finishes.

OPENENGINE_FUZZ_SECONDS sets the budget per server (CI: 20); scripts/fuzz.sh runs a long one.
"""

from __future__ import annotations

import os
import time

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.client import is_serving

from .conftest import MODEL, collect, request

FUZZ_SECONDS = float(os.environ.get("OPENENGINE_FUZZ_SECONDS", "20"))
CALL_TIMEOUT_S = 5.0
# What a Generate call may end with (README, error handling): anything else is a defect.
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.UNAVAILABLE}

odd_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e308, -1.0]))
odd_ints = st.integers(min_value=0, max_value=2**32 - 1)
text = st.one_of(st.text(max_size=40), st.text(alphabet="é漢🙂\u0000\u200b", max_size=200),
                 st.just("x" * 5000))


@st.composite
def generate_requests(draw) -> G.GenerateRequest:
    req = G.GenerateRequest(request_id=draw(st.one_of(st.uuids().map(str), text)),
                            model=draw(st.sampled_from([MODEL, "qwen3", "", "other"])))
    if draw(st.booleans()):
        req.prompt = draw(text)
    else:
        req.token_ids.ids.extend(draw(st.lists(odd_ints, max_size=20)))
    sampling = req.sampling
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(sampling, name, draw(odd_floats))
    if draw(st.booleans()):
        sampling.top_k = draw(st.integers(min_value=-2**31, max_value=2**31 - 1))
    if draw(st.booleans()):
        sampling.num_sequences = draw(st.integers(min_value=0, max_value=20))
    req.stopping.max_tokens = draw(st.integers(min_value=0, max_value=12))
    if draw(st.booleans()):
        req.stopping.min_tokens = draw(odd_ints)
    for _ in range(draw(st.integers(0, 3))):
        condition = req.stopping.conditions.add()
        if draw(st.booleans()):
            condition.stop_text = draw(text)
        else:
            condition.stop_token_id = draw(odd_ints)
    if draw(st.booleans()):
        req.response.return_output_logprobs = True
        req.response.output_candidates.top_n = draw(st.integers(0, 50))
    if draw(st.booleans()):
        req.lora_name = draw(text)
    return req


@st.composite
def payloads(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "flipped", "random"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    wire = bytearray(draw(generate_requests()).SerializeToString())
    if draw(st.booleans()):  # an unknown field (number 1002, varint 99): must be skipped, not refused
        wire += bytes([0xD0, 0x3E, 99])
    if kind == "flipped" and wire:
        for _ in range(draw(st.integers(1, 4))):
            bit = draw(st.integers(0, len(wire) * 8 - 1))
            wire[bit // 8] ^= 1 << (bit % 8)
    return bytes(wire)


metadata = st.lists(st.tuples(
    st.sampled_from(["openengine-routing-key", "openengine-target-dp-rank", "openengine-priority",
                     "openengine-unknown", "traceparent", "tracestate"]),
    st.one_of(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=60),
              st.just("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), st.just("-1"),
              st.just("99999999999"))), max_size=4)


def test_fuzz_generate(stack):
    channel = grpc.insecure_channel(stack.frontend.target)
    call = channel.unary_stream("/openengine.v1.Inference/Generate", request_serializer=None,
                                response_deserializer=G.GenerateResponse.FromString)
    deadline = time.monotonic() + FUZZ_SECONDS
    seen: dict[str, int] = {}

    @settings(max_examples=int(FUZZ_SECONDS * 20), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(payload=payloads(), headers=metadata)
    def one_call(payload: bytes, headers):
        if time.monotonic() > deadline:
            return
        started = time.monotonic()
        try:
            list(call(payload, timeout=CALL_TIMEOUT_S, metadata=headers))
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            assert code in DOCUMENTED, (code, exc.details(), payload, headers)
            assert "Traceback" not in (exc.details() or "")
        assert time.monotonic() - started < CALL_TIMEOUT_S + 1
        seen[code.name] = seen.get(code.name, 0) + 1

    try:
        one_call()
    finally:
        channel.close()
    assert sum(seen.values()) >= 20, seen
    assert is_serving(stack.frontend.target)
    with stack.client() as client:
        assert collect(client, request(max_tokens=3))[-1].WhichOneof("event") == "finished"
