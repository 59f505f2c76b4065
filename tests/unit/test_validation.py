"""Request metadata parsing and Generate validation: each bad request → its kind of refusal and field."""

from __future__ import annotations

import math

import pytest
from google.protobuf import struct_pb2

from openengine_serve.api.openengine.v1 import generation_pb2 as pb
from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.common.vocab import VOCAB_SIZE
from openengine_serve.frontend.refusal import InvalidRequest, NotServed, Refusal, Unsupported
from openengine_serve.frontend.validation import (
    GenerationPlan,
    ModelLimits,
    RequestMetadata,
    parse_metadata,
    validate_generate,
)

MODEL = "qwen3-0.6b"
LIMITS = ModelLimits(
    served_model_name=MODEL,
    aliases=("qwen3",),
    max_context_length=64,
    max_output_tokens=16,
    max_num_sequences=4,
    vocab_size=VOCAB_SIZE,
)
INVALID = InvalidRequest
NOT_FOUND = NotServed
UNIMPLEMENTED = Unsupported
NAN = math.nan
INF = math.inf


def encode(text: str) -> list[int]:
    """One token per character keeps prompt lengths obvious in the tables."""
    return [ord(c) % VOCAB_SIZE for c in text]


def request(**fields) -> pb.GenerateRequest:
    """A valid request ("hello": 5 tokens) with `fields` replaced; a None value removes the field."""
    base = {"request_id": "req-1", "model": MODEL, "prompt": "hello"}
    if "token_ids" in fields:
        del base["prompt"]
    base.update(fields)
    return pb.GenerateRequest(**{name: value for name, value in base.items() if value is not None})


def sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**fields)


def stopping(**fields) -> pb.StoppingOptions:
    return pb.StoppingOptions(**fields)


def stop_text(text: str) -> pb.StopCondition:
    return pb.StopCondition(stop_text=text)


def stop_token(token_id: int) -> pb.StopCondition:
    return pb.StopCondition(stop_token_id=token_id)


def token_ids(*ids: int) -> pb.TokenIds:
    return pb.TokenIds(ids=ids)


def output_candidates(**selection) -> pb.ResponseOptions:
    return pb.ResponseOptions(output_candidates=pb.CandidateTokenSelection(**selection))


def prompt_candidates(**selection) -> pb.ResponseOptions:
    return pb.ResponseOptions(prompt_candidates=pb.CandidateTokenSelection(**selection))


def validate(req: pb.GenerateRequest, metadata: RequestMetadata | None = None) -> GenerationPlan:
    return validate_generate(req, metadata or RequestMetadata(), LIMITS, encode)


# --- bad requests --------------------------------------------------------------

BAD_REQUESTS = [
    # request_id
    ("request-id-empty", request(request_id=""), INVALID, "request_id"),
    ("request-id-1025-bytes", request(request_id="x" * 1025), INVALID, "request_id"),
    ("request-id-multibyte-over-1024-bytes", request(request_id="é" * 513), INVALID, "request_id"),
    # input
    ("no-input", request(prompt=None), INVALID, "prompt"),
    ("empty-prompt", request(prompt=""), INVALID, "prompt"),
    ("empty-token-ids", request(token_ids=token_ids()), INVALID, "token_ids"),
    # model
    ("unknown-model", request(model="gpt-4"), NOT_FOUND, "model"),
    ("model-missing", request(model=""), NOT_FOUND, "model"),
    ("model-case-differs", request(model="Qwen3"), NOT_FOUND, "model"),
    # unsupported features
    ("media", request(media=[pb.MediaItem(url="https://example.com/a.png")]), UNIMPLEMENTED, "media"),
    ("guided-regex", request(guided=pb.GuidedDecoding(regex="a+")), UNIMPLEMENTED, "guided.regex"),
    (
        "guided-json-object",
        request(guided=pb.GuidedDecoding(json_object=pb.JsonObjectConstraint())),
        UNIMPLEMENTED,
        "guided.json_object",
    ),
    ("kv-session", request(kv=pb.KvOptions(session=kv_pb2.KvSessionRef())), UNIMPLEMENTED, "kv.session"),
    (
        "kv-bypass-prefix-cache",
        request(kv=pb.KvOptions(bypass_prefix_cache=True)),
        UNIMPLEMENTED,
        "kv.bypass_prefix_cache",
    ),
    ("kv-cache-salt", request(kv=pb.KvOptions(cache_salt="tenant-a")), UNIMPLEMENTED, "kv.cache_salt"),
    ("lora", request(lora_name="adapter"), UNIMPLEMENTED, "lora_name"),
    (
        "output-candidates-all",
        request(response=output_candidates(all=pb.AllCandidates())),
        UNIMPLEMENTED,
        "response.output_candidates.all",
    ),
    (
        "prompt-candidates-all",
        request(response=prompt_candidates(all=pb.AllCandidates())),
        UNIMPLEMENTED,
        "response.prompt_candidates.all",
    ),
    # sampling
    ("temperature-negative", request(sampling=sampling(temperature=-0.1)), INVALID, "sampling.temperature"),
    ("temperature-nan", request(sampling=sampling(temperature=NAN)), INVALID, "sampling.temperature"),
    ("temperature-inf", request(sampling=sampling(temperature=INF)), INVALID, "sampling.temperature"),
    ("top-p-zero", request(sampling=sampling(top_p=0.0)), INVALID, "sampling.top_p"),
    ("top-p-above-one", request(sampling=sampling(top_p=1.5)), INVALID, "sampling.top_p"),
    ("top-p-nan", request(sampling=sampling(top_p=NAN)), INVALID, "sampling.top_p"),
    ("top-k-minus-two", request(sampling=sampling(top_k=-2)), INVALID, "sampling.top_k"),
    ("min-p-negative", request(sampling=sampling(min_p=-0.1)), INVALID, "sampling.min_p"),
    ("min-p-above-one", request(sampling=sampling(min_p=1.1)), INVALID, "sampling.min_p"),
    ("min-p-nan", request(sampling=sampling(min_p=NAN)), INVALID, "sampling.min_p"),
    (
        "frequency-penalty-above-two",
        request(sampling=sampling(frequency_penalty=2.5)),
        INVALID,
        "sampling.frequency_penalty",
    ),
    (
        "frequency-penalty-nan",
        request(sampling=sampling(frequency_penalty=NAN)),
        INVALID,
        "sampling.frequency_penalty",
    ),
    (
        "presence-penalty-below-minus-two",
        request(sampling=sampling(presence_penalty=-2.1)),
        INVALID,
        "sampling.presence_penalty",
    ),
    (
        "repetition-penalty-zero",
        request(sampling=sampling(repetition_penalty=0.0)),
        INVALID,
        "sampling.repetition_penalty",
    ),
    (
        "repetition-penalty-inf",
        request(sampling=sampling(repetition_penalty=INF)),
        INVALID,
        "sampling.repetition_penalty",
    ),
    (
        "repetition-penalty-nan",
        request(sampling=sampling(repetition_penalty=NAN)),
        INVALID,
        "sampling.repetition_penalty",
    ),
    ("num-sequences-zero", request(sampling=sampling(num_sequences=0)), INVALID, "sampling.num_sequences"),
    ("num-sequences-above-max", request(sampling=sampling(num_sequences=5)), INVALID, "sampling.num_sequences"),
    # stopping
    ("max-tokens-zero", request(stopping=stopping(max_tokens=0)), INVALID, "stopping.max_tokens"),
    (
        "max-tokens-above-max-output",
        request(stopping=stopping(max_tokens=17)),
        INVALID,
        "stopping.max_tokens",
    ),
    (
        "min-tokens-above-max-tokens",
        request(stopping=stopping(max_tokens=4, min_tokens=5)),
        INVALID,
        "stopping.min_tokens",
    ),
    (
        "min-tokens-above-max-output-when-max-tokens-unset",
        request(stopping=stopping(min_tokens=17)),
        INVALID,
        "stopping.min_tokens",
    ),
    (
        "too-many-stop-conditions",
        request(stopping=stopping(conditions=[stop_token(i) for i in range(17)])),
        INVALID,
        "stopping.conditions",
    ),
    (
        "stop-condition-unset",
        request(stopping=stopping(conditions=[stop_text("x"), pb.StopCondition()])),
        INVALID,
        "stopping.conditions[1]",
    ),
    (
        "stop-text-empty",
        request(stopping=stopping(conditions=[stop_text("")])),
        INVALID,
        "stopping.conditions[0].stop_text",
    ),
    (
        "stop-token-outside-vocabulary",
        request(stopping=stopping(conditions=[stop_token(VOCAB_SIZE)])),
        INVALID,
        "stopping.conditions[0].stop_token_id",
    ),
    # response
    (
        "output-top-n-above-max",
        request(response=output_candidates(top_n=21)),
        INVALID,
        "response.output_candidates.top_n",
    ),
    (
        "prompt-top-n-above-max",
        request(response=prompt_candidates(top_n=21)),
        INVALID,
        "response.prompt_candidates.top_n",
    ),
    (
        "candidate-token-outside-vocabulary",
        request(response=output_candidates(token_ids=token_ids(5, VOCAB_SIZE))),
        INVALID,
        "response.output_candidates.token_ids.ids[1]",
    ),
    # prompt tokens
    (
        "token-id-outside-vocabulary",
        request(token_ids=token_ids(1, 2, VOCAB_SIZE, VOCAB_SIZE + 5)),
        INVALID,
        "token_ids.ids[2]",
    ),
    ("prompt-longer-than-context", request(prompt="x" * 65), INVALID, "prompt"),
    ("token-ids-longer-than-context", request(token_ids=token_ids(*[1] * 65)), INVALID, "token_ids"),
    ("prompt-fills-context", request(prompt="x" * 64), INVALID, "prompt"),
    (
        "prompt-plus-max-tokens-exceeds-context",
        request(prompt="x" * 60, stopping=stopping(max_tokens=5)),
        INVALID,
        "stopping.max_tokens",
    ),
    (
        "min-tokens-above-what-fits-after-prompt",
        request(prompt="x" * 60, stopping=stopping(min_tokens=5)),
        INVALID,
        "stopping.min_tokens",
    ),
    (
        "prompt-logprob-start-at-prompt-length",
        request(response=pb.ResponseOptions(return_prompt_logprobs=True, prompt_logprob_start=5)),
        INVALID,
        "response.prompt_logprob_start",
    ),
]


@pytest.mark.parametrize(
    ("req", "code", "field_name"), [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_bad_request_is_rejected_naming_the_field(req, code, field_name):
    with pytest.raises(Refusal) as rejected:
        validate(req)
    assert type(rejected.value) is code
    assert field_name in rejected.value.message
    assert str(rejected.value) == rejected.value.message


@pytest.mark.parametrize(
    ("req", "fragments"),
    [
        (request(sampling=sampling(top_p=1.5)), ["sampling.top_p must be in (0, 1], got 1.5"]),
        (request(model="gpt-4"), ["'gpt-4'", f"'{MODEL}'", "'qwen3'"]),
        (request(token_ids=token_ids(7, VOCAB_SIZE + 1)), ["token_ids.ids[1]", str(VOCAB_SIZE), str(VOCAB_SIZE + 1)]),
        (request(media=[pb.MediaItem(url="u")]), ["media input is not supported"]),
        (request(kv=pb.KvOptions(session=kv_pb2.KvSessionRef())), ["KV sessions are not supported"]),
        (request(lora_name="a"), ["LoRA is not enabled"]),
        (request(guided=pb.GuidedDecoding(json_schema="{}")), ["guided decoding"]),
        (request(prompt="x" * 60, stopping=stopping(max_tokens=5)), ["at most 4 output tokens", "got 5"]),
    ],
    ids=[
        "top-p-range",
        "model-lists-served-names",
        "bad-id-and-position",
        "media",
        "kv-session",
        "lora",
        "guided",
        "max-tokens-room",
    ],
)
def test_rejection_messages_say_what_is_allowed(req, fragments):
    with pytest.raises(Refusal) as rejected:
        validate(req)
    for fragment in fragments:
        assert fragment in rejected.value.message


@pytest.mark.parametrize(
    ("req", "code", "field_name"),
    [
        (request(request_id="", model="gpt-4"), INVALID, "request_id"),
        (request(prompt=None, model="gpt-4"), INVALID, "prompt"),
        (request(model="gpt-4", lora_name="a"), NOT_FOUND, "model"),
        (request(lora_name="a", sampling=sampling(top_p=2.0)), UNIMPLEMENTED, "lora_name"),
        (request(sampling=sampling(top_p=2.0), stopping=stopping(max_tokens=0)), INVALID, "sampling.top_p"),
        (
            request(stopping=stopping(max_tokens=0), response=output_candidates(top_n=99)),
            INVALID,
            "stopping.max_tokens",
        ),
        (request(response=output_candidates(top_n=99), prompt="x" * 100), INVALID, "response.output_candidates"),
    ],
    ids=[
        "request-id-before-model",
        "input-before-model",
        "model-before-features",
        "features-before-sampling",
        "sampling-before-stopping",
        "stopping-before-response",
        "response-before-prompt-length",
    ],
)
def test_checks_run_in_the_documented_order(req, code, field_name):
    with pytest.raises(Refusal) as rejected:
        validate(req)
    assert (type(rejected.value), field_name in rejected.value.message) == (code, True)


def test_prompt_is_not_tokenized_when_a_cheaper_check_fails():
    def must_not_encode(text: str) -> list[int]:
        raise AssertionError("tokenized a request that was already invalid")

    with pytest.raises(Refusal):
        validate_generate(request(sampling=sampling(top_p=0.0)), RequestMetadata(), LIMITS, must_not_encode)


def test_a_prompt_over_its_byte_limit_is_refused_before_it_is_tokenized():
    def must_not_encode(text: str) -> list[int]:
        raise AssertionError("tokenized a prompt over the byte limit")

    limits = ModelLimits(**{**LIMITS.__dict__, "max_prompt_bytes": 100})
    for prompt, says in (("a" * 101, "got 101 characters"), ("é" * 51, "got 102 bytes")):
        with pytest.raises(InvalidRequest) as refused:
            validate_generate(request(prompt=prompt), RequestMetadata(), limits, must_not_encode)
        assert "prompt must be at most 100 bytes of UTF-8 (OPENENGINE_MAX_PROMPT_BYTES)" in refused.value.message
        assert says in refused.value.message
    # At the limit: tokenized, then judged by its tokens.
    assert len(validate_generate(request(prompt="é" * 50), RequestMetadata(), limits, encode).prompt_token_ids) == 50
    with pytest.raises(InvalidRequest, match="max_context_length 64, got 100 tokens"):
        validate_generate(request(prompt="a" * 100), RequestMetadata(), limits, encode)


def test_token_ids_past_the_context_are_refused_before_they_are_copied_or_scanned():
    ids = [1] * 2_000_000 + [10**6]  # its last id is outside the vocabulary: a scan would say that first
    with pytest.raises(InvalidRequest) as refused:
        validate(request(token_ids=token_ids(*ids)))
    assert refused.value.message == "token_ids must fit max_context_length 64, got 2000001 tokens"


def test_stop_texts_are_bounded_together():
    at_limit = [stop_text("x" * 1024) for _ in range(4)]
    assert len(validate(request(stopping=stopping(conditions=at_limit))).stop_strings) == 1  # deduplicated
    distinct = [stop_text(c * 1024) for c in "abcd"]
    assert len(validate(request(stopping=stopping(conditions=distinct))).stop_strings) == 4
    with pytest.raises(InvalidRequest) as refused:
        validate(request(stopping=stopping(conditions=[*distinct, stop_text("é")])))
    assert "stop_text must total at most 4096 bytes of UTF-8, got more by conditions[4]" in refused.value.message


# --- good requests -------------------------------------------------------------

GOOD_REQUESTS = [
    (
        "defaults",
        request(),
        dict(
            request_id="req-1",
            model=MODEL,
            prompt_token_ids=encode("hello"),
            num_sequences=1,
            max_tokens=16,
            min_tokens=0,
            stop_strings=[],
            stop_token_ids=[],
            ignore_eos=False,
            include_stop_in_output=False,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            seed=None,
            output_logprobs=False,
            output_candidates=None,
            prompt_logprobs=False,
            prompt_candidates=None,
            prompt_logprob_start=0,
            min_p=0.0,
            frequency_penalty=0.0,
            presence_penalty=0.0,
            repetition_penalty=1.0,
        ),
    ),
    ("alias-resolves-to-served-name", request(model="qwen3"), dict(model=MODEL)),
    (
        "token-ids-input",
        request(token_ids=token_ids(0, 1, VOCAB_SIZE - 1)),
        dict(prompt_token_ids=[0, 1, VOCAB_SIZE - 1]),
    ),
    ("request-id-exactly-1024-bytes", request(request_id="é" * 512), dict(request_id="é" * 512)),
    ("absent-max-tokens-clamped-to-context", request(prompt="x" * 60), dict(max_tokens=4)),
    (
        "max-tokens-fills-context-exactly",
        request(prompt="x" * 48, stopping=stopping(max_tokens=16)),
        dict(max_tokens=16),
    ),
    (
        "min-tokens-equal-to-max-tokens",
        request(stopping=stopping(max_tokens=8, min_tokens=8)),
        dict(max_tokens=8, min_tokens=8),
    ),
    (
        "min-tokens-fills-clamped-budget",
        request(prompt="x" * 60, stopping=stopping(min_tokens=4)),
        dict(max_tokens=4, min_tokens=4),
    ),
    ("greedy", request(sampling=sampling(temperature=0.0)), dict(temperature=0.0)),
    ("top-k-minus-one-means-disabled", request(sampling=sampling(top_k=-1)), dict(top_k=0)),
    ("top-k-set", request(sampling=sampling(top_k=50)), dict(top_k=50)),
    ("seed-zero-is-a-seed", request(sampling=sampling(seed=0)), dict(seed=0)),
    ("num-sequences-at-max", request(sampling=sampling(num_sequences=4)), dict(num_sequences=4)),
    (
        "sampling-at-bounds",
        request(
            sampling=sampling(
                top_p=1.0, min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=0.5
            )
        ),
        dict(top_p=1.0, min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=0.5),
    ),
    (
        "stop-conditions-split-and-deduplicated",
        request(
            stopping=stopping(
                conditions=[stop_text("\n\n"), stop_token(0), stop_text("END"), stop_text("\n\n"), stop_token(0)],
                ignore_eos=True,
                include_stop_in_output=True,
            )
        ),
        dict(stop_strings=["\n\n", "END"], stop_token_ids=[0], ignore_eos=True, include_stop_in_output=True),
    ),
    (
        "sixteen-stop-conditions",
        request(stopping=stopping(conditions=[stop_token(i) for i in range(16)])),
        dict(stop_token_ids=list(range(16))),
    ),
    ("output-top-n-at-max", request(response=output_candidates(top_n=20)), dict(output_candidates=("top_n", 20))),
    ("output-top-n-zero-means-none", request(response=output_candidates(top_n=0)), dict(output_candidates=None)),
    (
        "output-candidate-ids",
        request(response=output_candidates(token_ids=token_ids(5, 6))),
        dict(output_candidates=("token_ids", (5, 6))),
    ),
    (
        "prompt-logprobs",
        request(
            response=pb.ResponseOptions(
                return_prompt_logprobs=True,
                prompt_logprob_start=4,
                prompt_candidates=pb.CandidateTokenSelection(top_n=3),
                return_output_logprobs=True,
            )
        ),
        dict(prompt_logprobs=True, prompt_logprob_start=4, prompt_candidates=("top_n", 3), output_logprobs=True),
    ),
    ("kv-bypass-false-is-fine", request(kv=pb.KvOptions(bypass_prefix_cache=False)), dict(model=MODEL)),
    ("guided-backend-without-guide", request(guided=pb.GuidedDecoding(backend="xgrammar")), dict(model=MODEL)),
    (
        "extra-ignored",
        request(extra=struct_pb2.Struct(fields={"unknown": struct_pb2.Value(string_value="x")})),
        dict(model=MODEL),
    ),
]


@pytest.mark.parametrize(
    ("req", "expected"), [case[1:] for case in GOOD_REQUESTS], ids=[case[0] for case in GOOD_REQUESTS]
)
def test_good_request_becomes_a_normalized_plan(req, expected):
    plan = validate(req)
    assert {name: getattr(plan, name) for name in expected} == expected


def test_plan_carries_the_request_metadata():
    metadata = RequestMetadata(routing_key="user-7", target_rank=1, priority=5)
    assert validate(request(), metadata).metadata == metadata


def test_real_tokenizer_counts_prompt_tokens():
    from openengine_serve.common.tokenizers import Qwen3Tokenizer

    tokenizer = Qwen3Tokenizer()
    prompt = "<|im_start|>user\nHello there<|im_end|>"
    plan = validate_generate(request(prompt=prompt), RequestMetadata(), LIMITS, tokenizer.encode)
    assert plan.prompt_token_ids == tokenizer.encode(prompt)
    assert plan.max_tokens == min(16, 64 - len(plan.prompt_token_ids))


# --- metadata ------------------------------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

GOOD_METADATA = [
    ("none", [], RequestMetadata()),
    ("unrelated-keys-ignored", [("user-agent", "grpc-python"), ("openengine-future-key", "x")], RequestMetadata()),
    ("routing-key", [("openengine-routing-key", "user-7")], RequestMetadata(routing_key="user-7")),
    ("routing-key-bytes", [("openengine-routing-key", b"user-7")], RequestMetadata(routing_key="user-7")),
    ("target-rank-zero", [("openengine-target-dp-rank", "0")], RequestMetadata(target_rank=0)),
    ("target-rank-max", [("openengine-target-dp-rank", "4294967295")], RequestMetadata(target_rank=2**32 - 1)),
    ("target-rank-leading-zeros", [("openengine-target-dp-rank", "007")], RequestMetadata(target_rank=7)),
    ("priority-negative", [("openengine-priority", "-5")], RequestMetadata(priority=-5)),
    ("priority-min", [("openengine-priority", "-2147483648")], RequestMetadata(priority=-(2**31))),
    ("priority-max", [("openengine-priority", "+2147483647")], RequestMetadata(priority=2**31 - 1)),
    ("key-case-insensitive", [("OpenEngine-Priority", "3")], RequestMetadata(priority=3)),
    (
        "trace-context",
        [("traceparent", TRACEPARENT), ("tracestate", "a=1"), ("tracestate", "b=2")],
        RequestMetadata(traceparent=TRACEPARENT, tracestate="a=1,b=2"),
    ),
    ("malformed-traceparent-dropped", [("traceparent", "garbage"), ("tracestate", "a=1")], RequestMetadata()),
    ("zero-trace-id-dropped", [("traceparent", "00-" + "0" * 32 + "-00f067aa0ba902b7-01")], RequestMetadata()),
    ("repeated-traceparent-dropped", [("traceparent", TRACEPARENT), ("traceparent", TRACEPARENT)], RequestMetadata()),
]


@pytest.mark.parametrize(
    ("pairs", "expected"), [case[1:] for case in GOOD_METADATA], ids=[case[0] for case in GOOD_METADATA]
)
def test_metadata_is_parsed(pairs, expected):
    assert parse_metadata(pairs) == expected


BAD_METADATA = [
    ("routing-key-twice", [("openengine-routing-key", "a"), ("openengine-routing-key", "a")], "openengine-routing-key"),
    ("priority-twice", [("openengine-priority", "1"), ("openengine-priority", "2")], "openengine-priority"),
    (
        "unknown-openengine-key-twice",
        [("openengine-future-key", "1"), ("openengine-future-key", "1")],
        "openengine-future-key",
    ),
    ("routing-key-empty", [("openengine-routing-key", "")], "openengine-routing-key"),
    ("routing-key-non-ascii", [("openengine-routing-key", "ключ")], "openengine-routing-key"),
    ("routing-key-non-ascii-bytes", [("openengine-routing-key", b"\xff")], "openengine-routing-key"),
    ("target-rank-negative", [("openengine-target-dp-rank", "-1")], "openengine-target-dp-rank"),
    ("target-rank-above-uint32", [("openengine-target-dp-rank", "4294967296")], "openengine-target-dp-rank"),
    ("target-rank-fraction", [("openengine-target-dp-rank", "1.5")], "openengine-target-dp-rank"),
    ("target-rank-space", [("openengine-target-dp-rank", " 1")], "openengine-target-dp-rank"),
    ("target-rank-empty", [("openengine-target-dp-rank", "")], "openengine-target-dp-rank"),
    ("target-rank-fullwidth-digit", [("openengine-target-dp-rank", "１")], "openengine-target-dp-rank"),
    ("target-rank-underscore", [("openengine-target-dp-rank", "1_0")], "openengine-target-dp-rank"),
    ("priority-above-int32", [("openengine-priority", "2147483648")], "openengine-priority"),
    ("priority-below-int32", [("openengine-priority", "-2147483649")], "openengine-priority"),
    ("priority-exponent", [("openengine-priority", "1e3")], "openengine-priority"),
    ("priority-huge", [("openengine-priority", "9" * 5000)], "openengine-priority"),
]


@pytest.mark.parametrize(("pairs", "key"), [case[1:] for case in BAD_METADATA], ids=[case[0] for case in BAD_METADATA])
def test_bad_metadata_is_rejected_naming_the_key(pairs, key):
    with pytest.raises(Refusal) as rejected:
        parse_metadata(pairs)
    assert type(rejected.value) is INVALID
    assert key in rejected.value.message
    assert len(rejected.value.message) < 200


@pytest.mark.parametrize(
    "req", [request(model="m" * 10_000), request(lora_name="l" * 10_000)], ids=["huge-model-name", "huge-lora-name"]
)
def test_client_values_echoed_in_messages_are_cut_short(req):
    with pytest.raises(Refusal) as rejected:
        validate(req)
    assert len(rejected.value.message) < 300


def test_unset_sampling_and_response_plan_as_their_empty_messages():
    """An unset sampling or response message skips its checks: the plan equals that of the empty message set."""
    from openengine_serve.frontend import validation

    assert validation._check_sampling(pb.SamplingParams(), LIMITS) == validation._DEFAULT_SAMPLING
    unset = pb.GenerateRequest(request_id="r", model=MODEL, prompt="Hi")
    empty = pb.GenerateRequest(
        request_id="r",
        model=MODEL,
        prompt="Hi",
        sampling=pb.SamplingParams(),
        response=pb.ResponseOptions(),
        guided=pb.GuidedDecoding(),
        kv=pb.KvOptions(),
    )
    assert not unset.HasField("sampling") and empty.HasField("sampling") and empty.HasField("response")
    assert validate(unset) == validate(empty)
