"""Many tenants on one stack (simulated engine), both gRPC servers: a burst of one key stays within its in-flight
cap, and priority above the default is a right of the key. The prefix cache's isolation and guided bursts need the
real model: test_tenants_real_model.py."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import openengine_pb2_grpc

from . import processes
from .conftest import MODEL, SERVERS

KEY_LINES = {
    "alice": "user alice k-alice",
    "bob": "user bob k-bob",
    "carol": "user carol k-carol cache_group=team",
    "dave": "user dave k-dave cache_group=team",
    "capped": "user capped k-capped max_in_flight=2",
    "boss": "user boss k-boss max_priority=10",
    "ops": "admin ops k-ops",
}


def keyed_frontends(deployment: processes.Deployment, coordinator: str, directory) -> dict:
    """A frontend per gRPC server in `deployment`, reading KEY_LINES as its key file (written in `directory`)."""
    path = directory / "api-keys"
    path.write_text("".join(line + "\n" for line in KEY_LINES.values()))
    return {
        server: deployment.add(
            processes.frontend(
                coordinator, server, OPENENGINE_API_KEYS_FILE=str(path), OPENENGINE_ALLOW_PLAINTEXT_KEYS="1"
            )
        )
        for server in SERVERS
    }


@pytest.fixture(scope="module")
def slow_tenants(slow_cluster, tmp_path_factory):
    """A frontend per gRPC server reading the key file, on the session's slow simulated node (50 ms a step: a
    request of thousands of tokens runs for minutes)."""
    deployment = processes.Deployment()
    try:
        yield keyed_frontends(deployment, slow_cluster.coordinator.target, tmp_path_factory.mktemp("slow-tenants"))
    finally:
        deployment.close()


@pytest.fixture(params=SERVERS)
def server(request) -> str:
    return request.param


def as_key(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer k-{name}"),)


async def call(target: str, key: str, request: G.GenerateRequest, metadata=()) -> list[G.GenerateResponse]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = openengine_pb2_grpc.InferenceStub(channel)
        return [r async for r in stub.Generate(request, metadata=as_key(key) + tuple(metadata), timeout=120)]


# ------------------------------------------------------------------ caps hold under bursts


async def burst(target: str, requests: list[G.GenerateRequest]) -> tuple[int, list[str]]:
    """The requests at once, as the key capped at 2: (accepted, refusals' "CODE: details"). The accepted ones
    run far longer than the burst; they are cancelled once every call has answered."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = openengine_pb2_grpc.InferenceStub(channel)
        calls = [stub.Generate(r, metadata=as_key("capped"), timeout=300) for r in requests]

        async def first(call):
            try:
                await call.read()
                return None
            except grpc.aio.AioRpcError as exc:
                return exc

        outcomes = await asyncio.gather(*(first(c) for c in calls))
        for c, outcome in zip(calls, outcomes):
            if outcome is None:
                c.cancel()
    refused = [f"{o.code().name}: {o.details()}" for o in outcomes if o is not None]
    return len(requests) - len(refused), refused


CAP_REFUSAL = "RESOURCE_EXHAUSTED: API key 'capped' has its maximum of 2 streams open on this frontend worker"


def test_a_burst_of_long_prompts_never_passes_the_keys_in_flight_cap(slow_tenants, server):
    """Each prompt is tokenized in a thread before its request opens: the cap counts it from its arrival."""
    requests = [
        G.GenerateRequest(
            request_id=f"burst-{i}-{uuid.uuid4()}",
            model=MODEL,
            prompt=f"{i} " + "a long prompt to tokenize " * 3000,
            stopping=G.StoppingOptions(max_tokens=8000, ignore_eos=True),
        )
        for i in range(500)
    ]
    started = time.monotonic()
    accepted, refusals = asyncio.run(burst(slow_tenants[server].target, requests))
    assert accepted == 2, f"{accepted} accepted in {time.monotonic() - started:.1f} s"
    assert all(r.startswith(CAP_REFUSAL) for r in refusals), {r[:120] for r in refusals}


# ------------------------------------------------------------------ priority is a right of the key


@pytest.mark.parametrize(
    "key, priority, allowed",
    [("alice", 2**31 - 1, False), ("alice", 1, False), ("alice", 0, True), ("alice", -5, True)]
    + [("boss", 10, True), ("boss", 11, False), ("ops", 2**31 - 1, True)],
)
def test_priority_above_the_default_is_a_right_of_the_key(slow_tenants, server, key, priority, allowed):
    target = slow_tenants[server].target
    metadata = (("openengine-priority", str(priority)),)
    request = G.GenerateRequest(
        request_id=f"prio-{uuid.uuid4()}", model=MODEL, prompt="Hello", stopping=G.StoppingOptions(max_tokens=1)
    )
    if allowed:
        assert asyncio.run(call(target, key, request, metadata))[-1].HasField("usage")
        return
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(call(target, key, request, metadata))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    limit = 10 if key == "boss" else 0
    assert f"openengine-priority {priority} is above the {limit} API key {key!r} may send" in refused.value.details()
