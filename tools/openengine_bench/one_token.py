"""`openengine-bench --one-token`: 1-token requests/s through one frontend worker, per gRPC server.

Starts `openengine-serve up --nodes N --workers 1 --grpc-server S` for each
server in turn, keeps --inflight 1-token Generate calls in flight over 8
client channels, and reports requests/s and the CPU per request of the
frontend worker and of the coordinator (from /proc/<pid>/stat over the window).
Short requests are bound by what each request costs, not by tokens. `--rounds N`
measures N windows per stack; "req/s per core" (1 s / frontend CPU per request) is
what the worker would serve with a core to itself, which a machine that runs the
load generator and the backend beside it cannot show directly.

`--pythonpath DIR` runs the deployment from another source tree (an older
checkout's service/), for before/after figures on the same machine.

The load generator runs on the components' event loop (uvloop where it exists; `--loop asyncio` for asyncio's
own, as a plain grpc.aio client runs), and its own CPU per request is reported too: on two cores it competes
with the worker it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import time
import uuid
from pathlib import Path

import grpc

from openengine_serve.api.openengine.v1 import generation_pb2, openengine_pb2_grpc
from openengine_serve.common.lifecycle import event_loop_name, new_event_loop

from .stack import cpu_seconds  # one pid (coordinator.cpu_seconds sums a list of pids)

MODEL = "Qwen/Qwen3-0.6B"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openengine-bench --one-token",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--one-token", action="store_true", help="(selects this benchmark)")
    p.add_argument("--servers", default="grpcio,pygrpc-native")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--inflight", type=int, default=256)
    p.add_argument("--window-s", type=float, default=6.0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measured windows per server, one after the other on the same stack (one line each)",
    )
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--pythonpath", default="", help="run the deployment from this source tree")
    p.add_argument("--label", default="", help="a name for this run in the output (e.g. before, after)")
    p.add_argument(
        "--loop",
        choices=("default", "asyncio"),
        default="default",
        help="the load generator's event loop: the components' (uvloop where it exists) or asyncio's own",
    )
    p.add_argument("--output", default="bench-results", help="directory for one-token.jsonl (appended)")
    return p


def child_named(parent: int, command: str) -> int:
    """The pid of `parent`'s child running `openengine_serve <command>`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and command.encode() in args[:4]:
            return int(entry.name)
    raise RuntimeError(f"no `{command}` process under pid {parent}")


def process_seconds(pid: int) -> float:
    seconds = cpu_seconds(pid)
    if seconds is None:
        raise RuntimeError(f"process {pid} exited during the measurement")
    return seconds


async def drive(target: str, frontend: int, coordinator: int, args: argparse.Namespace) -> list[dict]:
    channels = [grpc.aio.insecure_channel(target) for _ in range(8)]
    stubs = [openengine_pb2_grpc.InferenceStub(c) for c in channels]
    state = {"done": 0, "errors": 0, "stop": False, "record": False}
    error_codes: collections.Counter = collections.Counter()  # "CODE: details" of every failed call

    async def loop(i: int) -> None:
        stub = stubs[i % len(stubs)]
        while not state["stop"]:
            request = generation_pb2.GenerateRequest(
                request_id=uuid.uuid4().hex,
                model=MODEL,
                prompt="Hi",
                stopping=generation_pb2.StoppingOptions(max_tokens=1, ignore_eos=True),
            )
            try:
                async for _ in stub.Generate(request, timeout=30):
                    pass
            except grpc.aio.AioRpcError as exc:
                state["errors"] += 1
                error_codes[f"{exc.code().name}: {(exc.details() or '')[:200]}"] += 1
                continue
            if state["record"]:
                state["done"] += 1

    tasks = [asyncio.create_task(loop(i)) for i in range(args.inflight)]
    await asyncio.sleep(args.warmup_s)
    results = []
    for _ in range(args.rounds):
        done0, errors0 = state["done"], state["errors"]
        error_codes.clear()
        state["record"] = True
        f0, c0, t0 = process_seconds(frontend), process_seconds(coordinator), time.monotonic()
        g0 = process_seconds(os.getpid())
        await asyncio.sleep(args.window_s)
        f1, c1, t1 = process_seconds(frontend), process_seconds(coordinator), time.monotonic()
        g1 = process_seconds(os.getpid())
        done = state["done"] - done0
        results.append(
            {
                "requests_per_s": done / (t1 - t0),
                "frontend_cores": (f1 - f0) / (t1 - t0),
                "frontend_cpu_us_per_request": 1e6 * (f1 - f0) / max(1, done),
                # what one worker would serve with a whole core to itself: bound by its CPU per request
                "requests_per_frontend_core_s": done / max(f1 - f0, 1e-9),
                "coordinator_cpu_us_per_request": 1e6 * (c1 - c0) / max(1, done),
                "load_generator_cpu_us_per_request": 1e6 * (g1 - g0) / max(1, done),
                "errors": state["errors"] - errors0,
                "error_codes": dict(error_codes.most_common(5)),
            }
        )
    state["record"], state["stop"] = False, True
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    return results


def run_server(server: str, args: argparse.Namespace) -> list[dict]:
    from .stack import UpStack

    up = UpStack(
        server,
        nodes=args.nodes,
        workers=1,
        pythonpath=args.pythonpath,  # the stack's log beside the results
        log_path=Path(args.output) / f"one-token-{server}-{args.label or 'run'}.log",
    ).start()
    try:
        loop_factory = asyncio.new_event_loop if args.loop == "asyncio" else new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            results = runner.run(
                drive(up.target, child_named(up.pid, "frontend"), child_named(up.pid, "coordinator"), args)
            )
    finally:
        up.stop()
    loop = "asyncio" if args.loop == "asyncio" else event_loop_name()
    return [{"server": server, "label": args.label, "load_generator_loop": loop, **result} for result in results]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for server in (s.strip() for s in args.servers.split(",") if s.strip()):
        for result in run_server(server, args):
            with open(out / "one-token.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
            print(
                f"{server:14} {args.label:8} {result['requests_per_s']:8.0f} req/s  frontend "
                f"{result['frontend_cpu_us_per_request']:6.0f} µs/req ({result['frontend_cores']:.2f} cores, "
                f"{result['requests_per_frontend_core_s']:5.0f} req/s per core)  "
                f"coordinator {result['coordinator_cpu_us_per_request']:5.0f} µs/req  "
                f"load generator {result['load_generator_cpu_us_per_request']:4.0f} µs/req  errors {result['errors']}"
                + (f" {result['error_codes']}" if result["error_codes"] else ""),
                flush=True,
            )
    return 0
