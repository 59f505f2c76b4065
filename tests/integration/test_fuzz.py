"""Property-based fuzzing of the public API on both servers (hypothesis): random valid-shape GenerateRequests
(odd numbers, NaN/inf, long and non-ASCII text, unknown fields, unknown enum numbers), random messages of
every public method's request type (every field, unknown enum numbers), bit flips of valid requests, random
bytes, and random openengine-*/traceparent metadata. Every call ends within its deadline with OK or one of
the method's documented codes; afterwards the frontend is still ready and a normal request finishes.
Unknown enum numbers are read as the zero value: the same answer as with the zero value.

OPENENGINE_FUZZ_SECONDS sets the budget per server (CI: 20), shared by the Generate and the Control fuzz;
scripts/fuzz.sh runs a long one.
"""

from __future__ import annotations

import os
import time

import grpc
from google.protobuf import struct_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import lifecycle_pb2, openengine_pb2
from openengine_serve.client import is_serving

from .conftest import MODEL, collect, request

FUZZ_SECONDS = float(os.environ.get("OPENENGINE_FUZZ_SECONDS", "20"))
GENERATE_SHARE = 0.6  # of FUZZ_SECONDS; the Control fuzz takes the rest
CALL_TIMEOUT_S = 5.0
Code = grpc.StatusCode
# What a Generate call may end with (README, error handling): anything else is a defect.
DOCUMENTED = {
    Code.OK,
    Code.INVALID_ARGUMENT,
    Code.NOT_FOUND,
    Code.UNIMPLEMENTED,
    Code.ALREADY_EXISTS,
    Code.RESOURCE_EXHAUSTED,
    Code.UNAVAILABLE,
}
# What each public method may end with (docs/protocol.md, "Status codes of each call"); INVALID_ARGUMENT is
# every method's answer to undecodable bytes.
METHOD_CODES = {
    "Generate": DOCUMENTED,
    "GetServerInfo": {Code.OK},
    "GetModelInfo": {Code.OK, Code.NOT_FOUND},
    "GetLoad": {Code.OK},
    "Health": {Code.OK},
    "Abort": {Code.OK, Code.NOT_FOUND, Code.UNAVAILABLE},
    "LoadLora": {Code.FAILED_PRECONDITION},
    "UnloadLora": {Code.FAILED_PRECONDITION},
    "ListLoras": {Code.FAILED_PRECONDITION},
    "GetKvEventSources": {Code.OK},
    "SubscribeKvEvents": {Code.UNIMPLEMENTED},
}
PUBLIC_METHODS = {
    method.name: (f"/{service.full_name}/{method.name}", method)
    for service in openengine_pb2.DESCRIPTOR.services_by_name.values()
    for method in service.methods
}
assert set(PUBLIC_METHODS) == set(METHOD_CODES)

odd_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e308, -1.0]))
odd_ints = st.integers(min_value=0, max_value=2**32 - 1)
text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="é漢🙂\u0000\u200b", max_size=200),
    st.just("x" * 5000),
    st.just("é" * 40_000),
)


INT32, UINT32, INT64, UINT64 = (-(2**31), 2**31 - 1), (0, 2**32 - 1), (-(2**63), 2**63 - 1), (0, 2**64 - 1)
F = FieldDescriptor
SCALARS = {
    F.TYPE_DOUBLE: odd_floats,
    F.TYPE_FLOAT: st.floats(width=32),
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: text,
    F.TYPE_BYTES: st.binary(max_size=64),
    **{t: st.integers(*INT32) for t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32)},
    **{t: st.integers(*UINT32) for t in (F.TYPE_UINT32, F.TYPE_FIXED32)},
    **{t: st.integers(*INT64) for t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64)},
    **{t: st.integers(*UINT64) for t in (F.TYPE_UINT64, F.TYPE_FIXED64)},
}
MAX_DEPTH = 4  # google.protobuf.Struct nests without end


def enum_numbers(enum: EnumDescriptor) -> st.SearchStrategy[int]:
    """A known number or one the enum does not have (proto3 enums are open: any int32 goes on the wire)."""
    known = [v.number for v in enum.values]
    return st.one_of(st.sampled_from(known), st.integers(*INT32).filter(lambda n: n not in known))


def field_values(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == F.TYPE_ENUM:
        return enum_numbers(field.enum_type)
    if field.type == F.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1)
    return SCALARS[field.type]


@st.composite
def messages(draw, descriptor: Descriptor, depth: int = 0) -> Message:
    """A random message of any type: each field set or not, with values of its type (odd ones included)."""
    message = GetMessageClass(descriptor)()
    for field in descriptor.fields:
        if depth >= MAX_DEPTH and field.type == F.TYPE_MESSAGE or not draw(st.booleans()):
            continue
        target = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            for key, value in draw(
                st.dictionaries(SCALARS[key_field.type], field_values(value_field, depth), max_size=2)
            ).items():
                if value_field.type == F.TYPE_MESSAGE:
                    target[key].CopyFrom(value)
                else:
                    target[key] = value
        elif field.is_repeated:
            values = draw(st.lists(field_values(field, depth), max_size=3))
            if field.type == F.TYPE_MESSAGE:
                for value in values:
                    target.add().CopyFrom(value)
            else:
                target.extend(values)
        elif field.type == F.TYPE_MESSAGE:
            target.CopyFrom(draw(field_values(field, depth)))
        else:
            setattr(message, field.name, draw(field_values(field, depth)))
    return message


def mangled(draw, wire: bytes, kind: str) -> bytes:
    """`wire` as it is, or with a few bits flipped; random bytes for kind "random"."""
    if kind == "random":
        return draw(st.binary(max_size=300))
    wire = bytearray(wire)
    if kind == "flipped" and wire:
        for _ in range(draw(st.integers(1, 4))):
            bit = draw(st.integers(0, len(wire) * 8 - 1))
            wire[bit // 8] ^= 1 << (bit % 8)
    return bytes(wire)


@st.composite
def generate_requests(draw) -> G.GenerateRequest:
    req = G.GenerateRequest(
        request_id=draw(st.one_of(st.uuids().map(str), text)),
        model=draw(st.sampled_from([MODEL, "qwen3", "", "other"])),
    )
    if draw(st.booleans()):
        req.prompt = draw(text)
    else:
        req.token_ids.ids.extend(draw(st.lists(odd_ints, max_size=20)))
    sampling = req.sampling
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(sampling, name, draw(odd_floats))
    if draw(st.booleans()):
        sampling.top_k = draw(st.integers(min_value=-(2**31), max_value=2**31 - 1))
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
    if draw(st.integers(0, 3)) == 0:  # unsupported: refused whatever the modality number
        req.media.add(modality=draw(enum_numbers(G.Modality.DESCRIPTOR)), url=draw(text))
    if draw(st.booleans()):  # extra keys are ignored, whatever they hold
        req.extra.fields[draw(text)].null_value = draw(enum_numbers(struct_pb2.NullValue.DESCRIPTOR))
    return req


@st.composite
def payloads(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "any_shape", "flipped", "random"]))
    if kind == "any_shape":  # every field of GenerateRequest, unknown enum numbers included
        return draw(messages(G.GenerateRequest.DESCRIPTOR)).SerializeToString()
    wire = draw(generate_requests()).SerializeToString()
    if draw(st.booleans()):  # an unknown field (number 1002, varint 99): must be skipped, not refused
        wire += bytes([0xD0, 0x3E, 99])
    return mangled(draw, wire, kind)


@st.composite
def control_payloads(draw, name: str) -> bytes:
    """Request bytes for the public method `name`: a random message of its request type, mangled or not."""
    kind = draw(st.sampled_from(["any_shape", "any_shape", "flipped", "random"]))
    return mangled(draw, draw(messages(PUBLIC_METHODS[name][1].input_type)).SerializeToString(), kind)


metadata = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "openengine-routing-key",
                "openengine-target-dp-rank",
                "openengine-priority",
                "openengine-unknown",
                "traceparent",
                "tracestate",
            ]
        ),
        st.one_of(
            st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60),
            st.just("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            st.just("-1"),
            st.just("99999999999"),
        ),
    ),
    max_size=4,
)


def call_raw(channel: grpc.Channel, name: str, payload: bytes, headers=()) -> grpc.StatusCode:
    """One call with `payload` as the request bytes; its final code, checked against the method's documented
    codes (and INVALID_ARGUMENT for undecodable bytes) and the deadline."""
    path, method = PUBLIC_METHODS[name]
    identity = dict(request_serializer=None, response_deserializer=None)
    started = time.monotonic()
    try:
        if method.server_streaming:
            list(channel.unary_stream(path, **identity)(payload, timeout=CALL_TIMEOUT_S, metadata=headers))
        else:
            channel.unary_unary(path, **identity)(payload, timeout=CALL_TIMEOUT_S, metadata=headers)
        code = Code.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in METHOD_CODES[name] | {Code.INVALID_ARGUMENT}, (name, code, exc.details(), payload, headers)
        assert "Traceback" not in (exc.details() or "")
    assert time.monotonic() - started < CALL_TIMEOUT_S + 1
    return code


def run_for(seconds: float, strategy, one_call, per_second: int = 20, min_calls: int = 20) -> dict[str, int]:
    """Calls one_call on examples of `strategy` for about `seconds`, and at least `min_calls` times however
    slow the machine is (the clock starts at the first example, not while hypothesis warms up); the count of
    each answer it returns."""
    deadline = None
    seen: dict[str, int] = {}

    @settings(
        max_examples=max(min_calls, int(seconds * per_second)),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(example=strategy)
    def run(example):
        nonlocal deadline
        deadline = deadline or time.monotonic() + seconds
        if time.monotonic() > deadline and sum(seen.values()) >= min_calls:
            return
        answer = one_call(*example)
        seen[answer] = seen.get(answer, 0) + 1

    run()
    print(f"fuzz answers: {dict(sorted(seen.items()))}")  # shown with -s (scripts/fuzz.sh)
    return seen


def assert_still_serving(stack) -> None:
    assert is_serving(stack.frontend.target)
    with stack.client() as client:
        assert collect(client, request(max_tokens=3))[-1].WhichOneof("event") == "finished"


def test_fuzz_generate(stack):
    with grpc.insecure_channel(stack.frontend.target) as channel:
        seen = run_for(
            FUZZ_SECONDS * GENERATE_SHARE,
            st.tuples(payloads(), metadata),
            lambda payload, headers: call_raw(channel, "Generate", payload, headers).name,
        )
    assert sum(seen.values()) >= 20, seen
    assert_still_serving(stack)


def test_fuzz_control(stack):
    """Every Control method for an equal share of the time: random requests of its type, random metadata."""
    names = sorted(set(PUBLIC_METHODS) - {"Generate"})
    with grpc.insecure_channel(stack.frontend.target) as channel:
        for name in names:
            answers = run_for(
                FUZZ_SECONDS * (1 - GENERATE_SHARE) / len(names),
                st.tuples(control_payloads(name), metadata),
                lambda payload, headers: call_raw(channel, name, payload, headers).name,
                per_second=100,
                min_calls=3,
            )  # most Control calls take a millisecond
            assert sum(answers.values()) >= 3, (name, answers)
    assert_still_serving(stack)


def enum_paths(descriptor: Descriptor, seen: tuple[str, ...] = ()):
    """Every enum field reachable from a message, as the list of fields leading to it (each type once a path)."""
    for field in descriptor.fields:
        if field.type == F.TYPE_ENUM:
            yield [field]
        elif field.type == F.TYPE_MESSAGE and field.message_type.full_name not in seen:
            for path in enum_paths(field.message_type, (*seen, descriptor.full_name)):
                yield [field, *path]


def with_enum(base: Message, path: list[FieldDescriptor], number: int) -> bytes:
    """`base` with the enum at `path` set to `number` (repeated fields and maps get one element)."""
    message = type(base)()
    message.CopyFrom(base)
    target = message
    inner = iter(path[:-1])
    for field in inner:
        container = getattr(target, field.name)
        if field.message_type.GetOptions().map_entry:
            key_field = field.message_type.fields_by_name["key"]
            target = container["k" if key_field.type == F.TYPE_STRING else 1]
            next(inner)  # the entry's `value` field: the element is the value itself
        elif field.is_repeated:
            target = container.add()
        else:
            target = container
    setattr(target, path[-1].name, number)
    return message.SerializeToString()


BASE_REQUESTS = {
    "Generate": lambda: request(max_tokens=2),
    "Health": lifecycle_pb2.HealthRequest,
    "Abort": lambda: lifecycle_pb2.AbortRequest(request_id="fuzz-unknown-id"),
}
UNKNOWN_ENUM_NUMBER = 1_000_003


def test_unknown_enum_numbers_get_the_answer_of_the_zero_value(stack):
    """Every enum field of every public request: a number the enum does not have is read as the zero value."""
    covered = []
    with grpc.insecure_channel(stack.frontend.target) as channel:
        for name, (_, method) in PUBLIC_METHODS.items():
            for path in enum_paths(method.input_type):
                base = BASE_REQUESTS.get(name, GetMessageClass(method.input_type))  # a new request id each call
                # the request as in the path, with the zero value, then with an unknown number
                zero = call_raw(channel, name, with_enum(base(), path, 0))
                unknown = call_raw(channel, name, with_enum(base(), path, UNKNOWN_ENUM_NUMBER))
                assert unknown == zero, (name, [f.name for f in path], zero, unknown)
                covered.append(f"{name}:{'.'.join(f.name for f in path)}")
    # the enums of today's schema, so that a new one is not silently left out of BASE_REQUESTS
    assert {"Generate:media.modality", "Health:role"} <= set(covered), covered
    assert_still_serving(stack)
