"""The llama.cpp engine with the real model (SmolLM2-135M-Instruct), end to end, on both gRPC servers.

One coordinator and one llama.cpp node for the module; the model is loaded once
in the node's engine worker and once here, in llama-cpp-python's own high-level
API, as the reference the served tokens are compared with.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
import uuid

import grpc
import numpy as np
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2, lifecycle_pb2, model_pb2, server_pb2
from openengine_serve.client import AsyncClient, Client
from openengine_serve.engine.model_card import default_model_path

from ..greedy_reference import first_beyond_near_tie, reference_model
from . import processes
from .conftest import REAL_MODEL as MODEL
from .conftest import SERVERS, THREADS, by_output, generate, llama_reference, make_request, output_ids
from .processes import Deployment, wait_for

G = generation_pb2
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWrite a haiku about the sea<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def reference():
    """llama-cpp-python's own high-level API on the same GGUF, with the engine's numerics."""
    return llama_reference(default_model_path())


def reference_greedy(reference, prompt_ids: list[int], max_tokens: int) -> list[int]:
    tokens = []
    for token in reference.generate(prompt_ids, temp=0.0, reset=True):
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens


def prompt_ids(reference, text: str) -> list[int]:
    return reference.tokenize(text.encode(), add_bos=True, special=True)


# ------------------------------------------------------------------ what the frontend reports


def test_model_info_reports_the_loaded_model(target):
    with Client(target) as client:
        server = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10)
        info = client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model=MODEL), timeout=10)
    assert list(server.supported_models) == [MODEL, "SmolLM2-135M-Instruct.Q4_1"]
    assert server.extra["engine"] == "llama.cpp"
    assert (info.model_id, info.max_context_length, info.max_output_tokens) == (MODEL, 8192, 8192)
    assert list(info.tokenizer_modes) == ["llama.cpp:gpt2"]
    assert info.extra["vocab_size"] == 49152
    assert list(info.extra["end_of_generation_token_ids"]) == [0, 2, 4]  # <|endoftext|>, <|im_end|>, <file_sep>
    assert "<|im_start|>" in info.extra["chat_template"]


def test_the_engine_worker_logs_its_kv_layout_on_the_nodes_stderr(real_cluster):
    """The worker is an MPI-spawned process of its own: its log lines reach the node's stderr in the same
    key=value form, at the node's log level."""
    node = real_cluster.node
    log = (processes.LOG_DIR / f"{node.name}-{node.port}.log").read_text()
    layout = [line for line in log.splitlines() if 'component=engine-worker event="KV layout"' in line]
    assert layout, log[-3000:]
    # the node's defaults: 32 outputs over 16,384 cells, a stream of 512 each beside the shared cache
    assert layout[-1].endswith("streams=32 stream_cells=512 shared_cells=16384"), layout[-1]


# ------------------------------------------------------------------ correctness against the reference


def test_greedy_request_alone_is_llama_cpp_python_greedy_within_the_near_tie_margin(target, greedy_reference):
    """Every served token is the reference's top token given the tokens before it, or within NEAR_TIE of it: a
    node that has served other requests holds its KV cells in another order, which can flip a near tie."""
    for text in PROMPTS:
        ids = prompt_ids(greedy_reference, text)
        responses = generate(target, make_request(ids, max_tokens=48))
        served = output_ids(responses)
        finished = by_output(responses)[0]["finished"][0]
        if len(served) < 48:  # ended by an end-of-turn token (not streamed) the reference chose there too
            assert responses[-1].usage.completion_tokens == len(served) + 1
            served_with_end = served + [finished.stop_match.eos_token_id]
        else:
            served_with_end = served
        beyond = first_beyond_near_tie(greedy_reference, ids, served_with_end)
        assert beyond is None, f"prompt {text!r}: {beyond}"


def test_prompt_text_is_tokenized_as_llama_tokenize(target, reference):
    for text in PROMPTS + ["  runs   of\tspaces\n\n", "emoji 🎉👩‍👩‍👧 and 日本語"]:
        responses = generate(target, make_request(text, max_tokens=1, response__return_prompt_logprobs=True))
        assert [t.token_id for t in responses[0].prompt.tokens] == prompt_ids(reference, text)
        assert responses[-1].usage.prompt_tokens == len(prompt_ids(reference, text))


def test_first_token_logprobs_are_the_log_softmax_of_the_model_logits(target):
    with_logits = llama_reference(default_model_path(), n_ctx=512, logits_all=True)
    ids = with_logits.tokenize(PROMPTS[0].encode(), add_bos=True, special=True)
    with_logits.eval(ids)
    row = np.asarray(with_logits.scores[len(ids) - 1], np.float64)
    logprobs = row - row.max() - math.log(np.exp(row - row.max()).sum())  # computed here, independently

    def first_token(**fields) -> G.TokenInfo:
        req = make_request(ids, max_tokens=1, response__return_output_logprobs=True, **fields)
        req.response.output_candidates.top_n = 5
        return next(r for r in generate(target, req) if r.WhichOneof("event") == "token").token.tokens[0]

    greedy = first_token()
    assert greedy.token_id == int(row.argmax()) and greedy.rank == 1
    assert greedy.logprob == pytest.approx(logprobs[greedy.token_id], abs=1e-4)
    top = np.argsort(-logprobs, kind="stable")[:5]
    assert [c.token_id for c in greedy.candidates] == top.tolist()
    assert [c.logprob for c in greedy.candidates] == pytest.approx(logprobs[top].tolist(), abs=1e-4)
    assert [c.rank for c in greedy.candidates] == [1, 2, 3, 4, 5]
    sampled = first_token(temperature=2.0, sampling__seed=3)  # a draw from the same row: its own logprob and rank
    assert sampled.logprob == pytest.approx(logprobs[sampled.token_id], abs=1e-4)
    assert sampled.rank == int((logprobs > logprobs[sampled.token_id]).sum()) + 1


# ------------------------------------------------------------------ sampling


def test_a_seed_gives_the_same_tokens_and_another_seed_others(target):
    def sampled(seed: int) -> list[int]:
        req = make_request(PROMPTS[2], max_tokens=32, temperature=0.9, sampling__seed=seed, ignore_eos=True)
        return output_ids(generate(target, req))

    first = sampled(11)
    assert sampled(11) == first
    assert sampled(12) != first


def test_top_k_top_p_and_min_p_bound_what_is_sampled(target):
    """Temperature 1 and no penalties: the raw logprobs are the sampling distribution, so each bound is checked
    on every sampled token with its rank and the candidates above it."""

    def tokens(**sampling):
        req = make_request(
            PROMPTS[2],
            max_tokens=40,
            temperature=1.0,
            ignore_eos=True,
            sampling__seed=5,
            response__return_output_logprobs=True,
        )
        req.response.output_candidates.top_n = 20
        for name, value in sampling.items():
            setattr(req.sampling, name, value)
        return [t for r in generate(target, req) if r.WhichOneof("event") == "token" for t in r.token.tokens]

    assert max(t.rank for t in tokens(top_k=3)) <= 3
    assert max(t.rank for t in tokens()) > 3, "without top_k the draw reaches beyond rank 3"
    for t in tokens(top_p=0.5):  # the tokens ranked above the sampled one hold less than top_p
        above = sum(math.exp(c.logprob) for c in t.candidates if c.rank < t.rank)
        assert above < 0.5 + 1e-6
    for t in tokens(min_p=0.3):
        assert math.exp(t.logprob) >= 0.3 * math.exp(t.candidates[0].logprob) - 1e-9


# Prompts whose greedy continuations of 64 tokens repeat themselves (code, lists, verse).
REPEATING = [
    "def fibonacci(n):",
    "for i in range(10):",
    "1, 2, 3, 4,",
    "Roses are red, violets are blue,",
    "The list of fruits: apple, banana,",
    "<|im_start|>user\nCount to twenty<|im_end|>\n<|im_start|>assistant\n",
    "SELECT name FROM users WHERE",
    "Once upon a time, in a small village,",
]


async def test_penalties_lower_repeats_over_a_set_of_prompts(target):
    """A penalty changes which token is most likely, so on one prompt its greedy output may even repeat more;
    over a set of prompts each penalty must lower the repeats on average."""
    async with AsyncClient(target) as client:

        async def greedy(text: str, **sampling) -> list[int]:
            req = make_request(text, max_tokens=64, ignore_eos=True)
            for name, value in sampling.items():
                setattr(req.sampling, name, value)
            return output_ids([r async for r in client.inference.Generate(req, timeout=120)])

        async def outputs(**sampling) -> list[list[int]]:
            return await asyncio.gather(*(greedy(text, **sampling) for text in REPEATING))

        plain = await outputs()
        penalized = {
            name: await outputs(**{name: value})
            for name, value in (("repetition_penalty", 1.5), ("frequency_penalty", 1.0), ("presence_penalty", 1.5))
        }
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    mean = lambda runs: sum(map(repeats, runs)) / len(runs)  # noqa: E731
    for name, runs in penalized.items():
        assert sum(a != b for a, b in zip(runs, plain)) >= len(plain) // 2, f"{name} changes the greedy outputs"
        assert mean(runs) < mean(plain), f"{name}: {[repeats(r) for r in runs]} vs {[repeats(r) for r in plain]}"


def test_num_sequences_each_output_its_own_draw(target):
    req = make_request(
        PROMPTS[2], max_tokens=20, temperature=1.0, ignore_eos=True, sampling__seed=9, sampling__num_sequences=3
    )
    outputs = by_output(generate(target, req))
    assert sorted(outputs) == [0, 1, 2]
    assert all(len(o["ids"]) == 20 and len(o["finished"]) == 1 for o in outputs.values())
    assert len({tuple(o["ids"]) for o in outputs.values()}) == 3
    greedy = by_output(generate(target, make_request(PROMPTS[2], max_tokens=12, sampling__num_sequences=2)))
    assert greedy[0]["ids"] == greedy[1]["ids"], "greedy outputs of one prompt agree"


def test_min_tokens_and_ignore_eos_hold_back_the_end(target, reference):
    chat = PROMPTS[3]
    ended = generate(target, make_request(chat, max_tokens=200))
    natural = output_ids(ended)
    assert by_output(ended)[0]["finished"][0].stop_match.eos_token_id == 2, "the model ends its answer by itself"
    longer = generate(target, make_request(chat, max_tokens=200, min_tokens=len(natural) + 5))
    assert len(output_ids(longer)) >= len(natural) + 5
    exact = generate(target, make_request(chat, max_tokens=len(natural) + 10, ignore_eos=True))
    assert len(output_ids(exact)) == len(natural) + 10
    assert not set(output_ids(exact)) & {0, 2, 4}, "ignore_eos: no end-of-generation token is sampled"


def test_stop_text_across_tokens_and_stop_token_ids(target, reference):
    ids = prompt_ids(reference, PROMPTS[2])
    # The stops are made from what this node serves greedily (a near tie may flip against the reference).
    greedy = output_ids(generate(target, make_request(ids, max_tokens=30, ignore_eos=True)))
    text = reference.detokenize(greedy).decode()
    pieces = [reference.detokenize([t]).decode() for t in greedy]
    # a stop string made of the end of one token and the start of the next
    index = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[index][-2:] + pieces[index + 1][:2]
    start = text.index(stop)
    responses = generate(
        target,
        make_request(ids, max_tokens=30, ignore_eos=True, stopping__conditions=[G.StopCondition(stop_text=stop)]),
    )
    out = by_output(responses)[0]
    assert out["text"] == text[:start]
    assert out["finished"][0].stop_match.stop_text == stop
    kept = by_output(
        generate(
            target,
            make_request(
                ids,
                max_tokens=30,
                ignore_eos=True,
                include_stop_in_output=True,
                conditions=[G.StopCondition(stop_text=stop)],
            ),
        )
    )[0]
    assert kept["text"] == text[: start + len(stop)]
    token_stop = greedy[10]
    stopped = by_output(
        generate(
            target,
            make_request(ids, max_tokens=30, ignore_eos=True, conditions=[G.StopCondition(stop_token_id=token_stop)]),
        )
    )[0]
    assert stopped["ids"] == greedy[: greedy.index(token_stop)], "the stop token ends it, not streamed"
    assert stopped["finished"][0].stop_match.stop_token_id == token_stop


def test_too_many_asked_candidate_ids_are_refused(target):
    req = make_request(max_tokens=1, response__return_output_logprobs=True)
    req.response.output_candidates.token_ids.ids.extend(range(21))
    with pytest.raises(grpc.RpcError) as refused:
        generate(target, req)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 20 token ids" in refused.value.details()


# ------------------------------------------------------------------ batching


async def test_32_concurrent_streams_complete_with_their_usage(target, reference):
    async with AsyncClient(target) as client:

        async def one(i: int):
            text = PROMPTS[i % len(PROMPTS)]
            req = make_request(text, max_tokens=16 + i % 8, ignore_eos=True, temperature=0.7, sampling__seed=i)
            return i, [r async for r in client.inference.Generate(req, timeout=120)]

        results = await asyncio.gather(*(one(i) for i in range(32)))
    for i, responses in results:
        usage = responses[-1].usage
        assert usage.completion_tokens == 16 + i % 8 == len(output_ids(responses))
        assert usage.prompt_tokens == len(prompt_ids(reference, PROMPTS[i % len(PROMPTS)]))


TEMPLATES = [
    "A short poem about {}:\n",
    "Five facts about {}:\n1.",
    "The history of {} began",
    "def describe_{}():\n    return",
    "<|im_start|>user\nWhat do you think of {}?<|im_end|>\n<|im_start|>assistant\n",
    "My favourite thing about {} is",
    "Q: Where can I learn about {}?\nA:",
    "Breaking news about {}:",
]
SUBJECTS = ["the sea", "Paris", "cats", "volcanoes", "jazz", "the moon", "chess", "bread"]
# A system prompt the streams of the prefix-cache run share (about 120 tokens).
SHARED = "<|im_start|>system\n" + "You are a meticulous assistant for a library. " * 12 + "<|im_end|>\n"


@pytest.fixture(scope="module")
def greedy_reference():
    """llama-cpp-python's own API, keeping every position's logits (tests/greedy_reference.py)."""
    return reference_model()


@pytest.mark.parametrize("cache", ["bypass", "prefix-cache"])
async def test_64_concurrent_greedy_streams_are_each_their_own_prompts_greedy_continuation(
    target, greedy_reference, cache
):
    """Zero loss on the real engine: each of 64 concurrent greedy streams gets, at every position, a token the
    reference (llama-cpp-python's logits given the stream's prompt and its tokens before) ranks first or within
    NEAR_TIE of the first (batch invariance, docs/engines.md), and no stream gets another's tokens. With the
    prefix cache (on by default), the streams share a system prompt a first request left in the cache."""
    texts = [(SHARED if cache == "prefix-cache" else "") + t.format(s) for t in TEMPLATES for s in SUBJECTS]
    salt = {"kv__cache_salt": f"zero-loss-{uuid.uuid4()}"} if cache == "prefix-cache" else {}
    prompts = [prompt_ids(greedy_reference, text) for text in texts]
    async with AsyncClient(target) as client:

        async def one(prompt: list[int]) -> list[G.GenerateResponse]:
            req = make_request(prompt, max_tokens=16, ignore_eos=True, **salt)
            return [r async for r in client.inference.Generate(req, timeout=300)]

        if cache == "prefix-cache":
            await one(prompts[0])  # leaves the shared system prompt in the cache
        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
    outputs = [output_ids(responses) for responses in results]
    assert all(len(output) == 16 for output in outputs)
    if cache == "prefix-cache":
        assert all(r[-1].usage.cached_prompt_tokens >= 100 for r in results), "the shared prompt came from the cache"
    # (two prompts may well have the same greedy answer, e.g. a chat reply that does not name its subject)
    assert len({tuple(output) for output in outputs}) >= 56, "distinct prompts, distinct outputs"
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        beyond = first_beyond_near_tie(greedy_reference, prompt, output, ignore_eos=True)
        assert beyond is None, f"stream {i} ({texts[i]!r}): {beyond}"
    # The check tells the streams apart: the tokens of a stream of another template (and subject) are no greedy
    # continuation of this prompt.
    for i in range(0, 64, 8):
        other = outputs[(i + 9) % 64]
        assert first_beyond_near_tie(greedy_reference, prompts[i], other, ignore_eos=True) is not None


# ------------------------------------------------------------------ the node's contract: slots, worker, readiness


@pytest.fixture(scope="module")
def two_slot_cluster():
    """A node whose batch holds two sequences, to fill it."""
    deployment = Deployment()
    try:
        coord = deployment.add(processes.coordinator())
        node, node_metrics = processes.with_metrics(
            processes.node(coord.target, 0, "--engine", "llama.cpp", "--max-batch", "2", "--threads", str(THREADS))
        )
        deployment.add(node)
        frontends = {server: deployment.add(processes.frontend(coord.target, server)) for server in SERVERS}
        yield node_metrics, frontends
    finally:
        deployment.close()


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("ending", ["abort", "cancel", "deadline"])
async def test_an_ended_request_frees_its_slot_for_the_next(two_slot_cluster, server, ending):
    node_metrics, frontends = two_slot_cluster
    target = frontends[server].target
    async with AsyncClient(target, retries=False) as client:
        long = [make_request(PROMPTS[0], max_tokens=4000, ignore_eos=True, temperature=0.8) for _ in range(2)]
        timeout = 8 if ending == "deadline" else 120
        streams = [client.inference.Generate(req, timeout=timeout) for req in long]
        for stream in streams:
            await stream.read()  # both slots taken
        waiting = client.inference.Generate(make_request(PROMPTS[1], max_tokens=4), timeout=120)
        first = asyncio.ensure_future(waiting.read())
        await asyncio.sleep(1.0)
        assert not first.done(), "the batch is full: the third request waits"
        if ending == "abort":
            await client.control.Abort(lifecycle_pb2.AbortRequest(request_id=long[0].request_id), timeout=10)
        elif ending == "cancel":
            streams[0].cancel()
        started = time.monotonic()
        response = await asyncio.wait_for(first, 30)
        assert response.WhichOneof("event") == "token"
        if ending == "deadline":
            assert time.monotonic() - started < 15
        rest = []
        while (message := await waiting.read()) is not grpc.aio.EOF:  # read() only: grpc.aio forbids mixing
            rest.append(message)
        assert rest[-1].usage.completion_tokens == 4
        for stream in streams:
            stream.cancel()
    wait_for(
        lambda: processes.metric(processes.scrape(node_metrics), "openengine_node_running_requests") == 0,
        10,
        "every slot free again",
    )


def test_a_killed_engine_worker_is_respawned_with_the_model(deployment):
    coord = deployment.add(processes.coordinator())
    node = deployment.add(processes.node(coord.target, 0, "--engine", "llama.cpp", "--threads", str(THREADS)))
    fe = deployment.add(processes.frontend(coord.target, "grpcio"))
    with Client(fe.target, retries=False) as client:
        stream = client.inference.Generate(make_request(max_tokens=4000, ignore_eos=True), timeout=60)
        next(stream)
        os.kill(processes.engine_worker_pids(node.proc.pid)[0], signal.SIGKILL)
        rest = list(stream)
        assert rest[-1].WhichOneof("event") == "error" and rest[-1].error.retryable

        def answers() -> bool:
            try:
                return output_ids(list(client.generate(make_request(max_tokens=3), timeout=10)))[0] == 7042
            except grpc.RpcError:
                return False

        wait_for(answers, 60, "the respawned worker to answer with the model's greedy first token (' Paris')")


def test_node_is_not_ready_until_the_model_is_loaded(deployment):
    """The node's gRPC port opens before its engine worker is spawned and has loaded the weights: readiness
    answers NOT_SERVING first, then SERVING once the worker has stepped."""
    from grpc_health.v1 import health_pb2

    from openengine_serve.client import check_health

    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    coord = deployment.add(processes.coordinator())
    node = processes.node(coord.target, 0, "--engine", "llama.cpp", "--threads", str(THREADS))
    deployment.components.append(node)
    node.start()
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not seen or seen[-1] != SERVING):
        try:
            status = check_health(node.target, "readiness", 1.0)
        except grpc.RpcError:
            time.sleep(0.01)
            continue
        if not seen or seen[-1] != status:
            seen.append(status)
            if status == SERVING:
                assert processes.engine_worker_pids(node.proc.pid), "SERVING while no engine worker runs"
    assert seen[0] == NOT_SERVING and seen[-1] == SERVING, f"readiness went {seen}"
