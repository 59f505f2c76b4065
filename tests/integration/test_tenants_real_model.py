"""Many tenants on one stack, real model (llama.cpp engine), both gRPC servers: one key learns nothing of another's
prompts through the prefix cache (the PIN probe of issue 33), two keys of one cache group share it, and a burst of
guided requests stays within its key's in-flight cap (compiling counts)."""

from __future__ import annotations

import asyncio
import time

import pytest

from openengine_serve.api.openengine.v1 import generation_pb2 as G

from . import processes
from .conftest import REAL_MODEL, SERVERS, THREADS
from .test_tenants import CAP_REFUSAL, burst, call, keyed_frontends


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """A coordinator, one llama.cpp node, and a frontend per gRPC server reading one key file."""
    deployment = processes.Deployment()
    try:
        coord = deployment.add(processes.coordinator())
        deployment.add(processes.node(coord.target, 0, "--engine", "llama.cpp", "--threads", str(THREADS)))
        yield keyed_frontends(deployment, coord.target, tmp_path_factory.mktemp("tenants"))
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
