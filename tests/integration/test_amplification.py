"""Every amplifier is refused naming its limit before anything is reserved, and costs the others nothing
(issue 28): while 16 normal streams run, an attacker process (attacker.py) sends, paced, too many candidate ids,
an oversized prompt, too much stop text, an oversized message and metadata, calls beyond a connection full of
health watches and reflection streams, and calls on connections beyond the maximum. On both servers the
streams' inter-token latency p99 stays within 1.5x of the runs without the attacker, and no component's memory
grows by 20 MB.

Timing on a shared machine: baseline and attack runs alternate, and the medians of their p99s are compared."""

from __future__ import annotations

import asyncio
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from openengine_serve.client import AsyncClient

from . import processes
from .conftest import MODEL, SERVERS, request

MAX_STREAMS, MAX_CONNECTIONS, MAX_PROMPT_BYTES = 6, 12, 4096
MAX_REQUEST_BYTES, MAX_METADATA_BYTES = 256 * 1024, 4096
MAX_SERVICE_NAME_BYTES = 4093  # a health request of 4096 bytes (limits.SMALL_MESSAGE_BYTES): tag, length, name
STEP_MS = 20  # one token per stream per step
STREAMS, CONNECTIONS, TOKENS = 16, 4, 150  # a run: 16 streams of 150 tokens over 4 connections, ~3 s
RUNS = 4  # of each kind, alternating
ITL_P99_BOUND = 1.5  # attack / baseline, medians of the runs' p99s
RSS_GROWTH_BOUND_MB = 20
ROOT = Path(__file__).resolve().parents[2]

# What each amplifier must get every time: (status, a part of the message naming the limit)
EXPECTED = {
    "output candidate ids": ("INVALID_ARGUMENT", "response.output_candidates.token_ids.ids must list at most 20"),
    "prompt candidate ids": ("INVALID_ARGUMENT", "response.prompt_candidates.token_ids.ids must list at most 20"),
    "prompt bytes": ("INVALID_ARGUMENT", f"at most {MAX_PROMPT_BYTES} bytes of UTF-8 (OPENENGINE_MAX_PROMPT_BYTES)"),
    "stop text": ("INVALID_ARGUMENT", "stop_text must total at most 4096 bytes"),
    "request bytes": ("RESOURCE_EXHAUSTED", f"vs. {MAX_REQUEST_BYTES})"),
    "health request bytes": (
        "RESOURCE_EXHAUSTED",
        "request message is 4097 bytes, over the limit of 4096 bytes for /grpc.health.v1.Health/Watch",
    ),
    "metadata bytes": ("RESOURCE_EXHAUSTED", f"over the limit of {MAX_METADATA_BYTES} (OPENENGINE_MAX_METADATA_BYTES)"),
    "streams: Generate": ("RESOURCE_EXHAUSTED", f"more than {MAX_STREAMS} concurrent calls on one connection"),
    "streams: health watch": ("RESOURCE_EXHAUSTED", "(OPENENGINE_MAX_CONCURRENT_STREAMS)"),
    "streams: reflection": ("RESOURCE_EXHAUSTED", "(OPENENGINE_MAX_CONCURRENT_STREAMS)"),
    "connections": (
        "RESOURCE_EXHAUSTED",
        f"maximum of {MAX_CONNECTIONS} client connections (OPENENGINE_MAX_CONNECTIONS)",
    ),
}


@pytest.fixture(scope="module")
def slow_node_cluster():
    """A coordinator (its metrics count the requests routed, i.e. reserved) and one simulated node."""
    deployment = processes.Deployment()
    try:
        coordinator, coordinator_metrics = processes.with_metrics(processes.coordinator())
        deployment.add(coordinator)
        node = deployment.add(processes.node(coordinator.target, 0, "--step-ms", str(STEP_MS)))
        yield coordinator, coordinator_metrics, node
    finally:
        deployment.close()


@pytest.fixture(scope="module", params=SERVERS)
def attacked(request, slow_node_cluster):
    coordinator, coordinator_metrics, node = slow_node_cluster
    limits = {
        "max_streams": MAX_STREAMS,
        "max_connections": MAX_CONNECTIONS,
        "max_prompt_bytes": MAX_PROMPT_BYTES,
        "max_request_bytes": MAX_REQUEST_BYTES,
        "max_metadata_bytes": MAX_METADATA_BYTES,
        "max_service_name_bytes": MAX_SERVICE_NAME_BYTES,
    }
    frontend = processes.frontend(
        coordinator.target,
        request.param,
        *("--max-concurrent-streams", str(MAX_STREAMS), "--max-connections", str(MAX_CONNECTIONS)),
        *("--max-prompt-bytes", str(MAX_PROMPT_BYTES), "--max-request-bytes", str(MAX_REQUEST_BYTES)),
        *("--max-metadata-bytes", str(MAX_METADATA_BYTES)),
        *("--max-health-watches-per-connection", str(MAX_STREAMS)),
    ).start()
    try:
        frontend.wait_ready(60)
        pids = {
            "frontend": frontend.proc.pid,
            "coordinator": coordinator.proc.pid,
            "node": node.proc.pid,
            **{f"engine worker {pid}": pid for pid in processes.engine_worker_pids(node.proc.pid)},
        }
        assert any(name.startswith("engine worker") for name in pids), pids
        yield frontend, coordinator_metrics, pids, {"target": frontend.target, "model": MODEL, **limits}
    finally:
        frontend.stop()


async def itl_p99(clients: list[AsyncClient]) -> float:
    """One run: STREAMS streams of TOKENS tokens; the p99 of the gaps between their token messages."""

    async def stream(client: AsyncClient) -> list[float]:
        arrivals = []
        async for response in client.inference.Generate(request(max_tokens=TOKENS), timeout=120):
            if response.WhichOneof("event") == "token":
                arrivals.append(time.perf_counter())
        assert len(arrivals) >= 2
        return [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]

    runs = await asyncio.gather(*(stream(clients[i % len(clients)]) for i in range(STREAMS)))
    gaps = sorted(gap for run in runs for gap in run)
    return gaps[int(0.99 * (len(gaps) - 1))]


class AttackerProcess:
    def __init__(self, settings: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.attacker", json.dumps(settings)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    async def ready(self) -> None:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 60)
        assert line.strip() == "ready", f"attacker: {line!r} (exit {self.proc.poll()})"

    def answers(self) -> dict[str, dict[str, int]]:
        out, _ = self.proc.communicate("stop\n", timeout=60)
        assert self.proc.returncode == 0, out
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def rss_mb(pids: dict[str, int]) -> dict[str, float]:
    return {name: psutil.Process(pid).memory_info().rss / 2**20 for name, pid in pids.items()}


def routed(metrics_port: int) -> float:
    samples = processes.scrape(metrics_port)
    return sum(
        value for (name, _), value in samples.items() if name == "openengine_coordinator_routing_decisions_total"
    )


def test_amplifiers_are_refused_naming_their_limit_and_cost_the_normal_streams_nothing(attacked):
    frontend, coordinator_metrics, pids, settings = attacked
    p99s: dict[str, list[float]] = {"baseline": [], "attack": []}
    answers: dict[str, collections.Counter] = {}
    rss_runs: list[dict[str, float]] = []  # after each attack run: a leak grows run after run

    async def scenario():
        clients = [AsyncClient(frontend.target, retries=False) for _ in range(CONNECTIONS)]
        try:
            await itl_p99(clients)  # warm-up: connections admitted, caches and allocators settled
            before = rss_mb(pids), routed(coordinator_metrics)
            for _ in range(RUNS):
                p99s["baseline"].append(await itl_p99(clients))
                attacker = AttackerProcess(settings)
                try:
                    await attacker.ready()
                    p99s["attack"].append(await itl_p99(clients))
                    rss_runs.append(rss_mb(pids))
                    for name, counts in attacker.answers().items():
                        answers.setdefault(name, collections.Counter()).update(counts)
                finally:
                    attacker.kill()
            return before, (rss_mb(pids), routed(coordinator_metrics))
        finally:
            for client in clients:
                await client.channel.close()

    (rss_before, routed_before), (rss_after, routed_after) = asyncio.run(scenario())
    print(f"{frontend.name}: ITL p99 ms { ({k: [round(v * 1000, 1) for v in vs] for k, vs in p99s.items()}) }")
    print(f"{frontend.name}: answers {answers}")
    print(f"{frontend.name}: RSS MB before {rss_before}, after each attack run {rss_runs}")

    for name, (code, limit) in EXPECTED.items():
        assert answers.get(name), f"{name}: never sent"
        for answer in answers[name]:
            assert answer.startswith(f"{code}: ") and limit in answer, (name, answers[name])
    # only the normal streams were reserved (routed), none of the refused calls
    assert routed_after - routed_before == 2 * RUNS * STREAMS, (routed_before, routed_after)
    baseline, attack = statistics.median(p99s["baseline"]), statistics.median(p99s["attack"])
    assert attack <= ITL_P99_BOUND * baseline, p99s
    growth = {name: rss_after[name] - rss_before[name] for name in pids}
    assert all(mb < RSS_GROWTH_BOUND_MB for mb in growth.values()), (growth, rss_before, rss_runs)
