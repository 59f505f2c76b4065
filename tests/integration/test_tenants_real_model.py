"""Many tenants on one stack, real model (llama.cpp engine), both gRPC servers: one key learns nothing of another's
prompts through the prefix cache (the PIN probe of issue 33), two keys of one cache group share it, a burst of
guided requests stays within its key's in-flight cap (compiling counts), and a flood of costly guides from one key
leaves another key's guided requests their latency."""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import pytest

from openengine_bench.isolation import cpu_seconds_of
from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import openengine_pb2_grpc

from . import processes
from .conftest import REAL_MODEL, SERVERS, THREADS
from .test_tenants import CAP_REFUSAL, as_key, burst, call, keyed_frontends


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """A coordinator, one llama.cpp node, and a frontend per gRPC server reading one key file."""
    deployment = processes.Deployment()
    try:
        coord = deployment.add(processes.coordinator())
        node = deployment.add(processes.node(coord.target, 0, "--engine", "llama.cpp", "--threads", str(THREADS)))
        frontends = keyed_frontends(deployment, coord.target, tmp_path_factory.mktemp("tenants"))
        frontends["node"] = node
        yield frontends
    finally:
        deployment.close()


@pytest.fixture(params=SERVERS)
def server(request) -> str:
    return request.param


def req(prompt: str, max_tokens: int = 1, **fields) -> G.GenerateRequest:
    r = G.GenerateRequest(
        request_id=f"tenant-{time.monotonic_ns()}",
        model=REAL_MODEL,
        prompt=prompt,
        stopping=G.StoppingOptions(**fields),
    )
    r.stopping.max_tokens = max_tokens
    r.sampling.temperature = 0.0
    return r


def cached(target: str, key: str, prompt: str) -> int:
    responses = asyncio.run(call(target, key, req(prompt)))
    return responses[-1].usage.cached_prompt_tokens


# ------------------------------------------------------------------ the prefix cache is scoped per key


def test_one_key_cannot_read_anothers_prompt_through_the_prefix_cache(tenants, server):
    target = tenants[server].target
    preamble = f"Notes kept by the {server} front desk. " + "The vault code is written below, one digit at a time. " * 3
    cached(target, "alice", preamble + "PIN 7391 opens the vault.")
    cached(target, "alice", preamble + "PIN 7391 opens the vault.")  # alice's own cache serves alice
    assert cached(target, "alice", preamble + "PIN 7391 opens the vault.") > 0
    first = cached(target, "bob", preamble + "PIN 0 zebra quartz")  # bob's own cache now holds "preamble PIN "
    assert first == 0, "nothing of alice's prompt (not even the shared preamble) is found by bob"
    guesses = {d: cached(target, "bob", preamble + f"PIN {d} zebra quartz") for d in range(1, 10)}
    assert len(set(guesses.values())) == 1, f"every guess reports the same cached tokens: {guesses}"


def test_two_keys_in_one_cache_group_share_it(tenants, server):
    target = tenants[server].target
    system = f"You are the {server} team's assistant. " + "Answer briefly and cite the handbook. " * 4
    assert cached(target, "carol", system + "Question one.") == 0
    assert cached(target, "dave", system + "Question two.") > 20, "dave reads carol's system prompt from the cache"
    assert cached(target, "bob", system + "Question three.") == 0, "a key outside the group does not"


def test_ttft_tells_a_key_nothing_of_anothers_prompts(tenants, server):
    """The timing side of the PIN probe, where it is loudest: a long document. Within a cache group a second key
    reads a document another key sent in a fraction of the time (the cache's signal); across keys the document
    costs as much as one never sent."""
    target = tenants[server].target
    document = lambda tag: f"{server} {tag}: " + " ".join(f"clause {n} of the {tag} file." for n in range(120))  # noqa: E731

    async def ttft(key: str, prompt: str) -> float:
        async with grpc.aio.insecure_channel(target) as channel:
            return await ttft_s(openengine_pb2_grpc.InferenceStub(channel), key, req(prompt))

    asyncio.run(ttft("alice", document("secret")))
    asyncio.run(ttft("carol", document("team")))
    seen_by_bob, fresh_for_bob = asyncio.run(ttft("bob", document("secret"))), asyncio.run(ttft("bob", document("new")))
    seen_by_dave = asyncio.run(ttft("dave", document("team")))
    print(
        f"{server}: TTFT of a ~1,000-token document sent by another key {seen_by_bob * 1e3:.0f} ms, never sent "
        f"{fresh_for_bob * 1e3:.0f} ms, sent by a key of the same cache group {seen_by_dave * 1e3:.0f} ms"
    )
    assert seen_by_dave < 0.5 * fresh_for_bob, "the positive control: within a group the cache answers"
    assert seen_by_bob > 0.7 * fresh_for_bob, "across keys the document costs what an unseen one does"


def endless_guide(i: int) -> str:
    """A guide whose language never ends (with ignore_eos the request runs until max_tokens, far beyond the
    burst); `i` makes each one different, so no compile is shared."""
    return f"(w{i} )?[a-z ]+"


def test_a_burst_of_guided_requests_never_passes_the_keys_in_flight_cap(tenants, server):
    requests = []
    for i in range(500):
        r = req("Write words:", max_tokens=4000, ignore_eos=True)
        r.guided.regex = endless_guide(i)
        requests.append(r)
    started = time.monotonic()
    accepted, refusals = asyncio.run(burst(tenants[server].target, requests))
    assert accepted == 2, f"{accepted} accepted in {time.monotonic() - started:.1f} s"
    assert all(r.startswith(CAP_REFUSAL) for r in refusals), {r[:120] for r in refusals}


# ------------------------------------------------------------------ a flood of costly guides


def near_limit_guide(i: int) -> str:
    """A regex of 2,500 alternatives, 62 KB (the guide limit is 64 KiB): the costliest form found, 15-25 ms to
    compile (llguidance builds its lexer lazily); `i` makes each one different, so none is cached. Each request asks
    1 token: the flood is compile work, not a share of the batch (test_fair_share.py covers that)."""
    words = "|".join(f"w{i}x{n}y{n * 7 % 1000}" for n in range(2500))
    return f"({words})( ({words}))*"


async def ttft_s(stub, key: str, request: G.GenerateRequest) -> float:
    started = time.monotonic()
    async for response in stub.Generate(request, metadata=as_key(key), timeout=60):
        if response.WhichOneof("event") == "token":
            return time.monotonic() - started
        if response.WhichOneof("event") == "error":
            raise AssertionError(f"{key}'s request failed: {response.error}")
    raise AssertionError(f"{key}'s request ended without a token")


def json_object_request() -> G.GenerateRequest:
    r = req("Give a JSON object:", max_tokens=1)
    r.guided.json_object.SetInParent()
    return r


async def ttft_p50_s(target: str, key: str, count: int) -> float:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = openengine_pb2_grpc.InferenceStub(channel)
        times = [await ttft_s(stub, key, json_object_request()) for _ in range(count)]
    return statistics.median(times)


async def flood_beside(target: str, count: int) -> tuple[list[str], float]:
    """alice sends `count` near-limit guides at once while bob sends json_object requests one after another: the
    flood's outcomes ("OK" or "CODE: details") and bob's TTFT p50 meanwhile (bob's own refusals fail the test)."""
    async with grpc.aio.insecure_channel(target) as flood_channel, grpc.aio.insecure_channel(target) as channel:
        flood_stub = openengine_pb2_grpc.InferenceStub(flood_channel)

        async def one(i: int) -> str:
            r = req("Write words:", max_tokens=1)
            r.guided.regex = near_limit_guide(i)
            try:
                async for _ in flood_stub.Generate(r, metadata=as_key("alice"), timeout=120):
                    pass
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
            return "OK"

        flood = asyncio.gather(*(one(i) for i in range(count)))
        stub = openengine_pb2_grpc.InferenceStub(channel)
        times = []
        await asyncio.sleep(0.5)  # the flood's compiles have started
        while not flood.done() or len(times) < 5:
            times.append(await ttft_s(stub, "bob", json_object_request()))
        return await flood, statistics.median(times)


def test_a_flood_of_costly_guides_from_one_key_leaves_anothers_guided_requests_their_latency(tenants, server):
    target = tenants[server].target
    asyncio.run(ttft_p50_s(target, "bob", 2))  # json_object compiled (and kept) on the frontend and the node
    alone = asyncio.run(ttft_p50_s(target, "bob", 9))
    outcomes, during = asyncio.run(flood_beside(target, 100))
    print(
        f"{server}: bob's json_object TTFT p50 {alone * 1e3:.0f} ms alone, {during * 1e3:.0f} ms beside 100 "
        f"near-limit guides ({outcomes.count('OK')} accepted, the others refused: {sorted(set(outcomes))[:2]})"
    )
    assert outcomes.count("OK") >= 1, set(outcomes)
    assert all(o == "OK" or "guided.regex" in o for o in outcomes), {o[:120] for o in outcomes}
    assert during <= 2 * alone, f"bob's TTFT p50 {during * 1e3:.0f} ms during the flood, {alone * 1e3:.0f} ms alone"
    cpu = cpu_seconds_of([tenants[server].proc.pid, tenants["node"].proc.pid])
    time.sleep(1.0)  # every flood request has answered: what was compiling for them ends within this
    before = cpu()
    time.sleep(1.0)
    burnt = cpu() - before
    print(f"{server}: CPU of the frontend and the node in the second after: {burnt:.3f} s")
    assert burnt < 0.2, "compiles still burn CPU a second after the flood ended"
