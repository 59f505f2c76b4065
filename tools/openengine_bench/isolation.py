"""ITL isolation: do streams whose client stopped reading slow the well-behaved ones?

    python -m openengine_bench.isolation --out isolation-out

On a deployment like `openengine_bench.overload`'s (frontend with `--client-stall-timeout-s`), per server:
`--pairs` pairs of windows of `--window-s` seconds, in ABBA order (alone, beside, beside, alone, ...): in each,
`--well-behaved` streams read as fast as they can; a window "beside" runs next to `--non-reading` fresh streams
whose client stopped reading (1 KiB receive window, no BDP growth), started and blocked before the window
and cancelled after it. ITL is measured by the clients: the gaps between a stream's token messages, from its
first token on (time to first token excluded). The verdict compares the median over windows of each window's
ITL p99 beside with 1.5x the median alone: a machine's drift and bursts of noise hit both kinds alike and a
few bad windows do not move a median. The last window's non-reading streams are left to the stall timeout,
which must end them all and free their engine slots. The CPU the frontend and the nodes (engine workers
included) used in each window is recorded too: the non-reading streams' own cost, less noisy than ITL on a
shared machine. `--client-pause-after-s 0.1,0 --rounds 3` alternates the frontend's pausing on and off
(before/after). Writes `isolation.json` into `--out` and prints the figures.

The CI form (tests/integration/test_robustness.py -k non_reading) uses the same measurement on the tests'
50 ms-step node; this command runs the issue's scenario (2 nodes at the 2 ms step) for a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from openengine_serve.api.openengine.v1 import generation_pb2, openengine_pb2_grpc

from . import report
from .children import unwind_on_sigterm
from .overload import Deployment, running_requests, scrape_values, short_request

STALLS = "openengine_frontend_client_stalls_total"
PAUSES = "openengine_frontend_client_pauses_total"
ITL_BOUND = 1.5  # beside / alone, medians of the windows' ITL p99
# A client that stopped reading: a 1 KiB receive window that never grows, so its stream blocks within a few
# dozen token messages.
NON_READING_OPTIONS = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024))


async def itl_window(target: str, streams: int, seconds: float, tokens: int = 8000) -> list[float]:
    """`streams` streams read as fast as they can for `seconds`, then cancelled: every stream's gaps between
    token messages after its first (seconds), and the gap still open when the window closes (a stream held up
    past the window's end counts, it is not cut out of the window)."""
    gaps: list[float] = []
    started = time.perf_counter()
    last_token_at: dict[int, float] = {}

    async def one(stub, index: int) -> None:
        async for response in stub.Generate(short_request(tokens), timeout=seconds + 60):
            now = time.perf_counter()
            if response.WhichOneof("event") == "token":
                if index in last_token_at:
                    gaps.append(now - last_token_at[index])
                last_token_at[index] = now

    async with grpc.aio.insecure_channel(target) as channel:
        stub = openengine_pb2_grpc.InferenceStub(channel)
        tasks = [asyncio.ensure_future(one(stub, i)) for i in range(streams)]
        await asyncio.sleep(seconds)
        closed = time.perf_counter()
        for task in tasks:
            task.cancel()
        # the open gaps; a stream without a first token in the whole window counts the window
        gaps += [closed - last_token_at.get(i, started) for i in range(streams)]
        await asyncio.gather(*tasks, return_exceptions=True)
    return gaps


class NonReading:
    """Streams whose client never reads, on one connection; `start` returns once they all run."""

    def __init__(self, target: str, count: int, running: Callable[[], int]) -> None:
        self.count, self.running = count, running
        self.channel = grpc.insecure_channel(target, options=list(NON_READING_OPTIONS))
        self.generate = self.channel.unary_stream(
            "/openengine.v1.Inference/Generate",
            request_serializer=generation_pb2.GenerateRequest.SerializeToString,
            response_deserializer=generation_pb2.GenerateResponse.FromString,
        )
        self.calls: list = []

    def start(self, block_s: float, timeout_s: float = 30.0) -> None:
        self.calls = [self.generate(short_request(8000), timeout=120) for _ in range(self.count)]
        if not wait(lambda: self.running() >= self.count, timeout_s):
            raise TimeoutError(f"the {self.count} non-reading streams were not all running after {timeout_s:g} s")
        time.sleep(block_s)  # their receive windows fill: blocked, still holding engine slots

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()
        if not wait(lambda: self.running() == 0, 30):
            raise TimeoutError("the cancelled non-reading streams' engine slots were not freed within 30 s")

    def close(self) -> None:
        self.channel.close()


def cpu_seconds_of(pids: list[int]) -> Callable[[], float]:
    """A function returning the CPU seconds used so far by the processes `pids` and their descendants (a node's
    engine launcher, mpiexec and worker ranks included); a process that is gone counts no more."""
    import psutil

    roots = [psutil.Process(pid) for pid in pids]

    def cpu_seconds() -> float:
        total = 0.0
        for root in roots:
            try:
                processes = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for process in processes:
                try:
                    times = process.cpu_times()
                except psutil.Error:
                    continue
                total += times.user + times.system
        return total

    return cpu_seconds


def wait(predicate: Callable[[], object], timeout_s: float) -> bool:
    """Whether `predicate` became true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@dataclass
class Isolation:
    """Per-window ITL p99 (seconds) alone and beside the non-reading streams, in the order measured."""

    alone: list[float] = field(default_factory=list)
    beside: list[float] = field(default_factory=list)
    gaps_alone: list[int] = field(default_factory=list)  # gaps measured per window
    gaps_beside: list[int] = field(default_factory=list)
    stalls_during_beside: float = 0.0  # non-reading streams ended while a window beside them ran (want 0)
    cpu_alone: list[float] = field(default_factory=list)  # cores the deployment's components used per window
    cpu_beside: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.beside) / statistics.median(self.alone)

    def summary(self) -> dict:
        ms = lambda xs: [round(x * 1000, 2) for x in xs]  # noqa: E731
        return {
            "alone_ms": ms(self.alone),
            "beside_ms": ms(self.beside),
            "median_alone_ms": round(statistics.median(self.alone) * 1000, 2),
            "median_beside_ms": round(statistics.median(self.beside) * 1000, 2),
            "ratio": round(self.ratio, 2),
            "within_bound": self.ratio <= ITL_BOUND,
            "gaps_alone": self.gaps_alone,
            "gaps_beside": self.gaps_beside,
            "stalls_during_beside": self.stalls_during_beside,
            **(
                {
                    "cpu_cores_alone": [round(c, 3) for c in self.cpu_alone],
                    "cpu_cores_beside": [round(c, 3) for c in self.cpu_beside],
                    "median_cpu_cores_alone": round(statistics.median(self.cpu_alone), 3),
                    "median_cpu_cores_beside": round(statistics.median(self.cpu_beside), 3),
                }
                if self.cpu_alone
                else {}
            ),
        }


def measure_isolation(
    target: str,
    non_reading: NonReading,
    stalls: Callable[[], float],
    *,
    pairs: int,
    well_behaved: int,
    window_s: float,
    block_s: float,
    warmup_s: float = 1.0,
    cpu_seconds: Callable[[], float] | None = None,
) -> Isolation:
    """`pairs` pairs of windows in ABBA order: alone, beside, beside, alone, alone, ... Two adjacent windows
    beside share their non-reading streams. An odd count ends on a window beside, whose streams are left
    running for the caller to see them ended by the stall timeout. `cpu_seconds` (cpu_seconds_of): the CPU
    the components used in each window is recorded too."""
    if pairs % 2 == 0:
        raise ValueError(f"pairs must be odd (ABBA order then ends on a window beside), got {pairs}")
    asyncio.run(itl_window(target, well_behaved, warmup_s))  # connections, caches, the engine's batch
    result = Isolation()
    last = 2 * pairs - 1
    for i in range(2 * pairs):
        beside = i % 4 in (1, 2)
        if beside and i % 4 == 1:
            non_reading.start(block_s)
        before = stalls()
        cpu_before, started = (cpu_seconds() if cpu_seconds else 0.0), time.monotonic()
        gaps = asyncio.run(itl_window(target, well_behaved, window_s))
        if cpu_seconds:
            cores = (cpu_seconds() - cpu_before) / (time.monotonic() - started)
            (result.cpu_beside if beside else result.cpu_alone).append(cores)
        p99 = report.percentile(gaps, 99)
        if p99 is None:
            raise RuntimeError(f"window {i + 1} measured no inter-token gap: the well-behaved streams got no tokens")
        if beside:
            result.stalls_during_beside += stalls() - before
            result.beside.append(p99)
            result.gaps_beside.append(len(gaps))
            if i % 4 == 2 and i != last:
                non_reading.cancel()
        else:
            result.alone.append(p99)
            result.gaps_alone.append(len(gaps))
    return result


def run_server(deployment: Deployment, server: str, args: argparse.Namespace, pause_after_s: str = "") -> dict:
    """`pause_after_s`: the frontend's --client-pause-after-s ("": its default)."""
    pausing = ("--client-pause-after-s", pause_after_s) if pause_after_s else ()
    frontend = deployment.start_frontend(server, "--client-stall-timeout-s", str(args.stall_timeout_s), *pausing)
    target = frontend.target
    stalls = lambda: scrape_values(deployment.frontend_metrics, (STALLS,))[STALLS]  # noqa: E731
    non_reading = NonReading(target, args.non_reading, lambda: running_requests(target))
    try:
        stalls_before = stalls()
        components = cpu_seconds_of([frontend.pid, *(node.pid for node, _ in deployment.nodes)])
        result = measure_isolation(
            target,
            non_reading,
            stalls,
            pairs=args.pairs,
            well_behaved=args.well_behaved,
            window_s=args.window_s,
            block_s=args.block_s,
            cpu_seconds=components,
        )
        ended = wait(lambda: stalls() - stalls_before >= args.non_reading, 2 * args.stall_timeout_s + 10)
        freed = wait(lambda: running_requests(target) == 0, 15)
        pauses = scrape_values(deployment.frontend_metrics, (PAUSES,))[PAUSES]
    finally:
        non_reading.close()
        deployment.stop_frontend()
    return {
        "server": server,
        "client_pause_after_s": pause_after_s or "default",
        **result.summary(),
        "stall_timeout_ended_all": ended,
        "slots_freed": freed,
        "client_pauses": pauses,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openengine_bench.isolation", description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(report.SERVERS))
    parser.add_argument("--pairs", type=int, default=9, help="pairs of windows (odd: ABBA ends on a window beside)")
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--well-behaved", type=int, default=8)
    parser.add_argument("--non-reading", type=int, default=64)
    parser.add_argument(
        "--block-s",
        type=float,
        default=0.5,
        help="after the non-reading streams run, before the window (their windows fill)",
    )
    parser.add_argument(
        "--stall-timeout-s",
        type=float,
        default=8.0,
        help="more than --block-s plus two windows: the streams stay through both their windows",
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument(
        "--client-pause-after-s",
        default="",
        help="comma-separated values of the frontend's --client-pause-after-s, each measured in "
        "turn per server and round (e.g. 0.1,0: pausing on, then off); default: its default",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every (server, pause value) this many times, alternating, for a spread",
    )
    parser.add_argument("--out", type=Path, default=Path("isolation-out"))
    args = parser.parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := [s for s in servers if s not in report.SERVERS]:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {list(report.SERVERS)}")
    if args.pairs % 2 == 0:
        raise SystemExit(f"--pairs must be odd (ABBA order then ends on a window beside), got {args.pairs}")
    args.out.mkdir(parents=True, exist_ok=True)
    unwind_on_sigterm()
    deployment = Deployment(args.out, args.nodes, args.step_ms, 512)
    pause_values = [v.strip() for v in args.client_pause_after_s.split(",") if v.strip()] or [""]
    results = []
    try:
        for _ in range(args.rounds):
            for server in servers:
                for pause_after_s in pause_values:
                    results.append(run_server(deployment, server, args, pause_after_s))
                    print(json.dumps(results[-1]), flush=True)
    finally:
        deployment.close()
    (args.out / "isolation.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
