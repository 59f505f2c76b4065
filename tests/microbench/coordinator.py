"""`python -m tests.microbench.coordinator`: one coordinator (or --coordinators N sharing the request ids) driven by
simulated frontends and nodes.

Real coordinator processes; the load generator simulates --nodes nodes
(register, then heartbeat with their load every --heartbeat-s) and --frontends
frontends (register, heartbeat), each peer on its own heartbeat stream as the real
ones, in a process of their own so that the requests' loop times only the
coordinator. Then, in one run and side by side:

- unary: --concurrency loops, each Reserve then Release of a fresh id (the
  unary Reserve and Release: two calls per request), spread over the
  frontends' ids and --channels channels;
- batched: the same loops through each simulated frontend's own
  `ReservationBatcher` (the frontend's class): one stream per frontend,
  reservations and releases coalesced per event-loop tick;
- each path also at a fixed --rate (requests/s, open loop; --rate-window-s) for
  the latency a request sees at ordinary load;
- the floor of that latency: the batched path at --rate against a trivial server
  (same grpc.aio server, loop and stream; every reservation answered at once, no
  state) in a process of its own, right after, while the heartbeats go on. On a
  VM whose scheduler alone delays a 1 ms sleep by several ms now and then, the
  p99 through the coordinator means little without it.

With --coordinators N every simulated node and frontend registers and
heartbeats with each coordinator, and each request goes to the coordinator that
owns its id (the frontends' rule, `common/routing.py : owning_coordinator`): one
stream per simulated frontend and coordinator on the batched path.

Reported: reservations/s, coordinator CPU per request (utime+stime from
/proc/<pid>/stat over the window, summed over the coordinators), latency p50/p99 of the reservation, and each
coordinator's resident memory per registered node and frontend. The load
generator shares the machine: at saturation it may be the limit, which the
report shows per window ("limited by").

Scaling (`--coordinators 1,2 --rounds R --coordinator-cpus Q`): each count is
measured in turn, round by round (1, 2, 1, 2, ...: drift of the machine hits
both alike), with fresh coordinators and a fresh registration per run. With a
CPU budget, each coordinator process runs in a cgroup of its own with a Q-CPU
quota (every core visible, as under `docker --cpus`), so that the coordinators,
not the load generator, are the bottleneck at saturation; the cgroups'
throttling shows which one limited each window. The report gives min/median
reservations/s per count over the rounds and the per-round ratio to the
smallest count. `--in-step` keeps each simulated frontend's reservations per
event-loop tick the same whatever the count (the independent loops fall out of
step with several coordinators, which fragments the batches).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
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

from openengine_bench import report
from openengine_bench.cgroups import CgroupUnavailable, QuotaCgroup
from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from openengine_serve.client import is_serving
from openengine_serve.common.grpc_server import create_internal_server
from openengine_serve.common.heartbeat_stream import HeartbeatFailed, HeartbeatStream
from openengine_serve.common.lifecycle import freeze_startup_objects, new_event_loop
from openengine_serve.common.net import free_port
from openengine_serve.common.routing import owning_coordinator
from openengine_serve.frontend.reservation_stream import ReservationBatcher
from openengine_serve.local import component_command

TICKS = os.sysconf("SC_CLK_TCK")
QUOTA_USED = 0.8  # a coordinator that used this share of its CPU quota over a window was limited by it
NODES_PER_CHANNEL = 50  # simulated nodes sharing one connection to a coordinator
PAGE = os.sysconf("SC_PAGE_SIZE")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.microbench.coordinator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--coordinators",
        type=coordinator_counts,
        default=[1],
        help="coordinator processes sharing the request ids (default 1); a comma list (e.g. 1,2) "
        "measures each count in turn, alternating round by round",
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds over the counts of --coordinators (default 1)")
    p.add_argument(
        "--coordinator-cpus",
        type=cpu_budget,
        default=0.0,
        help="each coordinator in a cgroup of its own with this CPU quota (e.g. 0.25), so that the "
        "coordinators are the bottleneck at saturation; needs root (default 0: no quota)",
    )
    p.add_argument("--nodes", type=int, default=1000, help="simulated nodes (default 1000)")
    p.add_argument("--frontends", type=int, default=100, help="simulated frontends (default 100)")
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=1.0,
        help="heartbeat interval of every simulated node and frontend (default 1.0)",
    )
    p.add_argument(
        "--load-changes",
        type=float,
        default=0.0,
        help="share of the node heartbeats whose load figures differ from the node's previous ones "
        "(0..1; default 0: idle nodes; 1: every node busy, so every frontend heartbeat's reply "
        "carries the whole node table)",
    )
    p.add_argument("--concurrency", type=int, default=512, help="saturation: request loops (default 512)")
    p.add_argument(
        "--in-step",
        action="store_true",
        help="saturation as frontends whose ticks each carry the same requests: every simulated frontend "
        "asks for its share of --concurrency in one tick and, once all are answered, releases them "
        "and asks for the next in one tick (default: --concurrency independent loops, whose batches "
        "fragment when the replies of several coordinators arrive apart)",
    )
    p.add_argument("--channels", type=int, default=8, help="unary path: client channels (default 8)")
    p.add_argument("--rate", type=float, default=40.0, help="fixed load: requests/s (default 40; 0: saturation only)")
    p.add_argument("--window-s", type=float, default=5.0, help="measured window per saturation scenario (default 5)")
    p.add_argument(
        "--rate-window-s",
        type=float,
        default=20.0,
        help="measured window at --rate (default 20: 800 reservations at 40/s, so the p99 is not one wait)",
    )
    p.add_argument(
        "--no-floor",
        action="store_true",
        help="leave out the floor: the batched path at --rate against a trivial server in its own "
        "process (same stream and client, every reservation answered at once), measured after the "
        "coordinator in the same conditions, so the p99 the coordinator adds can be told from what "
        "the machine and the transport cost",
    )
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--paths", default="unary,batched", help="which paths to measure (default unary,batched)")
    p.add_argument(
        "--coordinator-pythonpath",
        default="",
        help="run the coordinator from this source tree instead (e.g. an older checkout's service/, "
        "to measure its unary path: --paths unary)",
    )
    p.add_argument("--output", default="bench-results", help="directory for coordinator.json (default bench-results/)")
    return p


def coordinator_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected coordinator counts like 1 or 1,2, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"every coordinator count must be >= 1, got {text!r}")
    return list(dict.fromkeys(counts))


def cpu_budget(text: str) -> float:
    try:
        cpus = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of CPUs like 0.25, got {text!r}") from None
    if not 0 <= cpus <= os.cpu_count():
        raise argparse.ArgumentTypeError(
            f"the coordinator CPU quota must be between 0 and {os.cpu_count()} (this machine's CPUs), got {text!r}"
        )
    return cpus


def machine_idle_seconds() -> float:
    """Idle + iowait of every CPU since boot (the aggregate line of /proc/stat)."""
    values = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(values[3]) + int(values[4])) / TICKS


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
        await asyncio.gather(*(self.register_with(stub) for stub in self.stubs))

    async def register_with(self, stub: cluster_pb2_grpc.CoordinatorStub) -> None:
        """One coordinator's registrations in order (the coordinators in parallel)."""
        for rank in range(self.args.nodes):
            node = cluster_pb2.NodeEntry(
                node_id=f"bench-node-{rank}", address=f"127.0.0.1:{10000 + rank}", rank=rank, load=self.load()
            )
            await stub.RegisterNode(cluster_pb2.RegisterNodeRequest(node=node), timeout=10)
        for frontend_id in self.frontend_ids:
            await stub.RegisterFrontend(
                cluster_pb2.RegisterFrontendRequest(frontend_id=frontend_id, address="127.0.0.1:1"), timeout=10
            )

    @staticmethod
    def load(running: int = 0) -> cluster_pb2.NodeLoad:
        return cluster_pb2.NodeLoad(
            running_requests=running, max_running_requests=1_000_000, max_queued_requests=1_000_000
        )

    def start_heartbeats(self) -> None:
        """The heartbeats run in a process of their own (`heartbeat_peers`), so that the loop that times the
        reservations does not also wait for 1,000 peers' heartbeats: its latencies are the coordinator's."""
        self.heartbeat_process = multiprocessing.get_context("spawn").Process(
            target=heartbeat_peers,
            args=(self.targets, self.args, self.frontend_ids),
            daemon=True,
            name="bench-heartbeats",
        )
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
    peers' class, `common/heartbeat_stream.py`; the nodes' heartbeats quiet, as the real nodes'), the peers spread
    evenly over the interval; a node's heartbeat carries new load figures with probability --load-changes. Runs until
    terminated."""
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
                heartbeat = cluster_pb2.NodeHeartbeatRequest(
                    node_id=peer_id, state=cluster_pb2.NODE_STATE_READY, load=load
                )
            with contextlib.suppress(HeartbeatFailed):  # a late reply: the coordinator's expiry counts it
                await stream.beat(heartbeat, quiet=is_node)  # nodes as the real ones: no reply awaited

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
        # As in every component: a full collection in this process would hold back the heartbeats due meanwhile,
        # which would then reach the coordinator in one burst (1,000 real nodes are not paused together).
        freeze_startup_objects()
        await asyncio.gather(*beats)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run())


FLOOR_PATH = "batched, trivial server (floor)"
FLOOR_NODE = cluster_pb2.NodeEntry(node_id="floor-node", address="127.0.0.1:1")


class TrivialCoordinator(cluster_pb2_grpc.CoordinatorServicer):
    """The floor: answers every batched reservation with the same node at once, and keeps no state."""

    async def Reservations(self, request_iterator, context):
        async for batch in request_iterator:
            yield cluster_pb2.ReservationReplies(
                outcome=[cluster_pb2.ReservationOutcome(node=FLOOR_NODE) for _ in batch.reserve]
            )


def serve_trivial_coordinator(ports: multiprocessing.Queue[int]) -> None:
    """Runs in a process of its own: the same grpc.aio server, options, event loop and GC settings as the
    coordinator."""

    async def serve() -> None:
        server = create_internal_server()
        cluster_pb2_grpc.add_CoordinatorServicer_to_server(TrivialCoordinator(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        freeze_startup_objects()
        ports.put(port)
        await server.wait_for_termination()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve())


class TrivialServer:
    """`serve_trivial_coordinator` in a spawned process; measured like the coordinators (`measure` reads its pid)."""

    cpus = 0.0

    def __enter__(self) -> TrivialServer:
        context = multiprocessing.get_context("spawn")
        ports = context.Queue()
        self.process = context.Process(
            target=serve_trivial_coordinator, args=(ports,), daemon=True, name="bench-trivial-coordinator"
        )
        self.process.start()
        self.targets = [f"127.0.0.1:{ports.get(timeout=30)}"]
        self.pids = [self.process.pid]
        return self

    def throttling(self) -> list[dict[str, float]]:
        return []

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.join(timeout=10)


class UnaryPath:
    name = "unary"

    def __init__(self, targets: list[str], channels: int, frontend_ids: list[str]) -> None:
        self.targets = targets
        self.channels = {target: [grpc.aio.insecure_channel(target) for _ in range(channels)] for target in targets}
        self.stubs = {
            target: [cluster_pb2_grpc.CoordinatorStub(c) for c in chans] for target, chans in self.channels.items()
        }
        self.frontend_ids = frontend_ids

    async def reserve(self, i: int) -> tuple[tuple, float]:
        """Reserves a fresh id for loop i: (what `release` needs, the reservation's latency)."""
        frontend_id = self.frontend_ids[i % len(self.frontend_ids)]
        request_id = uuid.uuid4().hex
        stubs = self.stubs[owning_coordinator(request_id, self.targets)]
        stub = stubs[i % len(stubs)]
        started = time.perf_counter()
        await stub.Reserve(cluster_pb2.ReserveRequest(request_id=request_id, frontend_id=frontend_id), timeout=10)
        return (stub, request_id, frontend_id), time.perf_counter() - started

    async def release(self, held: tuple) -> None:
        stub, request_id, frontend_id = held
        await stub.Release(cluster_pb2.ReleaseRequest(request_id=request_id, frontend_id=frontend_id), timeout=10)

    async def close(self) -> None:
        for chans in self.channels.values():
            for channel in chans:
                await channel.close()


class BatchedPath:
    def __init__(self, targets: list[str], frontend_ids: list[str], name: str = "batched") -> None:
        # One channel and one stream per simulated frontend and coordinator, as each frontend process has.
        self.name = name
        self.targets = targets
        self.channels = [grpc.aio.insecure_channel(target) for _ in frontend_ids for target in targets]
        channels = iter(self.channels)
        self.batchers = [
            {
                target: ReservationBatcher(fid, cluster_pb2_grpc.CoordinatorStub(next(channels)).Reservations)
                for target in targets
            }
            for fid in frontend_ids
        ]

    async def reserve(self, i: int) -> tuple[tuple, float]:
        request_id = uuid.uuid4().hex
        batcher = self.batchers[i % len(self.batchers)][owning_coordinator(request_id, self.targets)]
        started = time.perf_counter()
        await batcher.reserve(cluster_pb2.ReserveRequest(request_id=request_id))
        return (batcher, request_id), time.perf_counter() - started

    async def release(self, held: tuple) -> None:
        batcher, request_id = held
        batcher.release(request_id)  # rides on the batcher's next batch; returns at once

    def batches(self) -> int:
        return sum(b.batches_sent for per_frontend in self.batchers for b in per_frontend.values())

    async def close(self) -> None:
        for per_frontend in self.batchers:
            for batcher in per_frontend.values():
                await batcher.close()
        for channel in self.channels:
            await channel.close()


class Coordinators:
    """The coordinator processes of one run, each in a CPU-quota cgroup of its own when `cpus` is set (moved in by
    `confine`)."""

    def __init__(self, count: int, cpus: float, args: argparse.Namespace, out: Path) -> None:
        self.count, self.cpus, self.args, self.out = count, cpus, args, out
        self.targets: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.cgroups: list[QuotaCgroup] = []

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def start(self) -> Coordinators:
        expiry = max(3.0, 5 * self.args.heartbeat_s)
        env = dict(os.environ)
        if self.args.coordinator_pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.args.coordinator_pythonpath, env.get("PYTHONPATH")]))
        with open(self.out / "coordinator-bench.log", "ab") as log:
            for i in range(self.count):
                if self.cpus:
                    try:
                        self.cgroups.append(
                            QuotaCgroup(self.cpus, name=f"openengine-coordinator-bench-{os.getpid()}-{i}").create()
                        )
                    except CgroupUnavailable as exc:
                        raise SystemExit(
                            f"--coordinator-cpus {self.cpus:g}: {exc}; run as root, or leave it out (no quota)"
                        ) from exc
                port = free_port()
                self.targets.append(f"127.0.0.1:{port}")
                self.procs.append(
                    subprocess.Popen(
                        component_command(
                            "coordinator",
                            "127.0.0.1",
                            port,
                            metrics_port=0,
                            heartbeat_s=self.args.heartbeat_s,
                            node_expiry_s=expiry,
                            log_level="warning",
                        ),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
        deadline = time.monotonic() + 30
        for target, proc in zip(self.targets, self.procs):
            while not is_serving(target):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"a coordinator did not start; see {self.out / 'coordinator-bench.log'}")
                time.sleep(0.2)
        return self

    def confine(self) -> None:
        """Moves each coordinator into its quota cgroup: after the simulated deployment registered (at full speed:
        1,000 registrations under a 0.1-CPU quota take seconds of wall time each run)."""
        for cgroup, pid in zip(self.cgroups, self.pids):
            cgroup.add(pid)

    def throttling(self) -> list[dict[str, float]]:
        return [cgroup.throttling() for cgroup in self.cgroups]

    def stop(self) -> None:
        try:
            for proc in self.procs:
                proc.terminate()
            for proc in self.procs:
                proc.wait(timeout=15)
        finally:
            for cgroup in self.cgroups:
                cgroup.close()

    def __enter__(self) -> Coordinators:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def limited_by(
    load: str,
    coordinator_cores: list[float],
    quota_cpus: float,
    throttled_shares: list[float | None],
    load_generator_cores: float,
    machine_idle_cores: float,
) -> tuple[str, bool]:
    """What limited a window, and whether it was the coordinators alone (every one at its quota, or at a full
    core without one; the load generator and the machine with room left).

    A coordinator is at its quota when it used QUOTA_USED of it over the window. Its throttled share is shown but
    not enough: a process that works in bursts is throttled in some periods while using far less than its quota
    (seen on a busy machine: throttled in 11 % of the periods at 0.04 of a 0.1-CPU quota)."""
    at_limit = [cores >= QUOTA_USED * quota_cpus if quota_cpus else cores >= report.BUSY for cores in coordinator_cores]
    reasons = []
    if any(at_limit):
        busiest = max(range(len(coordinator_cores)), key=lambda i: coordinator_cores[i])
        share = throttled_shares[busiest]
        reasons.append(
            f"coordinator CPU ({sum(at_limit)} of {len(at_limit)} at "
            + (
                f"their {quota_cpus:g}-CPU quota; busiest {coordinator_cores[busiest]:.2f} CPU, throttled "
                f"in {(share or 0.0) * 100:.0f} % of periods)"
                if quota_cpus
                else f"a full core; busiest {coordinator_cores[busiest]:.2f})"
            )
        )
    # The load generator is one Python process: one core is all it can use.
    if load_generator_cores >= report.BUSY:
        reasons.append(f"load generator ({load_generator_cores:.2f} core)")
    if machine := report.machine_reason(machine_idle_cores):
        reasons.append(machine)
    if not reasons:
        return (
            "none (open-loop arrivals; nothing saturated)" if load.endswith("/s") else "none saturated (latency-bound)"
        ), False
    return "; ".join(reasons), all(at_limit) and len(reasons) == 1


async def measure(path, coordinators: Coordinators, args: argparse.Namespace, rate: float | None) -> dict:
    """Saturation (rate None: --concurrency closed loops, or with --in-step one loop per simulated frontend asking
    for its share at once) or an open loop at `rate` requests/s."""
    gc.collect()  # the previous scenario's garbage goes before this one starts (see `drive`)
    coordinator_pids = coordinators.pids
    latencies: list[float] = []
    finished_at: list[float] = []
    done = 0
    stop = False
    errors: collections.Counter[str] = collections.Counter()

    def count_error(exc: Exception) -> None:
        errors[exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__] += 1

    # [start, end) of the measured window. Throughput counts the reservations answered inside it; the latencies
    # are those of the reservations asked for inside it (each waited for, even past its end): counting those that
    # merely finished in it counted the warm-up's first ones, which queue behind the first 512 at once (≈1.4 s at
    # saturation).
    window = [float("inf"), float("inf")]

    async def reserve(i: int) -> tuple | None:
        nonlocal done
        asked_at = time.monotonic()
        try:
            held, latency = await path.reserve(i)
        except Exception as exc:  # noqa: BLE001 - counted and reported by kind
            count_error(exc)
            return None
        answered_at = time.monotonic()
        if window[0] <= answered_at < window[1]:
            done += 1
        if window[0] <= asked_at < window[1]:
            latencies.append(latency)
            finished_at.append(answered_at)
        return held

    async def release(held: tuple) -> None:
        try:
            await path.release(held)
        except Exception as exc:  # noqa: BLE001 - counted and reported by kind
            count_error(exc)

    async def run_one(i: int) -> None:
        held = await reserve(i)
        if held is not None:
            await release(held)

    async def closed_loop(i: int) -> None:
        while not stop:
            await run_one(i)

    async def in_step(i: int, per_tick: int) -> None:
        # Frontend i's releases and its next `per_tick` reservations are asked for in one tick (one task each,
        # all started together), so each of its streams carries them in one message whatever the coordinator count.
        held: list[tuple] = []
        while not stop:
            outcomes = await asyncio.gather(*(release(h) for h in held), *(reserve(i) for _ in range(per_tick)))
            held = [h for h in outcomes[len(held) :] if h is not None]
        await asyncio.gather(*(release(h) for h in held))

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
        await asyncio.gather(*pending, return_exceptions=True)

    if rate:
        loops = [asyncio.create_task(open_loop())]
        load = f"{rate:g}/s"
    elif args.in_step:
        per_tick = max(1, args.concurrency // args.frontends)
        loops = [asyncio.create_task(in_step(i, per_tick)) for i in range(args.frontends)]
        load = f"saturation ({args.frontends} frontends × {per_tick} in step)"
    else:
        loops = [asyncio.create_task(closed_loop(i)) for i in range(args.concurrency)]
        load = f"saturation ({args.concurrency} loops)"
    await asyncio.sleep(args.warmup_s)
    batches_before = path.batches() if hasattr(path, "batches") else 0
    throttled0, idle0 = coordinators.throttling(), machine_idle_seconds()
    each0, own0, t0 = cpu_seconds_each(coordinator_pids), time.process_time(), time.monotonic()
    window[0] = t0
    await asyncio.sleep(args.rate_window_s if rate else args.window_s)
    each1, own1, t1 = cpu_seconds_each(coordinator_pids), time.process_time(), time.monotonic()
    window[1] = t1
    throttled1, idle1 = coordinators.throttling(), machine_idle_seconds()
    cpu0, cpu1 = sum(each0), sum(each1)
    stop = True
    await asyncio.gather(*loops, return_exceptions=True)
    elapsed = t1 - t0
    each_cores = [(b - a) / elapsed for a, b in zip(each0, each1)]
    throttled_shares = [
        (after["throttled_periods"] - before["throttled_periods"]) / max(1.0, after["periods"] - before["periods"])
        if after and before
        else None
        for before, after in zip(throttled0, throttled1)
    ] or [None] * len(each_cores)
    load_generator_cores = (own1 - own0) / elapsed
    machine_idle_cores = (idle1 - idle0) / elapsed
    limit, coordinator_limited = limited_by(
        load, each_cores, coordinators.cpus, throttled_shares, load_generator_cores, machine_idle_cores
    )
    result = {
        "path": path.name,
        "load": load,
        "reservations_per_s": done / elapsed,
        "coordinator_cores": (cpu1 - cpu0) / elapsed,
        # With several coordinators: the one that caps the deployment first (each has its own core to go to).
        "busiest_coordinator_cores": max(each_cores),
        "each_coordinator_cores": each_cores,
        "coordinator_throttled_share": throttled_shares,
        "coordinator_cpu_us_per_request": 1e6 * (cpu1 - cpu0) / max(1, done),
        "load_generator_cores": load_generator_cores,
        "machine_idle_cores": machine_idle_cores,
        "limited_by": limit,
        "coordinator_limited": coordinator_limited,
        "latency_p50_ms": 1e3 * percentile(latencies, 0.50),
        "latency_p99_ms": 1e3 * percentile(latencies, 0.99),
        # The window's longest waits with when they came (s into the window): one stall decides a short window's p99.
        "latency_longest_ms": [
            (round(1e3 * wait, 2), round(at - t0, 3))
            for wait, at in sorted(zip(latencies, finished_at), reverse=True)[:5]
        ],
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


async def drive(coordinators: Coordinators, args: argparse.Namespace, round_number: int) -> dict:
    """One run: register, heartbeats alone, then every path at saturation and at --rate. Memory is each
    coordinator's (each holds the whole node and frontend table); CPU is all of theirs."""
    targets, pids = coordinators.targets, coordinators.pids
    peers = args.nodes + args.frontends
    rss_empty = [rss_bytes(pid) for pid in pids]
    deployment = SimulatedDeployment(targets, args)
    started = time.monotonic()
    await deployment.register()
    registration_s = time.monotonic() - started
    coordinators.confine()
    rss_registered = [rss_bytes(pid) for pid in pids]
    deployment.start_heartbeats()
    await deployment.wait_all_ready()
    await asyncio.sleep(args.warmup_s)
    heartbeat_cores, heartbeat_peers_cores = await heartbeat_only(pids, deployment.heartbeat_process.pid, args.window_s)
    result = {
        "round": round_number,
        "coordinators": len(targets),
        "coordinator_cpus": coordinators.cpus or None,
        "memory": [
            {
                "rss_empty_mb": empty / 2**20,
                "rss_registered_mb": registered / 2**20,
                "bytes_per_registered_peer": (registered - empty) / max(1, peers),
            }
            for empty, registered in zip(rss_empty, rss_registered)
        ],
        "registration_s": registration_s,
        "heartbeat_only_cores": heartbeat_cores,
        "heartbeat_peers_cores": heartbeat_peers_cores,  # the simulated peers' process
        "scenarios": [],
    }
    known = {
        "unary": lambda: UnaryPath(targets, args.channels, deployment.frontend_ids),
        "batched": lambda: BatchedPath(targets, deployment.frontend_ids),
    }
    paths = [known[name.strip()]() for name in args.paths.split(",") if name.strip()]
    # The simulated frontends' process collects its garbage as a frontend process does (frozen startup objects,
    # fewer young collections), and each scenario's garbage before the next (`measure`): otherwise a full
    # collection of the saturation's garbage lands in the fixed-rate window as "reservation latency".
    freeze_startup_objects()

    def keep(scenario: dict) -> None:
        result["scenarios"].append(scenario)
        print(json.dumps({"round": round_number, "coordinators": len(targets), **scenario}), flush=True)

    try:
        for rate in [None] + ([args.rate] if args.rate else []):
            for path in paths:
                scenario = await measure(path, coordinators, args, rate)
                # What the requests add on top of the heartbeats (measured alone before).
                extra_cores = max(0.0, scenario["coordinator_cores"] - result["heartbeat_only_cores"])
                scenario["marginal_cpu_us_per_request"] = 1e6 * extra_cores / max(1e-9, scenario["reservations_per_s"])
                keep(scenario)
        if args.rate and "batched" in [path.name for path in paths] and not args.no_floor:
            with TrivialServer() as trivial:
                floor = BatchedPath(trivial.targets, deployment.frontend_ids, name=FLOOR_PATH)
                try:
                    scenario = await measure(floor, trivial, args, args.rate)
                finally:
                    await floor.close()
            scenario["marginal_cpu_us_per_request"] = scenario["coordinator_cpu_us_per_request"]
            keep(scenario)
    finally:
        for path in paths:
            await path.close()
        await deployment.close()
    return result


def summarize(runs: list[dict]) -> dict:
    """Per (coordinators, path, load): min/median over the rounds; per (path, load) and count beyond the smallest:
    the ratio of reservations/s to the smallest count's in the same round, min/median over the rounds."""
    groups: dict[tuple[int, str, str], list[dict]] = collections.defaultdict(list)
    for run in runs:
        for scenario in run["scenarios"]:
            groups[(run["coordinators"], scenario["path"], scenario["load"])].append(
                {**scenario, "round": run["round"]}
            )
    rows = []
    for (count, path, load), scenarios in groups.items():
        rates = [s["reservations_per_s"] for s in scenarios]
        rows.append(
            {
                "coordinators": count,
                "path": path,
                "load": load,
                "rounds": len(scenarios),
                "reservations_per_s_min": min(rates),
                "reservations_per_s_median": report.median(rates),
                "coordinator_cpu_us_per_request_median": report.median(
                    [s["coordinator_cpu_us_per_request"] for s in scenarios]
                ),
                "busiest_coordinator_cores_median": report.median([s["busiest_coordinator_cores"] for s in scenarios]),
                "load_generator_cores_median": report.median([s["load_generator_cores"] for s in scenarios]),
                "requests_per_batch_median": report.median([s.get("requests_per_batch", 1.0) for s in scenarios]),
                "latency_p99_ms_median": report.median([s["latency_p99_ms"] for s in scenarios]),
                "coordinator_limited_rounds": sum(bool(s["coordinator_limited"]) for s in scenarios),
                "errors": sum(s["errors"] for s in scenarios),
            }
        )
    scaling = []
    base = min(run["coordinators"] for run in runs) if runs else 1
    for (count, path, load), scenarios in groups.items():
        if count == base or path == FLOOR_PATH:  # the floor's server is the same whatever the coordinator count
            continue
        base_by_round = {s["round"]: s for s in groups.get((base, path, load), [])}
        pairs = [(s, base_by_round[s["round"]]) for s in scenarios if s["round"] in base_by_round]
        ratios = [s["reservations_per_s"] / b["reservations_per_s"] for s, b in pairs if b["reservations_per_s"]]
        if ratios:
            scaling.append(
                {
                    "path": path,
                    "load": load,
                    "coordinators": count,
                    "versus": base,
                    "rounds": len(ratios),
                    "ratio_min": min(ratios),
                    "ratio_median": report.median(ratios),
                    "ratios": ratios,
                    "both_coordinator_limited_rounds": sum(
                        bool(s["coordinator_limited"] and b["coordinator_limited"]) for s, b in pairs
                    ),
                }
            )
    memory = []
    for count in sorted({run["coordinators"] for run in runs}):
        each = [m["bytes_per_registered_peer"] for run in runs if run["coordinators"] == count for m in run["memory"]]
        memory.append(
            {
                "coordinators": count,
                "bytes_per_registered_peer_median": report.median(each),
                "bytes_per_registered_peer_min": min(each),
                "bytes_per_registered_peer_max": max(each),
                "rss_registered_mb_median": report.median(
                    [m["rss_registered_mb"] for run in runs if run["coordinators"] == count for m in run["memory"]]
                ),
            }
        )
    return {"scenarios": rows, "scaling": scaling, "memory_per_coordinator": memory}


def floor_line(run: dict) -> str:
    """The p99 at the fixed rate through the coordinator next to the trivial server's, same run ('' without one)."""
    at_rate = {s["path"]: s for s in run["scenarios"] if s["load"].endswith("/s")}
    if FLOOR_PATH not in at_rate or "batched" not in at_rate:
        return ""
    coordinator, floor = at_rate["batched"], at_rate[FLOOR_PATH]
    return (
        f"\nRound {run['round']}, {run['coordinators']} coordinator(s), {coordinator['load']}: p99 "
        f"{coordinator['latency_p99_ms']:.2f} ms through the coordinator, {floor['latency_p99_ms']:.2f} ms through "
        f"the trivial server on the same stream (p50 {coordinator['latency_p50_ms']:.2f} / "
        f"{floor['latency_p50_ms']:.2f} ms): the coordinator's own share of the p99 is "
        f"{coordinator['latency_p99_ms'] - floor['latency_p99_ms']:+.2f} ms."
    )


def render(result: dict) -> str:
    config = result["config"]
    budget = (
        f"each coordinator in its own {config['coordinator_cpus']:g}-CPU cgroup quota"
        if config["coordinator_cpus"]
        else "no CPU quota"
    )
    lines = [
        f"Coordinator benchmark: {','.join(map(str, config['coordinators']))} coordinator(s), "
        f"{config['rounds']} round(s), {config['nodes']} nodes, {config['frontends']} frontends "
        f"(heartbeat {config['heartbeat_s']} s, new load figures in {config.get('load_changes', 0.0):.0%} of node "
        f"heartbeats), {budget}, {result['cpus']} CPUs shared with the load generator",
        "",
        "| round | coordinators | path | load | reservations/s | coordinator cores (busiest) | CPU µs/request (all) | "
        "CPU µs/request (beyond heartbeats) | p50 ms | p99 ms | requests/message | load-gen cores | errors | "
        "limited by |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in result["runs"]:
        for s in run["scenarios"]:
            lines.append(
                f"| {run['round']} | {run['coordinators']} | {s['path']} | {s['load']} | "
                f"{s['reservations_per_s']:,.0f} | {s['coordinator_cores']:.2f} "
                f"({s['busiest_coordinator_cores']:.2f}) | "
                f"{s['coordinator_cpu_us_per_request']:,.0f} | {s['marginal_cpu_us_per_request']:,.0f} | "
                f"{s['latency_p50_ms']:.2f} | {s['latency_p99_ms']:.2f} | "
                f"{s.get('requests_per_batch', 1):.1f} | {s['load_generator_cores']:.2f} | {s['errors']} | "
                f"{s['limited_by']} |"
            )
    lines += [line for line in map(floor_line, result["runs"]) if line]
    lines += ["", "Memory and heartbeats per run:", ""]
    for run in result["runs"]:
        memory = ", ".join(
            f"{m['rss_empty_mb']:.1f} → {m['rss_registered_mb']:.1f} MB "
            f"({m['bytes_per_registered_peer'] / 1024:.2f} KiB per node/frontend)"
            for m in run["memory"]
        )
        lines.append(
            f"- round {run['round']}, {run['coordinators']} coordinator(s): {memory}; heartbeats alone "
            f"{run['heartbeat_only_cores']:.2f} cores (all coordinators; the simulated peers "
            f"{run['heartbeat_peers_cores']:.2f}); registration took "
            f"{run['registration_s']:.1f} s"
        )
    summary = result["summary"]
    if config["rounds"] > 1 or len(config["coordinators"]) > 1:
        lines += [
            "",
            "Over the rounds (min / median):",
            "",
            "| coordinators | path | load | reservations/s min | median | CPU µs/request (median) | "
            "busiest coordinator cores | load-gen cores | requests/message | p99 ms | rounds limited by the "
            "coordinators alone |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in summary["scenarios"]:
            lines.append(
                f"| {row['coordinators']} | {row['path']} | {row['load']} | "
                f"{row['reservations_per_s_min']:,.0f} | {row['reservations_per_s_median']:,.0f} | "
                f"{row['coordinator_cpu_us_per_request_median']:,.0f} | "
                f"{row['busiest_coordinator_cores_median']:.2f} | {row['load_generator_cores_median']:.2f} | "
                f"{row['requests_per_batch_median']:.1f} | {row['latency_p99_ms_median']:.1f} | "
                f"{row['coordinator_limited_rounds']} of {row['rounds']} |"
            )
    if summary["scaling"]:
        lines += [
            "",
            "Reservations/s relative to the smallest count, same round (min / median over rounds):",
            "",
            "| path | load | coordinators | ratio min | ratio median | rounds where both runs were limited "
            "by the coordinators alone |",
            "|---|---|---|---:|---:|---|",
        ]
        for row in summary["scaling"]:
            lines.append(
                f"| {row['path']} | {row['load']} | {row['coordinators']} vs {row['versus']} | "
                f"{row['ratio_min']:.2f}× | {row['ratio_median']:.2f}× | "
                f"{row['both_coordinator_limited_rounds']} of {row['rounds']} |"
            )
    lines += [
        "",
        "Memory per registered node/frontend (each coordinator holds the whole table): "
        + "; ".join(
            f"{m['coordinators']} coordinator(s): median {m['bytes_per_registered_peer_median'] / 1024:.2f} KiB "
            f"[{m['bytes_per_registered_peer_min'] / 1024:.2f}–{m['bytes_per_registered_peer_max'] / 1024:.2f}] "
            f"per coordinator"
            for m in summary["memory_per_coordinator"]
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_number in range(1, args.rounds + 1):
        for count in args.coordinators:
            with Coordinators(count, args.coordinator_cpus, args, out) as coordinators:
                # The simulated frontends on the loop a frontend process runs (uvloop where installed).
                with asyncio.Runner(loop_factory=new_event_loop) as runner:
                    runs.append(runner.run(drive(coordinators, args, round_number)))
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "output"},
        "cpus": os.cpu_count(),
        "runs": runs,
        "summary": summarize(runs),
    }
    (out / "coordinator.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = render(result)
    (out / "coordinator.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
