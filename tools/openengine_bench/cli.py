"""`openengine-bench`: the frontend's CPU per token and throughput on grpcio and on pygrpc-native.

The real path runs as separate processes: load generator -> frontend (the
server under test, one worker) -> node -> MPI engine worker -> ZMQ -> back.
Coordinator, node, engine worker and the load generator share the other CPUs.
The frontend is placed three ways (--placement): pinned to --frontend-cpus
before it starts, in a cgroup CPU quota with every core visible (as under
`docker --cpus` or a Kubernetes limit), or unconstrained. The coordinator and
the node stay up for the whole run; only the frontend is restarted,
alternating the servers (and placements) round by round so slow drift hits
all alike. A baseline (a trivial streaming servicer on the same server
options, the same client and pacing) measures each server's bare cost per
streamed message; the budgeted saturation runs the frontend under a small
quota so that it, not the rest of the machine, is the bottleneck.

Results: <output>/bench.json, <output>/bench.png, <output>/report.md (also
printed), component logs in <output>/logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openengine_serve.common.lifecycle import event_loop_name

from . import report

if TYPE_CHECKING:
    from .load import LoadPool
    from .stack import Stack

FULL = {
    "fixed_rounds": 3,
    "saturation_rounds": 0,
    "baseline_rounds": 2,
    "budget_rounds": 5,
    "fixed_warmup_s": 3.0,
    "fixed_window_s": 10.0,
    "saturation_warmup_s": 4.0,
    "saturation_window_s": 10.0,
    "baseline_warmup_s": 2.0,
    "baseline_window_s": 8.0,
    "fixed_drain_s": 30.0,
}
QUICK = {
    "fixed_rounds": 1,
    "saturation_rounds": 0,
    "baseline_rounds": 1,
    "budget_rounds": 1,
    "fixed_warmup_s": 1.0,
    "fixed_window_s": 2.5,
    "saturation_warmup_s": 1.5,
    "saturation_window_s": 2.5,
    "baseline_warmup_s": 0.5,
    "baseline_window_s": 2.0,
    "fixed_drain_s": 15.0,
}
# Quick runs measure the baseline at fixed load only (the floor the CPU/token target is judged against).
BASELINE_WORKLOADS = {"full": ("fixed", "saturation"), "quick": ("fixed",)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openengine-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--one-token",
        action="store_true",
        help="measure 1-token requests/s per frontend worker instead (`bench --one-token --help`)",
    )
    p.add_argument(
        "--target",
        metavar="HOST:PORT",
        help="drive an existing deployment instead of starting one (`bench --target X --help`)",
    )
    p.add_argument(
        "--soak",
        type=float,
        metavar="MINUTES",
        help="soak a whole deployment per server instead: steady mixed load (streams, cancels, aborts, "
        "bad requests, disconnects), RSS and open fds of every process (`bench --soak 1 --help`)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one round each, short windows (a smoke run, ~2.5 min with every placement)",
    )
    p.add_argument(
        "--placement",
        default="pinned,quota,shared",
        help="comma list of frontend placements, each measured with the same workload and alternation: "
        "pinned (to --frontend-cpus before it starts), quota (a cgroup CPU quota of --quota-cpus, "
        "every core visible; needs root), shared (no constraint). Default: all three",
    )
    p.add_argument("--quota-cpus", type=float, default=1.0, help="the quota placement's CPU quota (default 1.0)")
    p.add_argument(
        "--budget-cpus",
        type=float,
        default=0.25,
        help="budgeted saturation: the frontend's cgroup CPU quota, small enough that it is the "
        "bottleneck while the rest has headroom (default 0.25; needs root)",
    )
    p.add_argument(
        "--budget-inflight",
        type=int,
        default=0,
        help="budgeted saturation: requests kept in flight (default 0: --inflight)",
    )
    p.add_argument(
        "--budget-connections", default="32", help="budgeted saturation: client connection counts (default 32)"
    )
    p.add_argument("--no-budget", action="store_true", help="skip the budgeted saturation")
    p.add_argument(
        "--output",
        default="bench-results",
        help="directory for bench.json, bench.png, report.md, logs/ (default bench-results/)",
    )
    p.add_argument(
        "--frontend-cpus",
        default="0",
        help="CPUs of the server under test (default 0); everything else runs on the remaining CPUs",
    )
    p.add_argument("--servers", default="grpcio,pygrpc-native", help="comma-separated, alternated in this order")
    p.add_argument("--connections", default="32,1", help="client connection counts (default 32,1)")
    p.add_argument("--rate", type=float, default=40.0, help="fixed load: requests/s, open-loop (default 40)")
    p.add_argument("--inflight", type=int, default=512, help="saturation: requests kept in flight (default 512)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=2.0, help="engine step (default 2 ms)")
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--max-queue", type=int, default=4096)
    p.add_argument(
        "--client-procs",
        type=int,
        default=0,
        help="load generator processes (default: one per non-frontend CPU, at most 4)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the bare-server baseline (pinned placement)")
    p.add_argument(
        "--client",
        choices=("grpc-aio", "h2"),
        default="grpc-aio",
        help="load generator client: grpc-aio (default) or h2, a minimal HTTP/2 client for this one call "
        "(experimental: several times less client CPU per token, see docs/benchmarks.md, "
        '"The frontend on grpcio vs pygrpc-native")',
    )
    p.add_argument(
        "--rerender",
        action="store_true",
        help="measure nothing: rebuild report.md, the chart and the summaries in <output>/bench.json "
        "from its rounds (and <output>/profiles/*.txt)",
    )
    p.add_argument(
        "--published",
        default=str(report.PUBLISHED_PATH),
        help="an earlier bench.json (default: the published run, docs/bench/bench.json): the report says for each "
        "placement whether native/grpcio CPU per token moved beyond the run-to-run spread; 'none' to skip",
    )
    p.add_argument(
        "--profile-s",
        type=float,
        default=0.0,
        help="after the rounds, profile each server's frontend with py-spy under fixed load and at "
        "saturation (first connection count) for this many seconds each: raw stacks and an SVG "
        "flame graph in <output>/profiles/ (default 0: off; not part of the measured rounds)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="components' log level (default info, as deployed)",
    )
    for key, value in FULL.items():
        p.add_argument(
            "--" + key.replace("_", "-"),
            type=(int if key.endswith("rounds") else float),
            default=None,
            help=f"default {value} (quick: {QUICK[key]})",
        )
    return p


def read_published(path: str) -> dict[str, Any] | None:
    """The earlier result --published names (None for 'none' or a path without a file: nothing to compare)."""
    if path == "none" or not Path(path).is_file():
        return None
    return report.read_json(path)


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it is below it (the repository root, as documented)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def rerender(out: Path) -> int:
    """Rebuilds summary, targets, profiles, report.md and the chart from <out>/bench.json (and profiles/*.txt)."""
    old = report.read_json(out / "bench.json")
    hashes: dict[str, Any] = {}
    profiles = old.get("profiles", {})
    for server, scenarios in profiles.items():
        for scenario, prof in scenarios.items():
            raw = out / "profiles" / f"frontend-{server}-{scenario}.txt"
            if raw.exists():
                profiles[server][scenario] = {
                    **report.profile_summary(raw.read_text(encoding="utf-8"), top=30),
                    "file": prof.get("file", ""),
                }
    for record in old["rounds"]:  # budgeted windows are judged again with the current thresholds
        if report.placement_of(record) == report.BUDGET and record.get("mode") == "stack":
            record["bottleneck"], record["frontend_limited"] = report.classify_budget_window(record)
    result = report.build_result(old["meta"], old["rounds"], hashes, old["meta"].get("connections", [32, 1]), profiles)
    result["identical"] = old["identical"]  # per-request hashes are not kept in the JSON
    result["published"] = old.get("published")  # the comparison made when it ran (the file may be gone or newer)
    result["targets"] = report.evaluate_targets(
        result["summary"], result["rounds"], result["identical"], old["meta"].get("connections", [32, 1])
    )
    report.write_json(result, out / "bench.json")
    report.write_chart(result, out / "bench.png")
    text = report.render(result)
    (out / "report.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv and "--soak" in argv:
        from .soak import main as soak_main

        return soak_main(argv)
    if argv and "--one-token" in argv:
        from .one_token import main as one_token_main

        return one_token_main(argv)
    if argv and any(a == "--target" or a.startswith("--target=") for a in argv):
        from .target import main as target_main

        return target_main(argv)
    args = build_parser().parse_args(argv)
    if args.rerender:
        return rerender(Path(args.output))
    settings = dict(QUICK if args.quick else FULL)
    for key in settings:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    try:
        return Bench(args, settings).run()
    except KeyboardInterrupt:
        print("openengine-bench: interrupted", file=sys.stderr)
        return 130


class Bench:
    def __init__(self, args: argparse.Namespace, settings: dict[str, Any]) -> None:
        from .stack import Placement, parse_placements, split_cpus

        self.args = args
        self.s = settings
        self.out = Path(args.output)
        self.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
        self.connections = [int(c) for c in args.connections.split(",") if c.strip()]
        self.frontend_cpus, self.other_cpus = split_cpus(args.frontend_cpus)
        self.client_procs = args.client_procs or max(1, min(4, len(self.other_cpus)))
        self.placements = parse_placements(args.placement, args.quota_cpus)
        self.budget = (
            None
            if args.no_budget or self.s["budget_rounds"] <= 0
            else Placement(report.BUDGET, pinned=False, quota_cpus=args.budget_cpus)
        )
        self.budget_connections = [int(c) for c in args.budget_connections.split(",") if c.strip()]
        self.budget_inflight = args.budget_inflight or args.inflight
        # read before the run: the output may be the published directory itself
        self.published = read_published(args.published)
        self.cgroups: dict[float, Any] = {}  # quota in CPUs -> QuotaCgroup
        self.rounds: list[dict[str, Any]] = []
        self.hashes: dict[str, dict[str, dict[str, str]]] = {}
        self.profiles: dict[str, dict[str, Any]] = {}
        self.stack: Stack  # both set when the run starts
        self.pool: LoadPool

    # ---------------------------------------------------------------- run

    def run(self) -> int:
        from .load import LoadPool
        from .stack import Stack, pin_tree

        started = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.frontend_cpus != self.other_cpus:
            pin_tree(os.getpid(), self.other_cpus)  # the orchestrator stays off the frontend's core too
        budget = (
            f", budgeted saturation at {self.budget.quota_cpus:g} CPU, {self.budget_inflight} in flight"
            if self.budget
            else ""
        )
        self.log(
            f"frontend CPUs {self.frontend_cpus}, other CPUs {self.other_cpus}, "
            f"{self.client_procs} load generator process(es); placements "
            f"{', '.join(p.name for p in self.placements)}"
            f"{budget}; "
            f"output in {self.out}/"
        )
        self.wake_up_cpu_us = wake_up_cpu_us(self.frontend_cpus)  # before anything of the stack runs
        self.log(f"a thread's sleep and wake-up costs {self.wake_up_cpu_us:.0f} µs of CPU on the frontend's CPU")
        self.pool = LoadPool(self.client_procs, self.other_cpus)
        self.stack = Stack(
            self.out,
            self.frontend_cpus,
            self.other_cpus,
            step_ms=self.args.step_ms,
            max_batch=self.args.max_batch,
            max_queue=self.args.max_queue,
            log_level=self.args.log_level,
        )
        try:
            self.make_cgroups()
            self.log("starting coordinator and node (MPI engine worker)")
            self.stack.start_cluster()
            pinned = any(p.pinned for p in self.placements)
            total_rounds = max(
                self.s["fixed_rounds"],
                self.s["saturation_rounds"],
                0 if self.args.no_baseline or not pinned else self.s["baseline_rounds"],
            )
            # Placements interleave round by round too, so drift of the machine hits every placement alike.
            for r in range(1, total_rounds + 1):
                for placement in self.placements:
                    for server in self.servers:
                        self.stack_round(placement, server, r)
                        if placement.pinned and not self.args.no_baseline and r <= self.s["baseline_rounds"]:
                            self.baseline_round(server, r)
            if self.budget:
                for r in range(1, self.s["budget_rounds"] + 1):
                    for server in self.servers:
                        self.stack_round(self.budget, server, r)
            if self.args.profile_s > 0:
                for server in self.servers:
                    self.profile(server)
        finally:
            self.stack.stop_all()
            self.pool.close()
            for cgroup in self.cgroups.values():
                with contextlib.suppress(OSError):
                    cgroup.close()
        result = report.build_result(
            self.meta(time.monotonic() - started),
            self.rounds,
            self.hashes,
            self.connections,
            self.profiles,
            self.published,
            shown_path(self.args.published),
        )
        json_path = report.write_json(result, self.out / "bench.json")
        chart_path = report.write_chart(result, self.out / "bench.png")
        text = report.render(result)
        (self.out / "report.md").write_text(text + "\n", encoding="utf-8")
        print(text)
        print(
            f"\nwrote {json_path}, {chart_path}, {self.out / 'report.md'} ({(time.monotonic() - started) / 60:.1f} min)"
        )
        return 0

    def make_cgroups(self) -> None:
        """One quota cgroup per quota in use (the frontends of every round enter it); needs root."""
        from .cgroups import CgroupUnavailable, QuotaCgroup

        for placement in [*self.placements, *([self.budget] if self.budget else [])]:
            quota = placement.quota_cpus
            if quota and quota not in self.cgroups:
                try:
                    self.cgroups[quota] = QuotaCgroup(quota, name=f"openengine-bench-{os.getpid()}-{quota:g}").create()
                except CgroupUnavailable as exc:
                    raise SystemExit(
                        f"openengine-bench: the {placement.name} placement needs a {quota:g}-CPU "
                        f"cgroup quota: {exc}; run as root, or leave it out (--placement pinned,shared "
                        f"--no-budget)"
                    ) from exc

    def stack_round(self, placement, server: str, r: int) -> None:
        if placement.name == report.BUDGET:
            plan = [("saturation", c) for c in self.budget_connections]
        else:
            plan = [("fixed", c) for c in self.connections if r <= self.s["fixed_rounds"]]
            plan += [("saturation", c) for c in self.connections if r <= self.s["saturation_rounds"]]
        if not plan:
            return
        cgroup = self.cgroups.get(placement.quota_cpus) if placement.quota_cpus else None
        self.log(f"round {r}: starting frontend on {server}, placement {placement.name} ({placement.describe()})")
        frontend = self.stack.start_frontend(
            server, pinned=placement.pinned, enter_cgroup=cgroup.enter if cgroup else None
        )
        try:
            for workload, c in plan:
                self.measure("stack", workload, c, server, r, frontend, placement, cgroup)
        finally:
            self.stack.stop_frontend()

    def baseline_round(self, server: str, r: int) -> None:
        self.log(f"round {r}: baseline (bare servicer) on {server}")
        bare = self.stack.start_baseline(server)
        try:
            for workload in BASELINE_WORKLOADS["quick" if self.args.quick else "full"]:
                for c in self.connections:
                    self.measure("baseline", workload, c, server, r, bare, self.pinned_placement())
        finally:
            self.stack.stop_baseline()

    @staticmethod
    def pinned_placement():
        from .stack import placement

        return placement("pinned")

    def profile(self, server: str) -> None:
        """py-spy on the frontend under load (raw stacks, then an SVG); these windows are not measured."""
        self.log(f"profiling the frontend on {server} with py-spy ({self.args.profile_s:g} s per workload)")
        frontend = self.stack.start_frontend(server)
        try:
            for workload in ("fixed", "saturation"):
                self.measure("profile", workload, self.connections[0], server, 0, frontend, self.pinned_placement())
        finally:
            self.stack.stop_frontend()

    def _py_spy(self, pid: int, seconds: float, fmt: str, path: Path) -> None:
        from .stack import pinned

        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        command = pinned(
            [exe, "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", "100", "-f", fmt, "-o", str(path)],
            self.other_cpus,
        )
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
        if done.returncode != 0:
            raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr.strip()[-500:]}")

    def _profile_window(self, server: str, scenario: str, pid: int, t0: float, t1: float) -> None:
        from .load import sleep_until

        directory = self.out / "profiles"
        directory.mkdir(parents=True, exist_ok=True)
        stem = f"frontend-{server}-{scenario}"
        half = (t1 - t0) / 2
        sleep_until(t0)
        self._py_spy(pid, half, "raw", directory / f"{stem}.txt")
        self._py_spy(pid, half, "flamegraph", directory / f"{stem}.svg")
        summary = report.profile_summary((directory / f"{stem}.txt").read_text(encoding="utf-8"), top=30)
        summary["file"] = f"profiles/{stem}.svg"
        self.profiles.setdefault(server, {})[scenario] = summary

    # ---------------------------------------------------------------- one measured window

    def measure(
        self, mode: str, workload: str, connections: int, server: str, r: int, target, placement, cgroup=None
    ) -> dict[str, Any]:
        from .load import CONNECT_MARGIN_S, SETTLE_S, make_jobs, merge_results, poisson_arrivals, sleep_until
        from .stack import CpuSampler, established_connections, thread_seconds, wake_ups

        scenario = report.scenario_name(workload, connections)
        warmup = self.s[f"{'baseline' if mode == 'baseline' else workload}_warmup_s"]
        window = self.s[f"{'baseline' if mode == 'baseline' else workload}_window_s"]
        if mode == "profile":
            window = 2 * self.args.profile_s + 2.0  # raw stacks, then the SVG, with slack for attaching
        start_at = time.monotonic() + CONNECT_MARGIN_S
        t0 = start_at + warmup
        t1 = t0 + window
        tag = f"{placement.name}-{mode}-{scenario}-r{r}"
        # No server in the ids or seeds: both servers get the same requests.
        common = dict(
            target=target.target,
            connections=connections,
            procs=self.pool.size,
            start_at=start_at,
            t0=t0,
            t1=t1,
            stop_at=t1,
            id_prefix=tag,
            key_base=zlib.crc32(tag.encode()) << 24,
            prompt_tokens=self.args.prompt_tokens,
            output_tokens=self.args.output_tokens,
            extra={"client": self.args.client},
        )
        if workload == "fixed":
            jobs = make_jobs(
                kind="fixed",
                drain_timeout_s=self.s["fixed_drain_s"],
                arrivals=poisson_arrivals(self.args.rate, t1 - start_at, tag),
                **common,
            )
        else:
            jobs = make_jobs(kind="saturation", drain_timeout_s=0.0, inflight=self.inflight(placement), **common)
        sampler = CpuSampler()
        sampler.set_group("frontend" if mode == "stack" else "bare server", [target.pid])
        coordinator, node = self.stack.coordinator, self.stack.node
        assert coordinator is not None and node is not None, "the cluster runs through every round"
        sampler.set_group("coordinator", [coordinator.pid])
        sampler.set_group("node", [node.pid])
        sampler.set_group("engine", [p for p in self.stack.node_tree() if p != node.pid])
        sampler.set_group("load generator", self.pool.pids[: len(jobs)])
        sampler.set_group("bench", [os.getpid()])
        self.pool.submit(jobs)
        if mode == "profile":
            self._profile_window(server, scenario, target.pid, t0 + 0.5, t1 - 0.5)
            self.pool.collect(len(jobs), timeout=self.s["fixed_drain_s"] + 60.0)
            time.sleep(SETTLE_S * 2)
            return {}
        sleep_until(t0)
        throttling: Callable[[], dict[str, float]] = cgroup.throttling if cgroup is not None else dict
        before, cores_before, threads_before = sampler.snapshot(), _core_times(), thread_seconds(target.pid)
        throttled_before, wake_ups_before = throttling(), wake_ups(target.pid)
        sleep_until(t1)
        after, cores_after, threads_after = sampler.snapshot(), _core_times(), thread_seconds(target.pid)
        throttled_after, wake_ups_after = throttling(), wake_ups(target.pid)
        observed = established_connections(target.port)
        results = self.pool.collect(len(jobs), timeout=self.s["fixed_drain_s"] + 60.0)
        if not target.alive():
            raise RuntimeError(f"{target.name} died during {tag}; see {target.log_path}")
        merged = merge_results(results)
        throttled = {k: throttled_after[k] - throttled_before.get(k, 0.0) for k in throttled_after}
        record = self.record(
            mode,
            workload,
            connections,
            server,
            r,
            window,
            merged,
            CpuSampler.delta(before, after),
            cores_before,
            cores_after,
            observed,
            placement,
            throttled,
        )
        # Threads that ended inside the window are missing from `after`: their CPU is in the process total only.
        record["frontend_threads_util"] = {
            name: (threads_after[name] - threads_before.get(name, 0.0)) / window for name in threads_after
        }
        messages = record["messages"]
        record["wake_ups_per_message"] = (wake_ups_after - wake_ups_before) / messages if messages else None
        self.rounds.append(record)
        if mode == "stack":
            self.hashes.setdefault(f"{placement.name}/{scenario}", {}).setdefault(server, {}).update(merged["hashes"])
        self.log(
            f"  {placement.name:7s} {mode:8s} {scenario:15s} {server:13s} r{r}: "
            f"{record['tokens_per_s']:8.0f} tok/s  {_f(record['cpu_us_per_token'])} µs/tok  "
            f"frontend {record['frontend_util']:.2f} core  other cores busy "
            f"{_f(record['other_core_busy'], '.2f')}  TTFT p99 {_f(record['ttft_p99_ms'])} ms  "
            f"client {_f(record['client_us_per_token'])} µs/tok  errors {record['errors']}  conns {observed}  "
            f"limited by: {record['bottleneck']}"
        )
        time.sleep(SETTLE_S * (2 if workload == "saturation" else 1))
        return record

    def inflight(self, placement) -> int:
        return self.budget_inflight if placement.name == report.BUDGET else self.args.inflight

    def record(
        self,
        mode,
        workload,
        connections,
        server,
        r,
        window,
        merged,
        cpu,
        cores_before,
        cores_after,
        observed,
        placement,
        throttled,
    ) -> dict[str, Any]:
        front_key = "frontend" if mode == "stack" else "bare server"
        front_cpu = cpu.pop(front_key)
        tokens = merged["window_tokens"]
        ttft = report.latency_stats(merged["ttft"])
        itl = report.latency_stats(merged["itl"])
        others = sum(v for k, v in cpu.items())
        cores = {c: _core_delta(cores_before, cores_after, c) for c in self.frontend_cpus + self.other_cpus}

        def core_sum(cpus, kind):
            return sum(cores[c][kind] for c in cpus) / window

        process_util = {front_key: front_cpu / window, **{k: v / window for k, v in cpu.items()}}
        all_cpus = sorted(set(self.frontend_cpus) | set(self.other_cpus))
        separate = self.frontend_cpus != self.other_cpus
        if separate and placement.pinned:
            # What else ran on the cores (another user's processes: the machine is shared), interrupt work
            # (mostly this benchmark's own loopback traffic) and time stolen by the hypervisor.
            process_util["foreign on frontend core"] = max(
                0.0, core_sum(self.frontend_cpus, "tasks") - front_cpu / window
            )
            process_util["foreign on other cores"] = max(0.0, core_sum(self.other_cpus, "tasks") - others / window)
        elif separate:
            # The frontend may run on every core: foreign load is what no measured process accounts for.
            process_util["foreign (all cores)"] = max(0.0, core_sum(all_cpus, "tasks") - (front_cpu + others) / window)
        if separate:
            process_util["irq+softirq (all cores)"] = core_sum(all_cpus, "irq")
            process_util["steal (all cores)"] = core_sum(all_cpus, "steal")
        machine_idle = core_sum(all_cpus, "idle")
        process_util["idle (all cores)"] = machine_idle

        def busy(cpus):
            return sum(cores[c]["tasks"] + cores[c]["irq"] + cores[c]["steal"] for c in cpus) / window / len(cpus)

        shared = self.frontend_cpus == self.other_cpus
        other_util = None if shared else others / window / len(self.other_cpus)
        other_core_busy = None if shared else busy(self.other_cpus)
        throttled_share = throttled["throttled_periods"] / throttled["periods"] if throttled.get("periods") else None
        if placement.pinned:
            frontend_util = front_cpu / window / len(self.frontend_cpus)
            frontend_core_busy = busy(self.frontend_cpus)
            limited_by = report.bottleneck(frontend_util, frontend_core_busy, other_core_busy, workload)
        else:
            frontend_util = front_cpu / window
            frontend_core_busy = None
            limited_by = report.limiter(
                workload, frontend_util, placement.quota_cpus, throttled_share, machine_idle, process_util.get("node")
            )
        errors = sum(merged["errors"].values())
        client_cpu = cpu.get("load generator")
        record = {
            "mode": mode,
            "placement": placement.name,
            "quota_cpus": placement.quota_cpus,
            "scenario": report.scenario_name(workload, connections),
            "workload": workload,
            "connections": connections,
            "server": server,
            "round": r,
            "window_s": window,
            "inflight": self.inflight(placement) if workload == "saturation" else None,
            "tokens": tokens,
            "messages": merged["window_messages"],
            "tokens_per_s": tokens / window,
            "tokens_per_message": tokens / merged["window_messages"] if merged["window_messages"] else None,
            "frontend_cpu_s": front_cpu,
            "cpu_us_per_token": (front_cpu / tokens * 1e6) if tokens else None,
            "client_us_per_token": (client_cpu / tokens * 1e6) if tokens and client_cpu is not None else None,
            "frontend_util": frontend_util,
            "other_util": other_util,
            "frontend_core_busy": frontend_core_busy,
            "other_core_busy": other_core_busy,
            "foreign_frontend_core": process_util.get("foreign on frontend core"),
            "machine_idle_cores": machine_idle,
            "throttled_share": throttled_share,
            "throttled_s": throttled.get("throttled_s"),
            "ttft_p50_ms": ttft["p50_ms"],
            "ttft_p99_ms": ttft["p99_ms"],
            "ttft_samples": ttft["n"],
            "itl_p50_ms": itl["p50_ms"],
            "itl_p99_ms": itl["p99_ms"],
            "itl_samples": itl["n"],
            "requests_started": merged["started"],
            "requests_completed": merged["completed"],
            "requests_cancelled_at_end": merged["cancelled_at_end"],
            "errors": errors,
            "error_kinds": merged["errors"],
            "process_cpu_s": {front_key: front_cpu, **cpu},
            "process_util": process_util,
            "core_seconds": {str(c): cores[c] for c in cores},
            "client_lag_max_ms": merged["lag_max_s"] * 1e3,
            "connections_observed": observed,
            "bottleneck": limited_by,
        }
        if placement.name == report.BUDGET:
            record["bottleneck"], record["frontend_limited"] = report.classify_budget_window(record)
        return record

    # ---------------------------------------------------------------- meta

    def meta(self, duration_s: float) -> dict[str, Any]:
        def version(dist: str) -> str | None:
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                return None

        return {
            "quick": self.args.quick,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "duration_s": round(duration_s, 1),
            "nproc": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "grpcio": version("grpcio"),
            "pygrpc_native": version("pygrpc-native"),
            "protobuf": version("protobuf"),
            "event_loop": event_loop_name(),
            "wake_up_cpu_us": round(self.wake_up_cpu_us, 1),
            "frontend_cpus": self.frontend_cpus,
            "other_cpus": self.other_cpus,
            "client_procs": self.client_procs,
            "servers": self.servers,
            "connections": self.connections,
            "rate": self.args.rate,
            "placements": [p.name for p in self.placements],
            "quota_cpus": self.args.quota_cpus,
            "client": self.args.client,
            "budget_cpus": self.budget.quota_cpus if self.budget else None,
            "budget_connections": self.budget_connections if self.budget else [],
            "budget_inflight": self.budget_inflight if self.budget else None,
            "inflight": self.args.inflight,
            "prompt_tokens": self.args.prompt_tokens,
            "output_tokens": self.args.output_tokens,
            "step_ms": self.args.step_ms,
            "max_batch": self.args.max_batch,
            "max_queue": self.args.max_queue,
            "log_level": self.args.log_level,
            "loadavg_at_end": list(os.getloadavg()),
            **self.s,
        }

    @staticmethod
    def log(message: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _f(value: float | None, spec: str = "6.1f") -> str:
    return "   –" if value is None else format(value, spec)


def _core_times() -> dict[int, dict[str, float]]:
    """Per CPU, seconds since boot from /proc/stat: tasks (user+nice+system), irq (irq+softirq), steal, idle."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *values = line.split()
                v = [int(x) for x in values] + [0] * 10
                out[int(name[3:])] = {
                    "tasks": (v[0] + v[1] + v[2]) / ticks,
                    "irq": (v[5] + v[6]) / ticks,
                    "steal": v[7] / ticks,
                    "idle": (v[3] + v[4]) / ticks,
                }
    return out


def _core_delta(before, after, cpu: int) -> dict[str, float]:
    if cpu not in before or cpu not in after:
        return {"tasks": 0.0, "irq": 0.0, "steal": 0.0, "idle": 0.0}
    return {k: after[cpu][k] - before[cpu][k] for k in after[cpu]}


# A thread that sleeps 2 ms WAKE_UPS times, in a child process: the CPU time it used per sleep is what one wake-up
# costs on this machine (a few µs on bare metal; tens to hundreds on some VMs, where the fixed load's CPU per
# token then follows the number of wake-ups of the frontend's threads more than their work).
WAKE_UPS = 500
_WAKE_UP_PROBE = f"""
import resource, time
before = resource.getrusage(resource.RUSAGE_SELF)
for _ in range({WAKE_UPS}):
    time.sleep(0.002)
after = resource.getrusage(resource.RUSAGE_SELF)
print((after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / {WAKE_UPS} * 1e6)
"""


def wake_up_cpu_us(cpus: list[int]) -> float:
    """CPU time (µs) of one sleep and wake-up of a thread on `cpus` (see _WAKE_UP_PROBE)."""
    from .stack import pinned

    command = pinned([sys.executable, "-c", _WAKE_UP_PROBE], cpus)
    return float(subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
