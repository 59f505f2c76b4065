"""Guided decoding and the prefix cache on the real model (llama.cpp engine), on both gRPC servers; and their
refusal by the simulated engine."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2, model_pb2
from openengine_serve.client import AsyncClient, Client

from .conftest import MODEL, SERVERS, by_output, generate, make_request, real_cluster_with, request

G = generation_pb2


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def text_of(responses) -> str:
    return by_output(responses)[0]["text"]


async def generate_all(target: str, requests: list[G.GenerateRequest]) -> list[list[G.GenerateResponse]]:
    async with AsyncClient(target) as client:

        async def one(req):
            return [r async for r in client.inference.Generate(req, timeout=300)]

        return await asyncio.gather(*(one(req) for req in requests))


def schemas() -> list[dict]:
    """20 JSON schemas: nested objects, arrays, enums, numbers with ranges, required fields (every string and
    array bounded and objects closed, so a small model's answer ends)."""
    name = {"type": "string", "minLength": 1, "maxLength": 20}
    out = [
        {
            "type": "object",
            "properties": {"name": name, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
        {
            "type": "object",
            "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
            "required": ["score"],
        },
        {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": name, "minItems": 1, "maxItems": 3}},
            "required": ["tags"],
        },
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                        "email": {"type": "string", "maxLength": 30},
                    },
                    "required": ["id"],
                }
            },
            "required": ["user"],
        },
        {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": name}, "required": ["ok"]},
        {
            "type": "object",
            "properties": {
                "point": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": -10, "maximum": 10},
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["point"],
        },
        {
            "type": "object",
            "properties": {
                "level": {"enum": ["low", "medium", "high"]},
                "value": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["level", "value"],
        },
        {
            "type": "object",
            "properties": {
                "city": name,
                "country": name,
                "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
            },
            "required": ["city", "country"],
        },
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"sku": name, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
        },
        {
            "type": "object",
            "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
            "required": ["answer"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -50, "maximum": 50},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["temperature", "unit"],
        },
        {
            "type": "object",
            "properties": {
                "title": name,
                "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "maxItems": 2},
            },
            "required": ["title", "year"],
        },
        {
            "type": "object",
            "properties": {
                "a": {
                    "type": "object",
                    "properties": {
                        "b": {
                            "type": "object",
                            "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["c"],
                        }
                    },
                    "required": ["b"],
                }
            },
            "required": ["a"],
        },
        {
            "type": "object",
            "properties": {"priority": {"type": "integer", "minimum": 1, "maximum": 3}, "done": {"type": "boolean"}},
            "required": ["priority", "done"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "name": name,
                "languages": {
                    "type": "array",
                    "items": {"enum": ["python", "rust", "go"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["name", "languages"],
        },
        {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
        },
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["open", "closed"]},
                "count": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["status"],
        },
        {
            "type": "object",
            "properties": {"first": name, "last": name, "middle": {"type": ["string", "null"], "maxLength": 10}},
            "required": ["first", "last", "middle"],
        },
        {
            "type": "object",
            "properties": {
                "matrix": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}},
                }
            },
            "required": ["matrix"],
        },
    ]
    assert len(out) == 20
    return [closed(schema) for schema in out]


def closed(schema):
    """Every object of the schema without additional properties (as structured-output APIs' strict modes ask):
    the model writes the listed ones, not names of its own without end."""
    if isinstance(schema, dict):
        schema = {key: closed(value) for key, value in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(value) for value in schema]
    return schema


# ------------------------------------------------------------------ guided decoding


async def test_20_json_schemas_every_output_validates(target):
    requests = [
        make_request(
            chat(f"Give an example JSON object for: {json.dumps(schema)}"),
            max_tokens=200,
            temperature=0.7,
            sampling__seed=i,
            guided__json_schema=json.dumps(schema),
        )
        for i, schema in enumerate(schemas())
    ]
    outputs = await generate_all(target, requests)
    for schema, responses in zip(schemas(), outputs):
        finished = by_output(responses)[0]["finished"][0]
        assert finished.reason == G.FINISH_REASON_STOP, f"the object ended before max_tokens: {text_of(responses)!r}"
        jsonschema.validate(json.loads(text_of(responses)), schema)


async def test_a_regex_and_a_choice_always_hold(target):
    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    choices = ["apple", "banana", "cherry", "date", "elderberry"]
    requests = [
        make_request(chat("When did it happen?"), max_tokens=30, temperature=1.0, sampling__seed=i, guided__regex=date)
        for i in range(6)
    ]
    requests += [
        make_request(
            chat("Name a fruit."),
            max_tokens=30,
            temperature=1.0,
            sampling__seed=i,
            guided__choice=G.ChoiceConstraint(choices=choices),
        )
        for i in range(6)
    ]
    outputs = await generate_all(target, requests)
    for responses in outputs[:6]:
        assert re.fullmatch(date, text_of(responses)), text_of(responses)
    assert all(text_of(responses) in choices for responses in outputs[6:])


LARK = r"""
start: sentence
sentence: subject " " verb " " object "."
subject: "The cat" | "A dog" | "My friend"
verb: "sees" | "likes" | "follows"
object: "the moon" | "a bird" | "the river"
"""
GBNF = r"""
root ::= "[" item ("," item)? ("," item)? ("," item)? "]"
item ::= [0-9] | [0-9] [0-9]
"""


# What each grammar's language is, as a regular expression (both are regular). Both languages are finite, their
# longest sentence under 40 tokens (max_tokens): whatever the model picks, the output is a whole sentence.
PARSES = {
    "lark": r"(The cat|A dog|My friend) (sees|likes|follows) (the moon|a bird|the river)\.",
    "gbnf": r"\[\d{1,2}(,\d{1,2}){0,3}\]",
}


@pytest.mark.parametrize("dialect, grammar", [("lark", LARK), ("gbnf", GBNF)])
def test_an_ebnf_grammars_output_parses(target, dialect, grammar):
    for seed in range(3):
        req = make_request(
            chat("Say something."), max_tokens=40, temperature=1.0, sampling__seed=seed, guided__ebnf_grammar=grammar
        )
        text = text_of(generate(target, req))
        assert re.fullmatch(PARSES[dialect], text), text


def test_json_object_gives_an_object(target):
    text = text_of(
        generate(
            target,
            make_request(chat("Describe a cat as JSON."), max_tokens=150, guided__json_object=G.JsonObjectConstraint()),
        )
    )
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("json_schema", '{"type": "nope"}', "guided.json_schema is not valid"),
        ("json_schema", "{not json", "guided.json_schema is not valid JSON"),
        ("regex", "(unclosed", "guided.regex is not valid"),
        ("ebnf_grammar", "start: ??", "guided.ebnf_grammar is not valid"),
        ("structural_tag", '{"structures": []}', "guided.structural_tag must be a JSON object with non-empty"),
        ("json_schema", json.dumps({"type": "string", "pattern": "x" * 70000}), "OPENENGINE_MAX_GUIDE_BYTES"),
    ],
)
def test_invalid_guides_are_refused_naming_the_field(target, field, value, says):
    with pytest.raises(grpc.RpcError) as refused:
        generate(target, make_request(max_tokens=4, **{f"guided__{field}": value}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in refused.value.details()


def test_model_info_advertises_guides_and_the_prefix_cache(target):
    with Client(target) as client:
        info = client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model="SmolLM2-135M-Instruct"), timeout=10)
    guided = info.generation.guided_decoding
    assert guided.supported and len(guided.modes) == 6
    assert info.generation.supports_cache_salt and info.generation.supports_prefix_cache_bypass


def test_the_simulated_engine_refuses_guides_and_cache_fields_naming_llama_cpp(stack):
    with stack.client() as client:
        for fields, says in (
            ({"guided": G.GuidedDecoding(regex="a+")}, "guided decoding is not served"),
            ({"kv": G.KvOptions(cache_salt="t")}, "the prefix cache is not served"),
        ):
            req = request()
            for name, message in fields.items():
                getattr(req, name).CopyFrom(message)
            with pytest.raises(grpc.RpcError) as refused:
                list(client.inference.Generate(req, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert says in refused.value.details() and "llama.cpp engine serves it" in refused.value.details()
        info = client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model=MODEL), timeout=10)
    assert not info.generation.guided_decoding.supported and not info.generation.supports_cache_salt


# ------------------------------------------------------------------ the prefix cache

SYSTEM = ("You are a meticulous assistant for a library. " * 12).strip()  # about 120 tokens


@pytest.fixture(scope="module")
def small_cache_node():
    """A llama.cpp node whose KV cache has 256 cells and whose steps hold at most 36 tokens: ggml's CPU flash
    attention then takes the same kernel for a prompt read whole or from the prefix cache (docs/engines.md,
    batch invariance), so greedy outputs with and without the cache can be compared token for token."""
    with real_cluster_with("--context-size", "256", "--prefill-chunk", "32", "--max-batch", "4") as cluster:
        yield cluster


@pytest.fixture(params=SERVERS)
def small_target(request, small_cache_node) -> str:
    return small_cache_node.frontends[request.param].target


def test_a_shared_prefix_is_read_once_and_greedy_output_is_the_same(small_target, small_cache_node):
    prompt = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nRecommend a book.<|im_end|>\n"
    prefill = lambda: small_cache_node.node_metric("openengine_node_prefill_tokens_total")  # noqa: E731
    hits = lambda: small_cache_node.node_metric("openengine_node_prefix_cache_hit_tokens_total")  # noqa: E731
    salt = f"cache-test-{small_target}"  # a salt of this test's own: nothing another test cached is reused
    before = prefill(), hits()
    first = generate(small_target, make_request(prompt, max_tokens=16, kv__cache_salt=salt))
    after_first = prefill(), hits()
    second = generate(small_target, make_request(prompt, max_tokens=16, kv__cache_salt=salt))
    after_second = prefill(), hits()
    bypass = generate(
        small_target, make_request(prompt, max_tokens=16, kv__cache_salt=salt, kv__bypass_prefix_cache=True)
    )
    after_bypass = prefill(), hits()
    prompt_tokens = first[-1].usage.prompt_tokens
    assert after_first[0] - before[0] == prompt_tokens and after_first[1] == before[1], "the first reads it all"
    assert second[-1].usage.cached_prompt_tokens == after_second[1] - after_first[1] == prompt_tokens - 1
    assert after_second[0] - after_first[0] == 1, "the second reads only its last prompt token"
    assert after_bypass[0] - after_second[0] == prompt_tokens and after_bypass[1] == after_second[1]
    assert bypass[-1].usage.cached_prompt_tokens == 0
    assert text_of(first) == text_of(second) == text_of(bypass), "greedy output is the same with and without"


def test_prompt_logprobs_read_their_rows_past_the_prefix_cache(small_target, small_cache_node):
    prompt = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nName a poem.<|im_end|>\n"
    salt = f"logprobs-test-{small_target}"
    generate(small_target, make_request(prompt, max_tokens=4, kv__cache_salt=salt))  # now in the cache

    def prompt_tokens(start: int) -> tuple[list, generation_pb2.Usage]:
        responses = generate(
            small_target,
            make_request(
                prompt,
                max_tokens=1,
                kv__cache_salt=salt,
                response__return_prompt_logprobs=True,
                response__prompt_logprob_start=start,
            ),
        )
        prompt_events = [r.prompt for r in responses if r.WhichOneof("event") == "prompt"]
        assert len(prompt_events) == 1, "prompt logprobs are sent even when the prompt is cached"
        return list(prompt_events[0].tokens), responses[-1].usage

    every, usage = prompt_tokens(0)
    assert usage.cached_prompt_tokens == 0 and len(every) == usage.prompt_tokens > 100
    from_100, usage = prompt_tokens(100)
    assert usage.cached_prompt_tokens == 99, "only the rows before the first logprob asked come from the cache"
    assert [t.token_id for t in from_100] == [t.token_id for t in every[100:]]
    # Rows read in another batch shape differ by up to ~0.2 in llama.cpp's CPU kernels (llama.cpp's own logits
    # do, at n_batch 512 against 32); a row read for the wrong position would be off by whole units.
    assert [t.logprob for t in from_100] == pytest.approx([t.logprob for t in every[100:]], abs=0.3)


def test_different_cache_salts_never_share_kv(small_target, small_cache_node):
    prompt = f"<|im_start|>system\n{SYSTEM} Salted.<|im_end|>\n<|im_start|>user\nHi.<|im_end|>\n"
    hits = lambda: small_cache_node.node_metric("openengine_node_prefix_cache_hit_tokens_total")  # noqa: E731
    generate(small_target, make_request(prompt, max_tokens=4, kv__cache_salt=f"tenant-a-{small_target}"))
    before = hits()
    other = generate(small_target, make_request(prompt, max_tokens=4, kv__cache_salt=f"tenant-b-{small_target}"))
    assert hits() == before and other[-1].usage.cached_prompt_tokens == 0
    same = generate(small_target, make_request(prompt, max_tokens=4, kv__cache_salt=f"tenant-a-{small_target}"))
    assert same[-1].usage.cached_prompt_tokens > 0, "the same salt does share"


def test_the_cli_writes_structured_output(target, tmp_path):
    import subprocess
    import sys

    schema = schemas()[0]
    path = tmp_path / "person.json"
    path.write_text(json.dumps(schema))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "generate",
            "--target",
            target,
            "--chat",
            "--prompt",
            "Invent a person.",
            "--json-schema",
            str(path),
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)
    choice = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "generate",
            "--target",
            target,
            "--chat",
            "--prompt",
            "Is the sky blue?",
            "--choice",
            "yes",
            "--choice",
            "no",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert choice.returncode == 0 and choice.stdout.strip() in ("yes", "no"), choice.stdout + choice.stderr
