"""Generate end to end over real processes: frontend -> coordinator -> node -> MPI engine worker -> back."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2, lifecycle_pb2, server_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from openengine_serve.client import AsyncClient, Client
from openengine_serve.common.vocab import load_encoding

from .conftest import by_output, collect, request
from .processes import LOG_DIR, wait_for

G = generation_pb2


async def read_rest(stream) -> list[G.GenerateResponse]:
    """Reads an aio stream to its end with read() (grpc.aio forbids mixing read() and iteration)."""
    out = []
    while (r := await stream.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


async def open_streams(client, count: int, max_tokens: int) -> list:
    """Starts `count` long generations and returns once each has delivered its first token."""
    streams = [client.inference.Generate(request(max_tokens=max_tokens), timeout=60) for _ in range(count)]
    for stream in streams:
        await stream.read()
    return streams


def test_full_stream_contract(stack):
    with stack.client() as client:
        responses = collect(client, request(max_tokens=40))
    tokens = [r for r in responses if r.WhichOneof("event") == "token"]
    assert len(tokens) >= 2
    for r in tokens:
        assert r.token.HasField("output_index"), "output_index is always set, 0 included"
        assert r.token.tokens, "every delta carries its new token records"
    assert sum(len(r.token.tokens) for r in tokens) == 40, "each record is sent once: deltas are never cumulative"
    outputs = by_output(responses)
    assert list(outputs) == [0]
    out = outputs[0]
    assert len(out["finished"]) == 1 and out["finished"][0].reason == G.FINISH_REASON_LENGTH
    assert responses[-1].WhichOneof("event") == "finished"
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 40)
    assert usage.total_tokens == 44
    assert len(out["ids"]) == 40
    assert out["text"] == load_encoding().decode(out["ids"]), "concatenated deltas equal the full decode"


def test_token_ids_input_and_eos_finishes_with_stop_match(stack):
    req = G.GenerateRequest(
        request_id=f"t-{uuid.uuid4()}",
        model="qwen3",
        token_ids=G.TokenIds(ids=[9707, 11, 1879]),
        stopping=G.StoppingOptions(max_tokens=2000),
    )
    with stack.client() as client:
        responses = collect(client, req)
    finished = [r.finished for r in responses if r.WhichOneof("event") == "finished"]
    assert len(finished) == 1
    assert finished[0].reason == G.FINISH_REASON_STOP
    assert finished[0].stop_match.eos_token_id == 151645
    assert responses[-1].usage.prompt_tokens == 3


def test_three_sequences_each_finish_once(stack):
    req = request(max_tokens=12)
    req.sampling.num_sequences = 3
    with stack.client() as client:
        responses = collect(client, req)
    outputs = by_output(responses)
    assert sorted(outputs) == [0, 1, 2]
    for out in outputs.values():
        assert len(out["finished"]) == 1 and len(out["ids"]) == 12
    assert len({tuple(o["ids"]) for o in outputs.values()}) == 3, "sequences differ"
    assert responses[-1].usage.completion_tokens == 36
    assert sum(r.HasField("usage") for r in responses) == 1


def test_same_seed_same_tokens_different_seed_differs(stack):
    with stack.client() as client:
        a = by_output(collect(client, request(seed=1)))[0]["ids"]
        b = by_output(collect(client, request(seed=1)))[0]["ids"]
        c = by_output(collect(client, request(seed=2)))[0]["ids"]
    assert a == b and a != c


def _stop_across_boundary(client):
    """A stop string made of the end of one token and the start of the next."""
    enc = load_encoding()
    base = by_output(collect(client, request(max_tokens=40, seed=11)))[0]
    pieces = [enc.decode([i]) for i in base["ids"]]
    for k in range(3, len(pieces) - 1):
        left, right = pieces[k], pieces[k + 1]
        if len(left) >= 2 and len(right) >= 2 and left.isascii() and right.isascii():
            stop = left[-2:] + right[:2]
            prefix = "".join(pieces[: k + 1])[:-2]
            if stop not in prefix + left[-2:] + right[:1]:
                return base, stop, prefix
    pytest.fail("no ASCII token pair to build a stop string from")


@pytest.mark.parametrize("include", [False, True], ids=["stop-removed", "stop-kept"])
def test_stop_text_across_token_boundary(stack, include):
    with stack.client() as client:
        base, stop, prefix = _stop_across_boundary(client)
        req = request(max_tokens=40, seed=11, include_stop_in_output=include)
        req.stopping.conditions.add(stop_text=stop)
        responses = collect(client, req)
    out = by_output(responses)[0]
    assert out["finished"][0].reason == G.FINISH_REASON_STOP
    assert out["finished"][0].stop_match.stop_text == stop
    assert out["text"] == (prefix + stop if include else prefix)
    assert base["text"].startswith(out["text"])


def test_first_token_reaches_client_while_engine_still_generating(stack, slow_cluster):
    """On a node stepping every 50 ms, 200 tokens take 10 s to generate: a server that buffered the stream
    would deliver the first token only then. It must arrive within 1 s of the call, and the request must
    still be running (the abort finds it and the stream ends CANCELLED)."""
    target = slow_cluster.frontend(stack.server).target

    async def run():
        async with AsyncClient(target) as client:
            req = request(max_tokens=200)
            called = time.monotonic()
            stream = client.inference.Generate(req, timeout=60)
            first = await stream.read()
            first_after_s = time.monotonic() - called
            reply = await client.control.Abort(lifecycle_pb2.AbortRequest(request_id=req.request_id), timeout=10)
            rest = await read_rest(stream)
            return first_after_s, reply, [first, *rest]

    first_after_s, reply, responses = asyncio.run(run())
    assert responses[0].WhichOneof("event") == "token"
    assert first_after_s < 1.0, f"first token {first_after_s:.2f} s after the call"
    assert reply.status == lifecycle_pb2.ABORT_STATUS_ABORTED
    out = by_output(responses)[0]
    assert out["finished"][0].reason == G.FINISH_REASON_CANCELLED
    assert len(out["ids"]) < 200
    assert responses[-1].HasField("usage")


def test_abort_from_second_frontend(stack):
    async def run():
        async with stack.async_client() as owner, stack.async_client(second=True) as other:
            req = request(max_tokens=3000)
            req.sampling.num_sequences = 2
            stream = owner.inference.Generate(req, timeout=60)
            await stream.read()
            reply = await other.control.Abort(lifecycle_pb2.AbortRequest(request_id=req.request_id), timeout=10)
            rest = await read_rest(stream)
            again = await other.control.Abort(lifecycle_pb2.AbortRequest(request_id=req.request_id), timeout=10)
            return reply, rest, again

    reply, rest, again = asyncio.run(run())
    assert reply.status == lifecycle_pb2.ABORT_STATUS_ABORTED
    finished = [r.finished for r in rest if r.WhichOneof("event") == "finished"]
    assert sorted(f.output_index for f in finished) == [0, 1]
    assert all(f.reason == G.FINISH_REASON_CANCELLED for f in finished)
    assert rest[-1].HasField("usage")
    assert again.status == lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED


def test_abort_that_arrives_before_the_submit_cancels_the_request_on_arrival(stack):
    """The coordinator's Abort can reach the node before the request does (reserved, its Submit on the way):
    the node holds the cancel, and the request then ends CANCELLED at once, with usage, as an abort of a
    running one would. Both nodes hold it, so the test does not depend on routing."""
    req = request(max_tokens=3000)
    for node in stack.nodes:
        with grpc.insecure_channel(node.target) as channel:
            reply = cluster_pb2_grpc.NodeStub(channel).Cancel(
                cluster_pb2.CancelRequest(request_id=req.request_id, hold=True), timeout=10
            )
        assert (reply.found, reply.ended, reply.held) == (False, False, True)
    with stack.client() as client:
        started = time.monotonic()
        responses = collect(client, req)
    finished = [r.finished for r in responses if r.WhichOneof("event") == "finished"]
    assert [f.reason for f in finished] == [G.FINISH_REASON_CANCELLED], responses[-3:]
    assert responses[-1].HasField("usage")
    assert responses[-1].usage.completion_tokens < 3000
    assert time.monotonic() - started < 10
    replies = []
    for node in stack.nodes:  # a second abort: the node that ran it knows it ended
        with grpc.insecure_channel(node.target) as channel:
            replies.append(
                cluster_pb2_grpc.NodeStub(channel).Cancel(
                    cluster_pb2.CancelRequest(request_id=req.request_id, hold=True), timeout=10
                )
            )
    assert sorted((r.ended, r.held) for r in replies) == [(False, True), (True, False)]


def test_abort_unknown_and_without_target(stack):
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as unknown:
            client.control.Abort(lifecycle_pb2.AbortRequest(request_id="never-seen"), timeout=10)
        with pytest.raises(grpc.RpcError) as empty:
            client.control.Abort(lifecycle_pb2.AbortRequest(), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_duplicate_live_id_refused_from_second_frontend(stack):
    async def run():
        async with stack.async_client() as owner, stack.async_client(second=True) as other:
            req = request(max_tokens=3000)
            stream = owner.inference.Generate(req, timeout=60)
            await stream.read()
            with pytest.raises(grpc.aio.AioRpcError) as dup:
                async for _ in other.inference.Generate(req, timeout=10):
                    pass
            stream.cancel()
            return dup.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in err.details() or "already" in err.details()


def test_an_id_sent_again_as_soon_as_its_stream_ended_is_a_new_request(stack):
    """The first request's late cancel (its outputs stopped on the frontend by stop text) and late events must not
    reach the second: both streams give the same text and the same stop, every time. (The token records past the
    match depend on how many tokens the event that matched carried; their text is cut either way.)"""

    def outcome(responses):
        outputs = by_output(responses)
        return {i: (o["text"], [(f.reason, f.stop_match) for f in o["finished"]]) for i, o in outputs.items()}

    with stack.client() as client:
        for _ in range(20):
            req = request("hello", max_tokens=10)
            req.sampling.num_sequences = 2
            req.stopping.conditions.add(stop_text="e")
            first = outcome(collect(client, req))
            again = outcome(collect(client, req))
            assert again == first
            assert all(
                finished == [(G.FINISH_REASON_STOP, G.StopMatch(stop_text="e"))] for _, finished in first.values()
            )


def test_client_cancel_frees_the_engine_slot(stack, slow_cluster):
    """8000 tokens at 50 ms a step take 400 s: only the cancel can take the request off the node."""
    target = slow_cluster.frontend(stack.server).target
    wait_for(lambda: slow_cluster.node_running() == 0, 10, "an idle node before the test")

    async def run():
        async with AsyncClient(target) as client:
            stream = client.inference.Generate(request(max_tokens=8000), timeout=60)
            assert (await stream.read()).WhichOneof("event") == "token"
            await asyncio.to_thread(
                wait_for, lambda: slow_cluster.node_running() == 1, 5, "the request running on the node"
            )
            stream.cancel()

    asyncio.run(run())
    wait_for(lambda: slow_cluster.node_running() == 0, 5, "the cancelled request to leave the engine")


def test_requests_spread_over_both_nodes(stack):
    async def run():
        async with stack.async_client() as client:
            streams = await open_streams(client, 6, max_tokens=3000)
            await asyncio.sleep(1.2)  # one node heartbeat
            load = await client.control.GetLoad(server_pb2.GetLoadRequest(include_per_rank=True), timeout=5)
            for s in streams:
                s.cancel()
            return load

    load = asyncio.run(run())
    busy = {r.data_parallel_rank for r in load.ranks if r.running_requests > 0}
    assert busy == {0, 1}


def served_by(component, request_id: str) -> str:
    """The node that served a request, from the frontend's "request ended" log line."""
    log = LOG_DIR / f"{component.name}-{component.port}.log"
    line = re.compile(rf'event="request ended" request_id={re.escape(request_id)} .*?node_id=(\S+)')
    return wait_for(lambda: (m := line.search(log.read_text())) and m.group(1), 5, f"the log line of {request_id}")


def test_target_rank_metadata(stack):
    with stack.client() as client:
        for rank in (0, 1):
            responses = collect(client, request(max_tokens=3), metadata=(("openengine-target-dp-rank", str(rank)),))
            assert responses[-1].HasField("usage")
        with pytest.raises(grpc.RpcError) as bad:
            collect(client, request(max_tokens=3), metadata=(("openengine-target-dp-rank", "7"),))
        assert bad.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as malformed:
            collect(client, request(max_tokens=3), metadata=(("openengine-target-dp-rank", "x1"),))
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_routing_key_keeps_a_key_on_one_node_and_spreads_keys(stack):
    run = uuid.uuid4().hex[:8]  # keys this deployment has never seen

    def node_for(client, key: str) -> str:
        req = request(max_tokens=2)
        assert collect(client, req, metadata=(("openengine-routing-key", key),))[-1].HasField("usage")
        return served_by(stack.frontend, req.request_id)

    with stack.client() as client:
        same_key = [node_for(client, f"user-{run}") for _ in range(5)]
        distinct_keys = {node_for(client, f"user-{run}-{i}") for i in range(16)}
    assert len(set(same_key)) == 1, same_key
    assert len(distinct_keys) == 2, "sixteen keys all landed on one node"


@pytest.mark.parametrize(
    "mutate,code,needle",
    [
        (lambda r: setattr(r, "request_id", ""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (lambda r: setattr(r, "model", "gpt-x"), grpc.StatusCode.NOT_FOUND, "model"),
        (lambda r: r.token_ids.ids.extend([999999]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (lambda r: setattr(r.sampling, "top_p", 1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (lambda r: setattr(r.sampling, "num_sequences", 0), grpc.StatusCode.INVALID_ARGUMENT, "num_sequences"),
        (lambda r: r.media.add(url="http://x"), grpc.StatusCode.UNIMPLEMENTED, "media"),
        (lambda r: setattr(r, "lora_name", "a"), grpc.StatusCode.UNIMPLEMENTED, "LoRA"),
    ],
    ids=["empty-id", "unknown-model", "token-out-of-vocab", "top_p", "num_sequences-0", "media", "lora"],
)
def test_validation_reaches_the_client(stack, mutate, code, needle):
    req = request()
    if needle == "token_ids":
        req.ClearField("prompt")
    mutate(req)
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as err:
            collect(client, req)
    assert err.value.code() == code
    assert needle.lower() in err.value.details().lower()


def test_cli_generate_streams_text_and_reports_a_refusal_on_its_own_line(stack):
    """What a person sees from `openengine-serve generate`: the text, then finish and usage; a refused call
    prints only the error (no stray blank line) and exits 2."""
    target = stack.frontend.target
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "generate",
            "--target",
            target,
            "--prompt",
            "Write a haiku about the sea",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.endswith("\n") and ok.stdout.strip()
    assert ok.stderr.splitlines() == [
        "[finished output=0 reason=FINISH_REASON_LENGTH]",
        "[usage prompt_tokens=7 completion_tokens=6 total_tokens=13]",
    ]
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "generate",
            "--target",
            target,
            "--prompt",
            "x",
            "--max-tokens",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == "error: INVALID_ARGUMENT: stopping.max_tokens must be in [1, 8192], got 0\n"


def test_trace_context_reaches_the_logs(stack):
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with stack.client() as client:
        collect(client, request(max_tokens=2), metadata=(("traceparent", f"00-{trace}-00f067aa0ba902b7-01"),))
    log = LOG_DIR / f"{stack.frontend.name}-{stack.frontend.port}.log"
    wait_for(lambda: f"trace_id={trace}" in log.read_text(), 5, "the request's log line with its trace id")


def test_prompt_and_output_logprobs(stack):
    req = request(max_tokens=5)
    req.response.return_prompt_logprobs = True
    req.response.return_output_logprobs = True
    req.response.output_candidates.top_n = 3
    with stack.client() as client:
        responses = collect(client, req)
    assert responses[0].WhichOneof("event") == "prompt"
    prompt = responses[0].prompt.tokens
    assert [t.token_id for t in prompt] == load_encoding().encode("The quick brown fox")
    assert not prompt[0].HasField("logprob") and not prompt[0].HasField("rank"), "first prompt token: no logprob"
    assert all(t.HasField("logprob") for t in prompt[1:])
    assert sum(r.WhichOneof("event") == "prompt" for r in responses) == 1
    for r in responses:
        if r.WhichOneof("event") == "token":
            for t in r.token.tokens:
                assert t.HasField("logprob") and t.logprob <= 0 and t.HasField("rank")
                assert [c.rank for c in t.candidates] == [1, 2, 3]


def test_abort_all_requests(stack):
    async def run():
        async with stack.async_client() as client:
            streams = await open_streams(client, 3, max_tokens=5000)
            reply = await client.control.Abort(
                lifecycle_pb2.AbortRequest(all_requests=lifecycle_pb2.AllRequests()), timeout=10
            )
            return reply, [await read_rest(s) for s in streams]

    reply, rests = asyncio.run(run())
    assert reply.status == lifecycle_pb2.ABORT_STATUS_ABORTED
    for rest in rests:
        assert rest[-1].finished.reason == G.FINISH_REASON_CANCELLED and rest[-1].HasField("usage")


def test_deadline_frees_the_engine_slot(stack, slow_cluster):
    """8000 tokens at 50 ms a step take 400 s: only the 5 s deadline can end the request."""
    target = slow_cluster.frontend(stack.server).target
    wait_for(lambda: slow_cluster.node_running() == 0, 10, "an idle node before the test")
    with Client(target, retries=False) as client:
        stream = client.inference.Generate(request(max_tokens=8000), timeout=5)
        assert next(stream).WhichOneof("event") == "token"
        wait_for(lambda: slow_cluster.node_running() == 1, 4, "the request running on the node")
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: slow_cluster.node_running() == 0, 5, "the expired request to leave the engine")
