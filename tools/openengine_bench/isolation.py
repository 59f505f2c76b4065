"""ITL isolation: do streams whose client stopped reading slow the well-behaved ones?

    python -m openengine_bench.isolation --out isolation-out

On a deployment like `openengine_bench.overload`'s (frontend with `--client-stall-timeout-s`), per server:
`--rounds` rounds, each a window of `--well-behaved` streams of `--tokens` tokens alone, then a window of
the same beside `--non-reading` fresh streams whose client stopped reading (1 KiB receive window, no BDP
growth). Each window's ITL p99 (gaps between token messages seen by the well-behaved clients) is recorded;
the verdict compares the median over rounds beside with 1.5x the median alone (alternating windows make a
shared machine's drift hit both sides alike). The last round's non-reading streams are left to the stall
timeout, which must end them all. Writes `isolation.json` into `--out` and prints the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import grpc

from openengine_serve.api.openengine.v1 import generation_pb2, openengine_pb2_grpc

from . import report
from .overload import Deployment, running_requests, scrape_values, short_request

STALLS = "openengine_frontend_client_stalls_total"


async def itl_p99(target: str, streams: int, tokens: int) -> float:
    """p99 of the gaps between token messages seen by `streams` clients reading as fast as they can."""
    gaps: list[float] = []

    async def one(stub) -> None:
        last = None
        async for response in stub.Generate(short_request(tokens), timeout=60):
            now = time.perf_counter()
            if response.WhichOneof("event") == "token":
                if last is not None:
                    gaps.append(now - last)
                last = now

    async with grpc.aio.insecure_channel(target) as channel:
        stub = openengine_pb2_grpc.InferenceStub(channel)
        await asyncio.gather(*(one(stub) for _ in range(streams)))
    return report.percentile(gaps, 99)


def wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def run_server(deployment: Deployment, server: str, args: argparse.Namespace) -> dict:
    frontend = deployment.start_frontend(server, "--client-stall-timeout-s", str(args.stall_timeout_s))
    target = frontend.target
    stalls = lambda: scrape_values(deployment.frontend_metrics, (STALLS,))[STALLS]  # noqa: E731
    # A 1 KiB receive window without BDP growth: a client that stops reading blocks within ~40 tokens.
    channel = grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
    generate = channel.unary_stream("/openengine.v1.Inference/Generate",
                                    request_serializer=generation_pb2.GenerateRequest.SerializeToString,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
    alone, beside = [], []
    try:
        stalls_before = stalls()
        for r in range(args.rounds):
            alone.append(asyncio.run(itl_p99(target, args.well_behaved, args.tokens)))
            hogs = [generate(short_request(8000), timeout=120) for _ in range(args.non_reading)]
            wait(lambda: running_requests(target) >= args.non_reading, 30)
            time.sleep(0.5)  # their windows are full: blocked, still holding engine slots
            beside.append(asyncio.run(itl_p99(target, args.well_behaved, args.tokens)))
            if r < args.rounds - 1:  # the last round's are left to the stall timeout
                for hog in hogs:
                    hog.cancel()
                wait(lambda: running_requests(target) == 0, 30)
        ended = wait(lambda: stalls() - stalls_before >= args.non_reading, 2 * args.stall_timeout_s + 10)
        freed = wait(lambda: running_requests(target) == 0, 15)
    finally:
        channel.close()
        deployment.stop_frontend()
    baseline, loaded = statistics.median(alone), statistics.median(beside)
    return {"server": server, "alone_ms": [round(x * 1000, 2) for x in alone],
            "beside_ms": [round(x * 1000, 2) for x in beside], "median_alone_ms": round(baseline * 1000, 2),
            "median_beside_ms": round(loaded * 1000, 2), "ratio": round(loaded / baseline, 2),
            "within_1_5x": loaded <= 1.5 * baseline, "stall_timeout_ended_all": ended, "slots_freed": freed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openengine_bench.isolation", description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(report.SERVERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--well-behaved", type=int, default=8)
    parser.add_argument("--non-reading", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=300, help="tokens per well-behaved stream")
    parser.add_argument("--stall-timeout-s", type=float, default=5.0)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("isolation-out"))
    args = parser.parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if unknown := [s for s in servers if s not in report.SERVERS]:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {list(report.SERVERS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deployment = Deployment(args.out, args.nodes, args.step_ms, 512)
    results = []
    try:
        for server in servers:
            results.append(run_server(deployment, server, args))
            print(json.dumps(results[-1]), flush=True)
    finally:
        deployment.close()
    (args.out / "isolation.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
