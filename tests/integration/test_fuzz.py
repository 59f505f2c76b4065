"""Property-based fuzzing of the public API on both servers (hypothesis): random valid-shape GenerateRequests
(odd numbers, NaN/inf, long and non-ASCII text, unknown fields, unknown enum numbers), random messages of
every public method's request type (every field, unknown enum numbers), bit flips of valid requests, random
bytes, and random openengine-*/traceparent metadata. Every call ends within its deadline with OK or one of
the method's documented codes; afterwards the frontend is still ready and a normal request finishes.
Generate's code must fit what the request holds (generate_problems: e.g. NOT_FOUND only for a model or rank
not served, never RESOURCE_EXHAUSTED or UNAVAILABLE from this idle deployment), and every stream that ends OK
must follow the protocol's event rules (stream_problems). Unknown enum numbers are read as the zero value: the
same answer as with the zero value.

OPENENGINE_FUZZ_EXAMPLES sets the Generate calls per server (CI: 300), a tenth of it (at least 30) each
Control method's; scripts/fuzz.sh runs a long one.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import NamedTuple

import grpc
from google.protobuf import struct_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import lifecycle_pb2, openengine_pb2
from openengine_serve.client import is_serving
from openengine_serve.common.vocab import load_encoding
from openengine_serve.frontend.limits import SMALL_MESSAGE_BYTES

from .conftest import MODEL, collect, request

GENERATE_EXAMPLES = int(os.environ.get("OPENENGINE_FUZZ_EXAMPLES", "300"))
CONTROL_EXAMPLES = max(30, GENERATE_EXAMPLES // 10)  # per method: each has far fewer fields
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
SERVED_MODELS = {MODEL, "qwen3"}
SERVED_RANKS = {"0", "1"}  # the session's two nodes

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


REGULAR_TOKENS = 151_643  # Qwen3's ids below its special tokens
short_text = st.text(alphabet="ab é漢🙂.\n", min_size=1, max_size=6)


@st.composite
def acceptable_requests(draw) -> G.GenerateRequest:
    """Requests inside every documented range, of a served model, asking for no unsupported feature: the
    contract says each is accepted, so each stream is checked against the event rules."""
    req = G.GenerateRequest(request_id="", model=draw(st.sampled_from(sorted(SERVED_MODELS))))  # id: at the call
    if draw(st.booleans()):
        req.prompt = draw(st.text(min_size=1, max_size=40))
    else:
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, REGULAR_TOKENS - 1), min_size=1, max_size=20)))
    sampling = req.sampling
    ranges = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "min_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "presence_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 2, exclude_min=True),
        "top_k": st.integers(-1, 50),
        "seed": st.integers(*UINT64),
        "num_sequences": st.integers(1, 3),
    }
    for name, values in ranges.items():
        if draw(st.booleans()):
            setattr(sampling, name, draw(values))
    stopping = req.stopping
    stopping.max_tokens = draw(st.integers(1, 12))
    if draw(st.booleans()):
        stopping.min_tokens = draw(st.integers(0, stopping.max_tokens))
    stopping.ignore_eos = draw(st.booleans())
    stopping.include_stop_in_output = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            stopping.conditions.add(stop_text=draw(short_text))
        else:
            stopping.conditions.add(stop_token_id=draw(st.integers(0, REGULAR_TOKENS - 1)))
    if draw(st.booleans()):
        req.response.return_output_logprobs = True
        req.response.output_candidates.top_n = draw(st.integers(0, 5))
    if draw(st.booleans()):
        req.response.return_prompt_logprobs = True
        req.response.prompt_candidates.top_n = draw(st.integers(0, 5))
    if draw(st.booleans()):  # extra keys are ignored, whatever they hold
        req.extra.fields[draw(text)].string_value = draw(text)
    return req


# Metadata the frontend accepts: each openengine- key at most once, well-formed, naming a served rank.
clean_metadata = st.fixed_dictionaries(
    {},
    optional={
        "openengine-routing-key": st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1),
        "openengine-target-dp-rank": st.sampled_from(sorted(SERVED_RANKS)),
        "openengine-priority": st.integers(-(2**31), 2**31 - 1).map(str),
        "traceparent": st.just("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    },
).map(lambda headers: tuple(headers.items()))


@st.composite
def generate_calls(draw) -> tuple[str, bytes, tuple[tuple[str, str], ...]]:
    """(kind, request bytes, metadata) of one Generate call."""
    kind = draw(st.sampled_from(["acceptable", "acceptable", "valid", "any_shape", "flipped", "random"]))
    if kind == "acceptable":
        return kind, draw(acceptable_requests()).SerializeToString(), draw(clean_metadata)
    headers = tuple(draw(metadata))
    if kind == "any_shape":  # every field of GenerateRequest, unknown enum numbers included
        return kind, draw(messages(G.GenerateRequest.DESCRIPTOR)).SerializeToString(), headers
    wire = draw(generate_requests()).SerializeToString()
    if draw(st.booleans()):  # an unknown field (number 1002, varint 99): must be skipped, not refused
        wire += bytes([0xD0, 0x3E, 99])
    return kind, mangled(draw, wire, kind), headers


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


class Answer(NamedTuple):
    code: grpc.StatusCode
    details: str
    responses: list[bytes]


def call_raw(channel: grpc.Channel, name: str, payload: bytes, headers=()) -> Answer:
    """One call with `payload` as the request bytes: its final code, checked against the method's documented
    codes (and INVALID_ARGUMENT for undecodable bytes) and the deadline; its details and response messages."""
    path, method = PUBLIC_METHODS[name]
    identity = dict(request_serializer=None, response_deserializer=None)
    started = time.monotonic()
    responses: list[bytes] = []
    details = ""
    over = name != "Generate" and len(payload) > SMALL_MESSAGE_BYTES  # refused before it is parsed
    try:
        if method.server_streaming:
            responses.extend(channel.unary_stream(path, **identity)(payload, timeout=CALL_TIMEOUT_S, metadata=headers))
        else:
            responses.append(channel.unary_unary(path, **identity)(payload, timeout=CALL_TIMEOUT_S, metadata=headers))
        code = Code.OK
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        allowed = {Code.RESOURCE_EXHAUSTED} if over else METHOD_CODES[name] | {Code.INVALID_ARGUMENT}
        assert code in allowed, (name, code, exc.details(), payload, headers)
        assert "Traceback" not in details
    assert code == Code.RESOURCE_EXHAUSTED or not over, (name, len(payload), "over the method's message limit")
    assert time.monotonic() - started < CALL_TIMEOUT_S + 1
    return Answer(code, details, responses)


def decoded(payload: bytes) -> G.GenerateRequest | None:
    """The request as the frontend reads it (the same protobuf runtime); None for undecodable bytes."""
    try:
        return G.GenerateRequest.FromString(payload)
    except DecodeError:
        return None


def uses_an_unsupported_feature(req: G.GenerateRequest) -> bool:
    """What the simulated engine's deployment answers with UNIMPLEMENTED (validation.py, step 4)."""
    return bool(
        req.media
        or req.lora_name
        or req.HasField("kv")
        or req.HasField("guided")
        or req.response.output_candidates.HasField("all")
        or req.response.prompt_candidates.HasField("all")
    )


def generate_problems(
    kind: str, payload: bytes, headers, code: grpc.StatusCode, responses: list[bytes], used_ids
) -> list[str]:
    """What is wrong with Generate's answer `code` (and its stream) to the request `payload`, as far as the
    request shows which answer the contract gives (SEMANTICS.md, "Generate"; validation.py's order)."""
    if kind == "acceptable" and code != Code.OK:
        return [f"{code.name} for a request the contract accepts"]
    req = decoded(payload)
    if req is None:
        return [] if code == Code.INVALID_ARGUMENT else [f"{code.name} for undecodable request bytes"]
    request_id_bad = not req.request_id or len(req.request_id.encode()) > 1024
    if request_id_bad or req.WhichOneof("input") is None:
        return [] if code == Code.INVALID_ARGUMENT else [f"{code.name} without a valid request_id and input"]
    ranks = [value for key, value in headers if key == "openengine-target-dp-rank"]
    not_served = req.model not in SERVED_MODELS or any(rank not in SERVED_RANKS for rank in ranks)
    if code == Code.OK:
        if not_served or uses_an_unsupported_feature(req):
            return ["OK for a model, rank or feature that is not served"]
        return stream_problems(req, [G.GenerateResponse.FromString(r) for r in responses])
    if code == Code.NOT_FOUND and not not_served:
        return ["NOT_FOUND for a served model and rank"]
    if code == Code.UNIMPLEMENTED and not uses_an_unsupported_feature(req):
        return ["UNIMPLEMENTED without an unsupported feature"]
    if code == Code.ALREADY_EXISTS and req.request_id not in used_ids:
        return ["ALREADY_EXISTS for a request_id never sent before"]
    if code in (Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE):
        return [f"{code.name} from an idle deployment (one call at a time)"]
    return []


def stream_problems(req: G.GenerateRequest, responses: list[G.GenerateResponse]) -> list[str]:
    """The protocol's event rules (SEMANTICS.md, "After acceptance") checked on one OK stream."""
    problems = []
    outputs = req.sampling.num_sequences if req.sampling.HasField("num_sequences") else 1
    ids: dict[int, list[int]] = {i: [] for i in range(outputs)}
    text = {i: "" for i in range(outputs)}
    finished: dict[int, G.GenerationFinished] = {}
    events = [r.WhichOneof("event") for r in responses]
    if not responses:
        return ["an OK stream without any event"]
    if any(r.request_id != req.request_id for r in responses):
        problems.append("a response names another request_id")
    if events.count("prompt") > (1 if req.response.return_prompt_logprobs else 0) or "prompt" in events[1:]:
        problems.append(f"prompt event not once and first, or not asked for: {events}")
    if [r.HasField("usage") for r in responses] != [False] * (len(responses) - 1) + [True]:
        problems.append("usage not on the final response alone")
    errors = events.count("error")
    if errors and (errors > 1 or events[-1] != "error"):
        problems.append(f"an error event that is not the single terminal event: {events}")
    for r, event in zip(responses, events, strict=True):
        if event not in ("token", "finished"):
            continue
        delta = getattr(r, event)
        index = delta.output_index
        if not delta.HasField("output_index") or index not in ids:
            problems.append(f"{event} with output_index {index if delta.HasField('output_index') else 'unset'}")
        elif index in finished:
            problems.append(f"{event} for output {index} after its finished")
        elif event == "token":
            if not delta.tokens:
                problems.append(f"a token delta of output {index} without token records")
            ids[index] += [t.token_id for t in delta.tokens]
            text[index] += delta.text
        else:
            finished[index] = delta
    if not errors and sorted(finished) != list(ids):
        problems.append(f"outputs {sorted(finished)} finished, expected each of {list(ids)} once")
    max_tokens = req.stopping.max_tokens if req.stopping.HasField("max_tokens") else None
    stop_texts = {c.stop_text for c in req.stopping.conditions if c.WhichOneof("condition") == "stop_text"}
    stop_ids = {c.stop_token_id for c in req.stopping.conditions if c.WhichOneof("condition") == "stop_token_id"}
    generated = 0  # usage counts an end-of-sequence or stop token also when the output leaves it out
    for index, end in finished.items():
        match = end.stop_match.WhichOneof("match")
        stop_token = getattr(end.stop_match, match) if match in ("stop_token_id", "eos_token_id") else None
        if stop_token is None:
            count = len(ids[index])
        elif req.stopping.include_stop_in_output:
            count = len(ids[index])
            if not ids[index] or ids[index][-1] != stop_token:
                problems.append(f"output {index}: include_stop_in_output, yet it does not end with {stop_token}")
        else:
            count = len(ids[index]) + 1
        generated += count
        if max_tokens is not None and count > max_tokens:
            problems.append(f"output {index}: {count} tokens, max_tokens {max_tokens}")
        if end.reason == G.FINISH_REASON_LENGTH:
            if max_tokens is not None and count != max_tokens:
                problems.append(f"output {index}: LENGTH after {count} tokens, max_tokens {max_tokens}")
        elif end.reason == G.FINISH_REASON_STOP:
            if match is None:
                problems.append(f"output {index}: STOP without stop_match")
            elif match == "stop_text" and end.stop_match.stop_text not in stop_texts:
                problems.append(f"output {index}: stopped on a text not asked for: {end.stop_match.stop_text!r}")
            elif match == "stop_token_id" and stop_token not in stop_ids:
                problems.append(f"output {index}: stopped on a token not asked for: {stop_token}")
            elif match == "eos_token_id" and req.stopping.ignore_eos:
                problems.append(f"output {index}: stopped on EOS with ignore_eos")
            # both engines count the stop token itself towards min_tokens
            if stop_token is not None and count < req.stopping.min_tokens:
                problems.append(f"output {index}: {match} as token {count}, min_tokens {req.stopping.min_tokens}")
        else:  # nothing aborts the fuzz's requests
            problems.append(f"output {index}: finish reason {G.FinishReason.Name(end.reason)}")
        # An end-of-sequence token kept by include_stop_in_output adds its record, not its text (stream.py).
        text_ids = ids[index][:-1] if match == "eos_token_id" and count == len(ids[index]) else ids[index]
        decoded_ids = load_encoding().decode(text_ids)
        if match == "stop_text":
            # the text ends where the stop text first appears: with the stop text when it is kept, else just
            # before it; the tokens may decode to more (the one completing the match can carry text past it)
            stop = end.stop_match.stop_text
            upto = text[index] + ("" if req.stopping.include_stop_in_output else stop)
            if not decoded_ids.startswith(upto) or upto.find(stop) != len(upto) - len(stop):
                problems.append(
                    f"output {index}: text {text[index]!r} does not end at the first {stop!r} of "
                    f"the decode of its tokens {decoded_ids!r}"
                )
        elif text[index] != decoded_ids:
            problems.append(f"output {index}: the deltas' text {text[index]!r} is not the decode of its tokens")
    usage = responses[-1].usage
    if not errors:
        if usage.completion_tokens != generated:
            problems.append(f"usage.completion_tokens {usage.completion_tokens}, {generated} generated: {ids}")
        if usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
            problems.append(f"usage.total_tokens {usage.total_tokens} is not prompt plus completion")
        if req.WhichOneof("input") == "token_ids" and usage.prompt_tokens != len(req.token_ids.ids):
            problems.append(f"usage.prompt_tokens {usage.prompt_tokens} for {len(req.token_ids.ids)} token ids")
    return problems


def run_examples(count: int, strategy, one_call) -> dict[str, int]:
    """Calls one_call on `count` examples of `strategy` (more while hypothesis shrinks a failure); the count of
    each answer it returns."""
    seen: dict[str, int] = {}

    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(example=strategy)
    def run(example):
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
    used_ids: set[str] = set()

    def one_call(kind: str, payload: bytes, headers) -> str:
        if kind == "acceptable":  # a new id each call, also when hypothesis repeats an example
            payload = payload + G.GenerateRequest(request_id=f"fuzz-{uuid.uuid4()}").SerializeToString()
        code, details, responses = call_raw(channel, "Generate", payload, headers)
        problems = generate_problems(kind, payload, headers, code, responses, used_ids)
        assert not problems, (problems, code, details, decoded(payload), headers)
        if (req := decoded(payload)) is not None:
            used_ids.add(req.request_id)
        return f"{kind}:{code.name}"

    with grpc.insecure_channel(stack.frontend.target) as channel:
        seen = run_examples(GENERATE_EXAMPLES, generate_calls(), one_call)
    assert sum(seen.values()) >= GENERATE_EXAMPLES, seen
    # docs/robustness.md: 2 kinds in 6 are requests inside every documented range, each accepted (generate_problems
    # fails any other answer); hypothesis does not draw the kinds evenly: 25-34 % of the calls in measured runs
    acceptable = sum(n for answer, n in seen.items() if answer.startswith("acceptable:"))
    assert seen.get("acceptable:OK", 0) == acceptable >= sum(seen.values()) // 5, seen
    assert_still_serving(stack)


def test_fuzz_control(stack):
    """Every Control method: random requests of its type, random metadata."""
    names = sorted(set(PUBLIC_METHODS) - {"Generate"})
    with grpc.insecure_channel(stack.frontend.target) as channel:
        for name in names:
            answers = run_examples(
                CONTROL_EXAMPLES,
                st.tuples(control_payloads(name), metadata),
                lambda payload, headers: call_raw(channel, name, payload, headers).code.name,
            )
            assert sum(answers.values()) >= CONTROL_EXAMPLES, (name, answers)
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
                zero = call_raw(channel, name, with_enum(base(), path, 0)).code
                unknown = call_raw(channel, name, with_enum(base(), path, UNKNOWN_ENUM_NUMBER)).code
                assert unknown == zero, (name, [f.name for f in path], zero, unknown)
                covered.append(f"{name}:{'.'.join(f.name for f in path)}")
    # the enums of today's schema, so that a new one is not silently left out of BASE_REQUESTS
    assert {"Generate:media.modality", "Health:role"} <= set(covered), covered
    assert_still_serving(stack)
