"""The OpenAI-compatible HTTP API on the simulated engine, on both gRPC servers: the official `openai` SDK as the
client (sync and async, streamed and not), raw HTTP for the SSE wire format, keys, errors and cancellation."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import time
import urllib.parse

import openai
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.coordinator.state import FRONTEND_LOAD_REFRESH_S

from . import processes
from .conftest import MODEL, SERVERS, by_output, collect, request


def sdk(stack, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, **kwargs)


def raw_post(url: str, path: str, body: dict, headers: dict | None = None) -> http.client.HTTPResponse:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    return connection.getresponse()


def test_models_lists_the_served_model_and_its_aliases(stack):
    models = sdk(stack).models.list()
    assert [m.id for m in models.data][0] == MODEL
    assert all(m.object == "model" for m in models.data)


def test_completion_text_and_usage_equal_what_generate_returns(stack):
    answer = sdk(stack).completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, seed=7)
    with stack.client() as client:
        responses = collect(client, request(max_tokens=12, ignore_eos=False))
    reference = by_output(responses)[0]
    choice = answer.choices[0]
    assert choice.text == reference["text"]
    assert choice.finish_reason == ("length" if len(reference["ids"]) == 12 else "stop")
    assert answer.usage.completion_tokens == responses[-1].usage.completion_tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.id.startswith("cmpl-") and answer.object == "text_completion"


def test_streamed_completion_with_usage_adds_up_to_the_whole_answer(stack):
    client = sdk(stack)
    whole = client.completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=10, seed=3, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[1, 2, 3],
            max_tokens=10,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_n_stop_and_logprobs(stack):
    client = sdk(stack)
    two = client.completions.create(model=MODEL, prompt="a", max_tokens=6, n=2, seed=1, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 12
    whole = client.completions.create(model=MODEL, prompt="a", max_tokens=8, seed=5, extra_body={"ignore_eos": True})
    stop = whole.choices[0].text[3:6]
    cut = client.completions.create(
        model=MODEL, prompt="a", max_tokens=8, seed=5, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].text == whole.choices[0].text.split(stop)[0]
    assert cut.choices[0].finish_reason == "stop"
    scored = client.completions.create(model=MODEL, prompt="a", max_tokens=4, seed=5, logprobs=3)
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) > 0
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == scored.choices[0].text


def test_eight_concurrent_async_streams_each_get_their_whole_answer(stack):
    async def main():
        client = openai.AsyncOpenAI(base_url=stack.http_url, api_key="unused", max_retries=0)

        async def one(seed: int) -> tuple[str, str]:
            streamed = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=20, seed=seed, stream=True, extra_body={"ignore_eos": True}
            )
            text = "".join([c.choices[0].text async for c in streamed if c.choices])
            whole = await client.completions.create(
                model=MODEL, prompt="x", max_tokens=20, seed=seed, extra_body={"ignore_eos": True}
            )
            return text, whole.choices[0].text

        results = await asyncio.gather(*(one(seed) for seed in range(8)))
        await client.close()
        return results

    for streamed, whole in asyncio.run(main()):
        assert streamed == whole and streamed


def test_sse_wire_format_ends_with_done(stack):
    response = raw_post(
        stack.http_url,
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "ignore_eos": True},
    )
    assert response.status == 200
    assert response.getheader("content-type").startswith("text/event-stream")
    events = response.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[len("data: ") :])["object"] == "text_completion"


def test_errors_have_openai_shapes_and_statuses(stack):
    client = sdk(stack)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt="a", max_tokens=2)
    assert unknown.value.body["type"] == "not_found_error" and "no-such-model" in unknown.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="a", max_tokens=10_000_000)
    assert "max_tokens" in too_long.value.body["message"]
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert tools.value.body["param"] == "tools" and "tool calling is not supported" in tools.value.body["message"]
    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
        )
    assert image.value.body["param"] == "messages[0].content[0].type"
    response = raw_post(stack.http_url, "/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"1": 5}})
    assert response.status == 400 and json.loads(response.read())["error"]["param"] == "logit_bias"


def test_health_and_readiness(stack):
    base = stack.http_url.removesuffix("/v1")
    parts = urllib.parse.urlsplit(base)
    for path in ("/health", "/ready"):
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        connection.request("GET", path)
        assert connection.getresponse().status == 200


@pytest.fixture(scope="module", params=SERVERS)
def keyed_http(request, cluster, tmp_path_factory):
    coord, _nodes = cluster
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text("user alice k-alice-http\n")
    frontend, url = processes.with_http(
        processes.frontend(
            coord.target,
            request.param,
            OPENENGINE_API_KEYS_FILE=str(path),
            OPENENGINE_ALLOW_PLAINTEXT_KEYS="1",
            OPENENGINE_API_KEY_MAX_IN_FLIGHT="1",
        )
    )
    try:
        frontend.start()
        processes.wait_for(lambda: _ready(url), 60, "the keyed frontend's HTTP readiness")
        yield url
    finally:
        frontend.stop()


def _ready(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    try:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=2)
        connection.request("GET", "/ready")
        return connection.getresponse().status == 200
    except OSError:
        return False


def test_api_keys_are_checked_on_http(keyed_http):
    wrong = openai.OpenAI(base_url=keyed_http, api_key="k-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="a", max_tokens=2)
    right = openai.OpenAI(base_url=keyed_http, api_key="k-alice-http", max_retries=0)
    assert right.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.PermissionDeniedError):  # a priority above the default is a right of the key
        right.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_headers={"openengine-priority": "5"})


def test_a_key_at_its_limit_gets_429_with_retry_after(keyed_http):
    auth = {"Authorization": "Bearer k-alice-http"}
    long = {"model": MODEL, "prompt": "x", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    first = raw_post(keyed_http, "/v1/completions", long, auth)
    assert first.status == 200
    first.readline()  # running: the key's one stream on this worker
    try:
        second = raw_post(keyed_http, "/v1/completions", {**long, "stream": False}, auth)
        assert second.status == 429 and second.getheader("retry-after") == "1"
        assert json.loads(second.read())["error"]["type"] == "rate_limit_error"
    finally:
        first.close()


@pytest.mark.parametrize("server", SERVERS)
def test_a_disconnected_stream_frees_its_engine_slot_within_a_second(slow_cluster, server):
    slow_cluster.frontend(server)
    url = slow_cluster.http_urls[server]
    processes.wait_for(lambda: slow_cluster.node_running() == 0, 10, "an idle node before the test")
    response = raw_post(
        url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    )
    assert response.status == 200
    response.readline()  # the first chunk: the request runs on the node
    processes.wait_for(lambda: slow_cluster.node_running() == 1, 10, "the request running on the node")
    response.close()  # the client leaves: the socket closes
    left = time.monotonic()
    processes.wait_for(lambda: slow_cluster.node_running() == 0, 5, "the engine slot freed", interval=0.05)
    assert time.monotonic() - left < 1.0


def test_generate_still_answers_beside_http(stack):
    with stack.client() as client:
        responses = collect(client, request(max_tokens=3))
    assert responses[-1].WhichOneof("event") == "finished"
    assert responses[-1].finished.reason == G.FINISH_REASON_LENGTH


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
RENDERED = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
)


def test_chat_renders_the_template_on_the_server_and_equals_generate_of_the_rendered_prompt(stack):
    answer = sdk(stack).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, seed=4)
    with stack.client() as client:
        responses = collect(client, request(RENDERED, max_tokens=10, seed=4, ignore_eos=False))
    reference = by_output(responses)[0]
    assert answer.choices[0].message.content == reference["text"]
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.completion_tokens == responses[-1].usage.completion_tokens
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")


def test_streamed_chat_with_usage_n_stop_and_top_logprobs(stack):
    client = sdk(stack)
    extra = {"ignore_eos": True}
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, seed=9, n=2, extra_body=extra)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=10, seed=9, n=2, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
    )  # fmt: skip
    for index in (0, 1):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == index]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == whole.choices[index].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20 == whole.usage.completion_tokens
    content = whole.choices[0].message.content
    stop = content[4:7]
    cut = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, seed=9, stop=stop, extra_body=extra)
    assert cut.choices[0].message.content == content.split(stop)[0] and cut.choices[0].finish_reason == "stop"
    scored = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, seed=9, logprobs=True, top_logprobs=2, extra_body=extra
    )
    entries = scored.choices[0].logprobs.content
    assert len(entries) == 5 and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries) == scored.choices[0].message.content


# Load figures alone reach the frontends at most every FRONTEND_LOAD_REFRESH_S, after the node's next heartbeat to
# the coordinator and the frontend's next one: a gauge moves within that and two heartbeats.
LOAD_NEWS_S = FRONTEND_LOAD_REFRESH_S + 10


@pytest.mark.parametrize("server", SERVERS)
def test_gateway_gauges_follow_the_nodes_load(slow_cluster, deployment, server):
    """What an inference gateway's endpoint picker scrapes from each frontend: queued, running, KV-cache use."""
    frontend, metrics_port = processes.with_metrics(processes.frontend(slow_cluster.coordinator.target, server))
    frontend, url = processes.with_http(frontend)
    deployment.add(frontend)

    def gauge(name: str) -> float:
        return processes.metric(processes.scrape(metrics_port), f"openengine_frontend_nodes_{name}")

    processes.wait_for(lambda: gauge("running_requests") == 0, LOAD_NEWS_S, "an idle node")
    long = {"model": MODEL, "prompt": "x", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    response = raw_post(url, "/v1/completions", long)
    response.readline()
    try:
        processes.wait_for(lambda: gauge("running_requests") == 1, LOAD_NEWS_S, "the running request in the gauge")
        processes.wait_for(lambda: 0 < gauge("kv_cache_usage_ratio") < 1, LOAD_NEWS_S, "its KV cache in use")
        assert gauge("queued_requests") == 0
    finally:
        response.close()
    processes.wait_for(lambda: gauge("running_requests") == 0, LOAD_NEWS_S, "the gauge back to 0")


@pytest.mark.parametrize("server", SERVERS)
def test_draining_refuses_new_requests_with_503_and_finishes_the_streams_in_flight(slow_cluster, deployment, server):
    frontend, url = processes.with_http(processes.frontend(slow_cluster.coordinator.target, server))
    deployment.add(frontend)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "stream": True, "ignore_eos": True}  # ~2 s of steps
    in_flight = raw_post(url, "/v1/completions", body)
    assert in_flight.status == 200
    in_flight.readline()
    frontend.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = raw_post(url, "/v1/completions", {**body, "stream": False})
    assert refused.status == 503 and "draining" in json.loads(refused.read())["error"]["message"]
    events = in_flight.read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    assert frontend.proc.wait(timeout=30) == 0


def test_every_worker_serves_the_shared_http_port(cluster, deployment):
    """Two workers bind the HTTP port with SO_REUSEPORT, as the gRPC port: two listeners, and requests on new
    connections are answered (the kernel spreads them over both)."""
    coord, _nodes = cluster
    frontend, url = processes.with_http(processes.frontend(coord.target, "grpcio", "--workers", "2"))
    deployment.add(frontend)
    # Each worker loads the tokenizer on its own: ready once fresh connections (spread by the kernel) all say so
    processes.wait_for(lambda: all(_ready(url) for _ in range(16)), 30, "HTTP readiness of both workers")
    port = urllib.parse.urlsplit(url).port
    listening = [
        line.split()
        for line in open("/proc/net/tcp").read().splitlines()[1:]
        if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"  # 0A: LISTEN
    ]
    assert len(listening) == 2, listening
    for _ in range(16):
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as fresh:
            assert fresh.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens >= 1
