"""`openengine-serve bench --coordinator`: one coordinator (or --coordinators N sharing the request ids) driven by
simulated frontends and nodes.

Real coordinator processes; the load generator simulates --nodes nodes
(register, then heartbeat with their load every --heartbeat-s) and --frontends
frontends (register, heartbeat), each peer on its own heartbeat stream as the real
ones, in a process of their own so that the requests' loop times only the
coordinator. Then, in one run and side by side:

- unary: --concurrency loops, each Reserve then Release of a fresh id (today's
  path before the batched stream: two unary calls per request), spread over the
  frontends' ids and --channels channels;
- batched: the same loops through each simulated frontend's own
  `ReservationBatcher` (the frontend's class): one stream per frontend,
  reservations and releases coalesced per event-loop tick;
- each path also at a fixed --rate (requests/s, open loop) for the latency a
  request sees at ordinary load.

With --coordinators N every simulated node and frontend registers and
heartbeats with each coordinator, and each request goes to the coordinator that
owns its id (the frontends' rule, `common/routing.py : owning_coordinator`): one
stream per simulated frontend and coordinator on the batched path.

Reported: reservations/s, coordinator CPU per request (utime+stime from
/proc/<pid>/stat over the window, summed over the coordinators), latency p50/p99 of the reservation, and the
coordinator's resident memory per registered node and frontend. The load
generator shares the machine: at saturation it may be the limit, which the
report shows as its own CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc

from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from openengine_serve.client import is_serving
from openengine_serve.common.heartbeat_stream import HeartbeatFailed, HeartbeatStream
from openengine_serve.common.net import free_port
from openengine_serve.common.routing import owning_coordinator
from openengine_serve.frontend.reservation_stream import ReservationBatcher

TICKS = os.sysconf("SC_CLK_TCK")
NODES_PER_CHANNEL = 50  # simulated nodes sharing one connection to a coordinator
PAGE = os.sysconf("SC_PAGE_SIZE")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openengine-serve bench --coordinator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator", action="store_true", help="(selects this benchmark)")
    p.add_argument("--coordinators", type=int, default=1, help="coordinator processes sharing the request ids "
                                                                "(default 1)")
    p.add_argument("--nodes", type=int, default=1000, help="simulated nodes (default 1000)")
    p.add_argument("--frontends", type=int, default=100, help="simulated frontends (default 100)")
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat interval of every simulated "
                                                                   "node and frontend (default 1.0)")
    p.add_argument("--load-changes", type=float, default=0.0,
                   help="share of the node heartbeats whose load figures differ from the node's previous ones "
                        "(0..1; default 0: idle nodes; 1: every node busy, so every frontend heartbeat's reply "
                        "carries the whole node table)")
    p.add_argument("--concurrency", type=int, default=512, help="saturation: request loops (default 512)")
    p.add_argument("--channels", type=int, default=8, help="unary path: client channels (default 8)")
    p.add_argument("--rate", type=float, default=40.0, help="fixed load: requests/s (default 40)")
    p.add_argument("--window-s", type=float, default=5.0, help="measured window per scenario (default 5)")
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--paths", default="unary,batched", help="which paths to measure (default unary,batched)")
    p.add_argument("--coordinator-pythonpath", default="",
                   help="run the coordinator from this source tree instead (e.g. an older checkout's service/, "
                        "to measure its unary path: --paths unary)")
    p.add_argument("--output", default="bench-results", help="directory for coordinator.json (default bench-results/)")
    return p


def cpu_seconds_each(pids: list[int]) -> list[float]:
    each = []
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        each.append((int(fields[11]) + int(fields[12])) / TICKS)  # utime, stime
    return each


def cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_seconds_each(pids))


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class SimulatedDeployment:
    """Every simulated node and frontend registers and heartbeats with every coordinator."""

    def __init__(self, targets: list[str], args: argparse.Namespace) -> None:
        self.args = args
        self.channels = [grpc.aio.insecure_channel(target) for target in targets]
        self.stubs = [cluster_pb2_grpc.CoordinatorStub(channel) for channel in self.channels]
        self.targets = targets
        self.frontend_ids = [f"bench-fe-{i}" for i in range(args.frontends)]
        self.heartbeat_process: multiprocessing.Process | None = None

    async def register(self) -> None:
        for stub in self.stubs:
            for rank in range(self.args.nodes):
                node = cluster_pb2.NodeEntry(node_id=f"bench-node-{rank}", address=f"127.0.0.1:{10000 + rank}",
                                             rank=rank, load=self.load())
                await stub.RegisterNode(cluster_pb2.RegisterNodeRequest(node=node), timeout=10)
            for frontend_id in self.frontend_ids:
                await stub.RegisterFrontend(cluster_pb2.RegisterFrontendRequest(
                    frontend_id=frontend_id, address="127.0.0.1:1"), timeout=10)

    @staticmethod
    def load(running: int = 0) -> cluster_pb2.NodeLoad:
        return cluster_pb2.NodeLoad(running_requests=running, max_running_requests=1_000_000,
                                    max_queued_requests=1_000_000)

    def start_heartbeats(self) -> None:
        """The heartbeats run in a process of their own (`heartbeat_peers`), so that the loop that times the
        reservations does not also wait for 1,000 peers' heartbeats: its latencies are the coordinator's."""
        self.heartbeat_process = multiprocessing.get_context("spawn").Process(
            target=heartbeat_peers, args=(self.targets, self.args, self.frontend_ids), daemon=True,
            name="bench-heartbeats")
        self.heartbeat_process.start()

    async def wait_all_ready(self, timeout_s: float = 120.0) -> None:
        """Until every coordinator has every node READY (their first heartbeats came: the peers' process started)."""
        deadline = time.monotonic() + timeout_s
        for stub in self.stubs:
            while True:
                load = await stub.GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=10)
                if sum(n.state == cluster_pb2.NODE_STATE_READY for n in load.nodes) == self.args.nodes:
                    break
                if time.monotonic() > deadline or not self.heartbeat_process.is_alive():
                    raise SystemExit("the simulated nodes did not all become READY (their heartbeats did not arrive)")
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        if self.heartbeat_process is not None:
            self.heartbeat_process.terminate()
            self.heartbeat_process.join(timeout=10)
        for channel in self.channels:
            await channel.close()


def heartbeat_peers(targets: list[str], args: argparse.Namespace, frontend_ids: list[str]) -> None:
    """Every simulated node and frontend heartbeats once per interval on its own stream to each coordinator (the
    peers' class, `common/heartbeat_stream.py`), the peers spread evenly over the interval; a node's heartbeat
    carries new load figures with probability --load-changes. Runs until terminated."""
    interval = args.heartbeat_s
    peers = [(f"bench-node-{rank}", True) for rank in range(args.nodes)] + [(f, False) for f in frontend_ids]
    rng = random.Random(0)

    async def beat(stub: cluster_pb2_grpc.CoordinatorStub, peer_id: str, is_node: bool, offset: float) -> None:
        stream = HeartbeatStream(stub.NodeHeartbeats if is_node else stub.FrontendHeartbeats, 10.0)
        load, running = SimulatedDeployment.load(), 0
        next_at = time.monotonic() + offset
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += interval
            if not is_node:
                heartbeat = cluster_pb2.FrontendHeartbeatRequest(frontend_id=peer_id)
            else:
                if rng.random() < args.load_changes:
                    running = (running + 1) % 64
                    load = SimulatedDeployment.load(running)
                heartbeat = cluster_pb2.NodeHeartbeatRequest(node_id=peer_id, state=cluster_pb2.NODE_STATE_READY,
                                                             load=load)
            with contextlib.suppress(HeartbeatFailed):  # a late reply: the coordinator's expiry counts it
                await stream.beat(heartbeat)

    async def run() -> None:
        # A connection per frontend (as each frontend worker has), the nodes' shared by NODES_PER_CHANNEL: one
        # connection for every stream made the coordinator's large replies (whole tables) queue behind each other.
        beats = []
        for target in targets:
            stubs: dict[str, cluster_pb2_grpc.CoordinatorStub] = {}
            for i, (peer_id, is_node) in enumerate(peers):
                group = f"nodes-{i // NODES_PER_CHANNEL}" if is_node else peer_id
                if group not in stubs:
                    stubs[group] = cluster_pb2_grpc.CoordinatorStub(grpc.aio.insecure_channel(target))
                beats.append(beat(stubs[group], peer_id, is_node, i * interval / len(peers)))
        await asyncio.gather(*beats)

    asyncio.run(run())


class UnaryPath:
    name = "unary"

    def __init__(self, targets: list[str], channels: int, frontend_ids: list[str]) -> None:
        self.targets = targets
        self.channels = {target: [grpc.aio.insecure_channel(target) for _ in range(channels)] for target in targets}
        self.stubs = {target: [cluster_pb2_grpc.CoordinatorStub(c) for c in chans]
                      for target, chans in self.channels.items()}
        self.frontend_ids = frontend_ids

    async def one(self, i: int) -> float:
        frontend_id = self.frontend_ids[i % len(self.frontend_ids)]
        request_id = uuid.uuid4().hex
        stubs = self.stubs[owning_coordinator(request_id, self.targets)]
        stub = stubs[i % len(stubs)]
        started = time.perf_counter()
        await stub.Reserve(cluster_pb2.ReserveRequest(request_id=request_id, frontend_id=frontend_id), timeout=10)
        latency = time.perf_counter() - started
        await stub.Release(cluster_pb2.ReleaseRequest(request_id=request_id, frontend_id=frontend_id), timeout=10)
        return latency

    async def close(self) -> None:
        for chans in self.channels.values():
            for channel in chans:
                await channel.close()


class BatchedPath:
    name = "batched"

    def __init__(self, targets: list[str], frontend_ids: list[str]) -> None:
        # One channel and one stream per simulated frontend and coordinator, as each frontend process has.
        self.targets = targets
        self.channels = [grpc.aio.insecure_channel(target) for _ in frontend_ids for target in targets]
        channels = iter(self.channels)
        self.batchers = [{target: ReservationBatcher(fid, cluster_pb2_grpc.CoordinatorStub(next(channels)).Reservations)
                          for target in targets} for fid in frontend_ids]

    async def one(self, i: int) -> float:
        request_id = uuid.uuid4().hex
        batcher = self.batchers[i % len(self.batchers)][owning_coordinator(request_id, self.targets)]
        started = time.perf_counter()
        await batcher.reserve(cluster_pb2.ReserveRequest(request_id=request_id))
        latency = time.perf_counter() - started
        batcher.release(request_id)
        return latency

    def batches(self) -> int:
        return sum(b.batches_sent for per_frontend in self.batchers for b in per_frontend.values())

    async def close(self) -> None:
        for per_frontend in self.batchers:
            for batcher in per_frontend.values():
                await batcher.close()
        for channel in self.channels:
            await channel.close()


async def measure(path, coordinator_pids: list[int], args: argparse.Namespace, rate: float | None) -> dict:
    """Saturation (rate None: --concurrency closed loops) or an open loop at `rate` requests/s."""
    latencies: list[float] = []
    done = 0
    recording = False
    stop = False
    errors: collections.Counter[str] = collections.Counter()

    async def run_one(i: int) -> None:
        nonlocal done
        try:
            latency = await path.one(i)
        except Exception as exc:  # noqa: BLE001 - counted and reported by kind
            errors[exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__] += 1
            return
        if recording:
            latencies.append(latency)
            done += 1

    async def closed_loop(i: int) -> None:
        while not stop:
            await run_one(i)

    async def open_loop() -> None:
        i = 0
        next_at = time.monotonic()
        pending = set()
        while not stop:
            task = asyncio.create_task(run_one(i))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            next_at += 1.0 / rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    loops = ([asyncio.create_task(open_loop())] if rate else
             [asyncio.create_task(closed_loop(i)) for i in range(args.concurrency)])
    await asyncio.sleep(args.warmup_s)
    batches_before = path.batches() if hasattr(path, "batches") else 0
    recording = True
    each0, own0, t0 = cpu_seconds_each(coordinator_pids), time.process_time(), time.monotonic()
    await asyncio.sleep(args.window_s)
    each1, own1, t1 = cpu_seconds_each(coordinator_pids), time.process_time(), time.monotonic()
    cpu0, cpu1 = sum(each0), sum(each1)
    recording = False
    stop = True
    await asyncio.gather(*loops, return_exceptions=True)
    elapsed = t1 - t0
    result = {
        "path": path.name, "load": f"{rate:g}/s" if rate else f"saturation ({args.concurrency} loops)",
        "reservations_per_s": done / elapsed,
        "coordinator_cores": (cpu1 - cpu0) / elapsed,
        # With several coordinators: the one that caps the deployment first (each has its own core to go to).
        "busiest_coordinator_cores": max(b - a for a, b in zip(each0, each1)) / elapsed,
        "coordinator_cpu_us_per_request": 1e6 * (cpu1 - cpu0) / max(1, done),
        "load_generator_cores": (own1 - own0) / elapsed,
        "latency_p50_ms": 1e3 * percentile(latencies, 0.50),
        "latency_p99_ms": 1e3 * percentile(latencies, 0.99),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
    }
    if hasattr(path, "batches"):
        result["requests_per_batch"] = done / max(1, path.batches() - batches_before)
    return result


async def heartbeat_only(coordinator_pids: list[int], peers_pid: int, window_s: float) -> tuple[float, float]:
    """The coordinators' cores and the simulated peers' (their process) while only the heartbeats flow."""
    cpu0, peers0, t0 = cpu_seconds(coordinator_pids), cpu_seconds([peers_pid]), time.monotonic()
    await asyncio.sleep(window_s)
    elapsed = time.monotonic() - t0
    return (cpu_seconds(coordinator_pids) - cpu0) / elapsed, (cpu_seconds([peers_pid]) - peers0) / elapsed


async def drive(targets: list[str], pids: list[int], args: argparse.Namespace) -> dict:
    """Memory is the first coordinator's (each holds the whole node and frontend table); CPU is all of theirs."""
    rss_empty = rss_bytes(pids[0])
    deployment = SimulatedDeployment(targets, args)
    await deployment.register()
    rss_registered = rss_bytes(pids[0])
    deployment.start_heartbeats()
    await deployment.wait_all_ready()
    await asyncio.sleep(args.warmup_s)
    heartbeat_cores, heartbeat_peers_cores = await heartbeat_only(pids, deployment.heartbeat_process.pid,
                                                                  args.window_s)
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("coordinator", "output")},
        "cpus": os.cpu_count(),
        "memory": {"rss_empty_mb": rss_empty / 2**20, "rss_registered_mb": rss_registered / 2**20,
                   "bytes_per_registered_peer": (rss_registered - rss_empty) / max(1, args.nodes + args.frontends)},
        "heartbeat_only_cores": heartbeat_cores,
        "heartbeat_peers_cores": heartbeat_peers_cores,  # the simulated peers' process
        "scenarios": [],
    }
    known = {"unary": lambda: UnaryPath(targets, args.channels, deployment.frontend_ids),
             "batched": lambda: BatchedPath(targets, deployment.frontend_ids)}
    paths = [known[name.strip()]() for name in args.paths.split(",") if name.strip()]
    try:
        for rate in (None, args.rate):
            for path in paths:
                scenario = await measure(path, pids, args, rate)
                # What the requests add on top of the heartbeats (measured alone before).
                extra_cores = max(0.0, scenario["coordinator_cores"] - result["heartbeat_only_cores"])
                scenario["marginal_cpu_us_per_request"] = 1e6 * extra_cores / max(1e-9, scenario["reservations_per_s"])
                result["scenarios"].append(scenario)
                print(json.dumps(scenario), flush=True)
    finally:
        for path in paths:
            await path.close()
        await deployment.close()
    return result


def render(result: dict) -> str:
    mem = result["memory"]
    lines = [
        f"Coordinator benchmark: {result['config']['coordinators']} coordinator(s), {result['config']['nodes']} nodes, "
        f"{result['config']['frontends']} frontends "
        f"(heartbeat {result['config']['heartbeat_s']} s, new load figures in "
        f"{result['config'].get('load_changes', 0.0):.0%} of node heartbeats), {result['cpus']} CPUs shared with the "
        f"load generator",
        f"memory: {mem['rss_empty_mb']:.1f} MB empty, {mem['rss_registered_mb']:.1f} MB registered "
        f"({mem['bytes_per_registered_peer'] / 1024:.1f} KiB per node/frontend); heartbeats alone: "
        f"{result['heartbeat_only_cores']:.2f} cores (the simulated peers: {result['heartbeat_peers_cores']:.2f})",
        "",
        "| path | load | reservations/s | coordinator cores (busiest) | CPU µs/request (all) | CPU µs/request (beyond "
        "heartbeats) | p50 ms | p99 ms | requests/message | load-gen cores | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["scenarios"]:
        lines.append(f"| {s['path']} | {s['load']} | {s['reservations_per_s']:,.0f} | {s['coordinator_cores']:.2f} "
                     f"({s['busiest_coordinator_cores']:.2f}) | "
                     f"{s['coordinator_cpu_us_per_request']:,.0f} | {s['marginal_cpu_us_per_request']:,.0f} | "
                     f"{s['latency_p50_ms']:.2f} | "
                     f"{s['latency_p99_ms']:.2f} | {s.get('requests_per_batch', 1):.1f} | "
                     f"{s['load_generator_cores']:.2f} | {s['errors']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.coordinators < 1:
        raise SystemExit(f"--coordinators must be >= 1, got {args.coordinators}")
    expiry = max(3.0, 5 * args.heartbeat_s)
    log = open(out / "coordinator-bench.log", "ab")
    env = dict(os.environ)
    if args.coordinator_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.coordinator_pythonpath, env.get("PYTHONPATH")]))
    targets, procs = [], []
    try:
        for _ in range(args.coordinators):
            port = free_port()
            targets.append(f"127.0.0.1:{port}")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "openengine_serve", "coordinator", "--host", "127.0.0.1", "--port", str(port),
                 "--metrics-port", "0", "--heartbeat-s", str(args.heartbeat_s), "--node-expiry-s", str(expiry),
                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + 30
        for target, proc in zip(targets, procs):
            while not is_serving(target):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"a coordinator did not start; see {out / 'coordinator-bench.log'}")
                time.sleep(0.2)
        result = asyncio.run(drive(targets, [proc.pid for proc in procs], args))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=15)
    (out / "coordinator.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = render(result)
    (out / "coordinator.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0
