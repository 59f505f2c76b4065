"""/v1/chat/completions on the real model (SmolLM2-135M-Instruct, llama.cpp), with the official `openai` SDK, on
both gRPC servers: the server renders the model's own chat template, and greedy output equals what Generate
returns for the same rendered prompt."""

from __future__ import annotations

import asyncio
import json
import uuid

import jsonschema
import openai
import pytest

from openengine_serve.chat import render_messages
from openengine_serve.client import Client, served_model

from .conftest import REAL_MODEL, SERVERS, by_output, generate, make_request

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(params=SERVERS)
def chat(request, real_cluster) -> tuple[openai.OpenAI, str]:
    url = real_cluster.http_urls[request.param]
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0), real_cluster.frontends[request.param].target


def rendered(target: str) -> str:
    with Client(target) as client:
        info = served_model(client)
    extra = info.extra
    return render_messages(extra["chat_template"], MESSAGES, bos_token=extra["bos_token"], eos_token=extra["eos_token"])


def test_greedy_chat_equals_generate_of_the_rendered_prompt(chat):
    client, target = chat
    # A fresh cache salt: the prompt is read whole, as the reference (which bypasses the prefix cache) reads it.
    answer = client.chat.completions.create(
        model=REAL_MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"cache_salt": str(uuid.uuid4())}
    )
    responses = generate(target, make_request(rendered(target), max_tokens=16))
    reference = by_output(responses)[0]
    assert answer.choices[0].message.content == reference["text"]
    assert answer.choices[0].message.role == "assistant"
    assert "Paris" in answer.choices[0].message.content
    assert answer.usage.completion_tokens == responses[-1].usage.completion_tokens  # the EOS counted too


def test_cache_prompt_false_reads_the_prompt_whole_and_keeps_nothing(chat):
    """llama-server's cache_prompt: by default a repeated prompt is found in the prefix cache; with false it is
    neither found nor kept."""
    client, _target = chat
    salt = str(uuid.uuid4())

    def cached(**extra) -> int:
        answer = client.chat.completions.create(
            model=REAL_MODEL, messages=MESSAGES, max_tokens=1, extra_body={"cache_salt": salt, **extra}
        )
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_prompt=False) == 0
    assert cached(cache_prompt=False) == 0, "the first request's KV was kept"
    assert cached() == 0  # nothing kept so far: the default reads it whole and keeps it
    assert cached() > 0
    assert cached(cache_prompt=False) == 0


def test_streamed_chat_with_usage_equals_the_whole_answer(chat):
    client, _target = chat
    whole = client.chat.completions.create(model=REAL_MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=REAL_MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_stop_seed_and_penalties(chat):
    client, _target = chat
    # Each call under a salt of its own: its prompt shares no KV with earlier or running requests, so both calls
    # read it alike (a prompt partly shared is read in another batch shape, whose rounding can change a draw).
    two = client.chat.completions.create(
        model=REAL_MODEL, messages=MESSAGES, max_tokens=8, n=2, temperature=1.0, seed=11, presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"cache_salt": f"seed-{uuid.uuid4()}"},
    )  # fmt: skip
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.chat.completions.create(
        model=REAL_MODEL, messages=MESSAGES, max_tokens=8, n=2, temperature=1.0, seed=11, presence_penalty=0.5,
        frequency_penalty=0.5, extra_body={"cache_salt": f"seed-{uuid.uuid4()}"},
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]
    whole = client.chat.completions.create(model=REAL_MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    content = whole.choices[0].message.content
    stop = content.split()[2]
    cut = client.chat.completions.create(model=REAL_MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stop=stop)
    assert cut.choices[0].message.content == content[: content.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_with_top_logprobs(chat):
    client, _target = chat
    answer = client.chat.completions.create(
        model=REAL_MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-4)
    assert "".join(e.token for e in content) == answer.choices[0].message.content


def test_response_format_json_schema_output_validates(chat):
    client, _target = chat
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=REAL_MODEL,
        messages=[{"role": "user", "content": "Give the capital of France and its population as JSON."}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content  # the guide ended it
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_eight_concurrent_async_chats(chat, real_cluster):
    client, _target = chat
    url = str(client.base_url)

    async def main():
        async_client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)

        async def one(i: int) -> str:
            stream = await async_client.chat.completions.create(
                model=REAL_MODEL,
                messages=[{"role": "user", "content": f"Count to {i + 2}."}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        texts = await asyncio.gather(*(one(i) for i in range(8)))
        await async_client.close()
        return texts

    assert all(asyncio.run(main()))
