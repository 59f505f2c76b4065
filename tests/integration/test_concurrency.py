"""Many streams at once lose nothing and mix nothing up: each one matches the model's reference token for token."""

from __future__ import annotations

import asyncio
import random

import grpc

from .reference import Case, mismatch

STREAMS = 200
CONNECTIONS_PER_FRONTEND = 4  # the streams share a few HTTP/2 connections, as real clients' do


async def _read_all(call) -> list:
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def test_200_concurrent_streams_match_the_reference(stack):
    rng = random.Random(f"concurrency-{stack.server}")
    cases = [Case.random(rng, max_tokens=rng.randint(60, 240)) for _ in range(STREAMS)]

    async def run() -> list:
        clients = [
            stack.async_client(second=second, retries=False)
            for second in (False, True)
            for _ in range(CONNECTIONS_PER_FRONTEND)
        ]
        try:
            # Every call is open before any is read: the 200 streams run at the same time.
            calls = [
                clients[i % len(clients)].inference.Generate(case.request(), timeout=60) for i, case in enumerate(cases)
            ]
            return await asyncio.gather(*(_read_all(call) for call in calls), return_exceptions=True)
        finally:
            for client in clients:
                await client.close()

    results = asyncio.run(run())
    problems = []
    for i, (case, result) in enumerate(zip(cases, results)):
        if isinstance(result, BaseException):
            problems.append(f"stream {i}: {result!r}")
        elif (difference := mismatch(case, result)) is not None:
            problems.append(f"stream {i} ({case}): {difference}")
    assert not problems, f"{len(problems)} of {STREAMS} streams differ from the reference:\n" + "\n".join(problems[:10])
