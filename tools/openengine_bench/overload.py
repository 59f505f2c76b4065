"""Overload: what a new request and the health probe see while long streams saturate the stack.

    python -m openengine_bench.overload --out overload-out                  # the TTFT scenario, both servers
    python -m openengine_bench.overload --mode health --out overload-health  # 2x that load, liveness latency
    python -m openengine_bench.overload --mode capacity --out overload-cap   # streams one worker keeps up with

A real deployment on loopback (coordinator, `--nodes` nodes at `--step-ms`, one frontend worker per
server). A load process keeps `--streams` Generate streams of `--tokens` tokens open, one connection each,
reading as fast as it can (a stream that ends is started again). Meanwhile the probe loop alternates:

- a new `--probe-tokens`-token request on a fresh connection: connect time, then TTFT (call to first
  token) and the whole request;
- a grpc.health.v1 Check of `liveness` on a fresh connection, as the kubelet's gRPC probe does it
  (connect + Check, timeout `--probe-timeout-s`).

A sampler records every `--sample-s`: the nodes' and the frontend's RSS, the frontend's event-loop lag
(`openengine_frontend_event_loop_lag_seconds`), the nodes' lane backlog and shed counts. Writes
`overload.json` and `overload.png` into `--out`, and prints the summary.

`--mode capacity` checks the default of OPENENGINE_MAX_IN_FLIGHT (docs/robustness.md, "Admission:
OPENENGINE_MAX_IN_FLIGHT"): at the
64 ms step of a large-batch engine, 256..768 streams; a run keeps up when the tokens the frontend delivered in
the window (`openengine_frontend_generated_tokens_total`) are at least 90 % of what the streams were offered
(streams x 1000 / step_ms tokens/s). The capacity is the most streams that kept up with no failed probe.

With `--hops` the frontend and nodes log at debug level and each probe's first token is timed per hop
(call, validation, reservation, Submit, engine step, the node's lane, the transport, the stream, the write)
from their `first event on lane` and `first token` lines (CLOCK_MONOTONIC, one machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from openengine_serve.api.openengine.v1 import generation_pb2, openengine_pb2_grpc, server_pb2
from openengine_serve.client import check_health, is_serving
from openengine_serve.common.lifecycle import new_event_loop
from openengine_serve.common.net import free_port

from . import report
from .children import unwind_on_sigterm
from .load import MODEL, channel_options
from .stack import HOST, Process

MODES = {  # mode -> default streams (the scenario is 64 streams of 8000 tokens at the 2 ms step)
    "ttft": "64",
    "health": "128",  # twice the load that saturates one frontend worker at the 2 ms step
    "capacity": "256,384,512,640,768",  # around the default OPENENGINE_MAX_IN_FLIGHT (512)
}
MODE_STEP_MS = {"ttft": 2.0, "health": 2.0, "capacity": 64.0}  # capacity: the large-batch engine's pace
MODE_DURATION_S = {"ttft": 30.0, "health": 30.0, "capacity": 20.0}
KEEPS_UP = 0.9  # delivered / offered tokens of a run that keeps up
GENERATED_TOKENS = "openengine_frontend_generated_tokens_total"
NODE_METRICS = ("openengine_node_lane_backlog_steps", "openengine_node_lane_shed_requests_total")
FRONTEND_METRICS = ("openengine_frontend_event_loop_lag_seconds", "openengine_frontend_in_flight_requests")


# ---------------------------------------------------------------- probes (sync, fresh connection each)


def short_request(tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=f"probe-{uuid.uuid4()}",
        model=MODEL,
        prompt="The quick brown fox",
        stopping=generation_pb2.StoppingOptions(max_tokens=tokens, ignore_eos=True),
    )


def ttft_sample(target: str, tokens: int = 5, timeout: float = 30.0) -> dict[str, Any]:
    """A new request on a fresh connection: seconds to connect, to the first token, to the end (None: failed);
    its request id, and the monotonic time of the call (for the per-hop timing of the components' debug logs)."""
    started = time.monotonic()
    request = short_request(tokens)
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return {"connect_s": None, "ttft_s": None, "total_s": None, "request_id": request.request_id}
        connected = time.monotonic()
        first = None
        try:
            for response in openengine_pb2_grpc.InferenceStub(channel).Generate(request, timeout=timeout):
                if first is None and response.WhichOneof("event") == "token":
                    first = time.monotonic()
        except grpc.RpcError:
            return {"connect_s": connected - started, "ttft_s": None, "total_s": None, "request_id": request.request_id}
        done = time.monotonic()
    return {
        "connect_s": connected - started,
        "ttft_s": None if first is None else first - connected,
        "total_s": done - connected,
        "request_id": request.request_id,
        "called_at": connected,
        "first_at": first,
    }


def liveness_sample(target: str, timeout: float) -> float | None:
    """The kubelet's gRPC probe: a fresh connection, Check(service="liveness"); seconds, None when it failed."""
    started = time.monotonic()
    try:
        ok = check_health(target, "liveness", timeout) == 1  # SERVING
    except grpc.RpcError:
        ok = False
    return time.monotonic() - started if ok else None


# ---------------------------------------------------------------- the load (its own process)


def _load_main(target: str, streams: int, tokens: int, stop, results) -> None:
    asyncio.set_event_loop(new_event_loop())
    results.put(asyncio.get_event_loop().run_until_complete(_load(target, streams, tokens, stop)))


async def _load(target: str, streams: int, tokens: int, stop) -> dict[str, int]:
    counts = {"tokens": 0, "messages": 0, "completed": 0, "errors": 0}

    async def one(s: int) -> None:
        async with grpc.aio.insecure_channel(target, options=channel_options()) as channel:
            stub = openengine_pb2_grpc.InferenceStub(channel)
            while True:
                request = short_request(tokens)
                request.request_id = f"load-{s}-{uuid.uuid4().hex[:8]}"
                try:
                    async for response in stub.Generate(request, timeout=3600):
                        if response.WhichOneof("event") == "token":
                            counts["messages"] += 1
                            counts["tokens"] += len(response.token.tokens)
                    counts["completed"] += 1
                except grpc.aio.AioRpcError:
                    counts["errors"] += 1
                    await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(one(s)) for s in range(streams)]
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return counts


class Load:
    """`streams` long reading streams from a separate process (the probes' latency is not the loader's)."""

    def __init__(self, target: str, streams: int, tokens: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop_event = context.Event()
        self.results = context.Queue()
        self.proc = context.Process(
            target=_load_main, args=(target, streams, tokens, self.stop_event, self.results), daemon=True
        )

    def __enter__(self) -> Load:
        self.proc.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> dict[str, int]:
        if not self.proc.is_alive():
            return {}
        self.stop_event.set()
        try:
            counts = self.results.get(timeout=30)
        except Exception:  # noqa: BLE001 - the loader died: its counts are lost, the run's figures are not
            counts = {}
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        return counts


# ---------------------------------------------------------------- sampling


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return None


def scrape_values(port: int, names: Sequence[str]) -> dict[str, float]:
    """Each named metric's value (summed over its label sets) from a /metrics endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5).read().decode()
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


class Sampler(threading.Thread):
    """Every `interval_s`: RSS of each process in `pids` (name -> pid), and the metrics of `metric_ports`."""

    def __init__(
        self, pids: dict[str, int], metric_ports: dict[str, tuple[int, Sequence[str]]], interval_s: float
    ) -> None:
        super().__init__(daemon=True)
        self.pids, self.metric_ports, self.interval_s = pids, metric_ports, interval_s
        self.t0 = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            sample: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 3)}
            for name, pid in self.pids.items():
                sample[f"rss_mb.{name}"] = rss_mb(pid)
            for name, (port, metrics) in self.metric_ports.items():
                with contextlib.suppress(OSError):
                    for metric, value in scrape_values(port, metrics).items():
                        sample[f"{metric}.{name}"] = value
            self.samples.append(sample)
            self.done.wait(self.interval_s)

    def stop(self) -> list[dict[str, Any]]:
        self.done.set()
        self.join(10)
        return self.samples


def series(samples: Sequence[dict[str, Any]], prefix: str) -> dict[str, list[tuple[float, float]]]:
    """name -> [(t, value)] for every sample key starting with `prefix.`."""
    out: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        for key, value in sample.items():
            if key.startswith(prefix + ".") and value is not None:
                out.setdefault(key[len(prefix) + 1 :], []).append((sample["t"], value))
    return out


def growth_mb_per_s(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of RSS over time (MB/s)."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return None if var == 0 else sum((t - mean_t) * (v - mean_v) for t, v in points) / var


# ---------------------------------------------------------------- per-hop timing (components at --log-level debug)

# (hop, from, to): times of the probe's first token, from the client's call to the client's receipt. "f." are
# the frontend's "first token" fields, "n." the node's "first event on lane" fields, "c." the client's.
HOPS = (
    ("call -> validated", "c.called_at", "f.opened_at"),
    ("reserve", "f.opened_at", "f.reserved_at"),
    ("submit -> node", "f.reserved_at", "n.submitted_at"),
    ("engine admission + step", "n.submitted_at", "n.step_at"),
    ("waiting in the node's lane", "n.step_at", "n.built_at"),
    ("gRPC send (node)", "n.built_at", "n.taken_at"),
    ("transport + lane reader", "n.taken_at", "f.first_event_at"),
    ("inbox -> stream", "f.first_event_at", "f.taken_at"),
    ("detokenize + write", "f.taken_at", "f.written_at"),
    ("to the client", "f.written_at", "c.first_at"),
)


def log_lines(path: Path, event: str, numeric: tuple[str, ...] = ()) -> Iterator[tuple[str, dict[str, float]]]:
    """(request id, its `*_at` fields and the `numeric` ones) of each key=value log line of `event`."""
    marker = f"event={event}" if " " not in event else f'event="{event}"'
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            if marker not in line:
                continue
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            yield (
                fields.get("request_id", ""),
                {k: float(v) for k, v in fields.items() if k.endswith("_at") or k in numeric},
            )


def log_fields(path: Path, event: str, wanted: set[str]) -> dict[str, dict[str, float]]:
    """request id -> its `*_at` fields, from the key=value log lines of `event` about the wanted requests."""
    return {request_id: fields for request_id, fields in log_lines(path, event) if request_id in wanted}


def hop_timings(log_dir: Path, probes: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per hop of the probes' first token: p50/p99/max (ms) over the probes all three parties timed."""
    wanted = {p["request_id"] for p in probes if p.get("first_at")}
    frontend: dict[str, dict[str, float]] = {}
    node: dict[str, dict[str, float]] = {}
    for path in sorted(log_dir.glob("*.log")):
        if path.name.startswith("frontend"):
            frontend |= log_fields(path, "first token", wanted)
        elif path.name.startswith("node"):
            node |= log_fields(path, "first event on lane", wanted)
    per_hop: dict[str, list[float]] = {hop: [] for hop, _, _ in HOPS}
    for probe in probes:
        request_id = probe["request_id"]
        if request_id not in frontend or request_id not in node:
            continue
        times = {f"c.{k}": v for k, v in probe.items() if k.endswith("_at") and v is not None}
        times |= {f"f.{k}": v for k, v in frontend[request_id].items()}
        times |= {f"n.{k}": v for k, v in node[request_id].items()}
        for hop, start, end in HOPS:
            if start in times and end in times:
                per_hop[hop].append(times[end] - times[start])
    return {hop: latency_summary(values) for hop, values in per_hop.items()}


def print_hops(hops: dict[str, dict[str, Any]]) -> None:
    print(
        "  first-token hops (ms, p50 / p99 / max): "
        + "; ".join(f"{hop} {v['p50_ms']} / {v['p99_ms']} / {v['max_ms']}" for hop, v in hops.items() if v["n"]),
        flush=True,
    )


# ---------------------------------------------------------------- one measured window


def measure_window(
    target: str,
    *,
    duration_s: float,
    probe_tokens: int = 5,
    probe_timeout_s: float = 5.0,
    probe_interval_s: float = 0.1,
    liveness: bool = True,
    deadline_s: float | None = None,
    min_samples: int = 0,
) -> dict[str, list]:
    """Alternating TTFT and liveness probes for `duration_s` (sequential: one probe at a time), and on until
    `min_samples` TTFT probes were taken (at most 4 × `duration_s` in all: a loaded machine's probes are slow)."""
    out: dict[str, list] = {"ttft": [], "liveness": [], "t_ttft": [], "t_liveness": []}
    t0 = time.monotonic()
    end, last = t0 + duration_s, t0 + 4 * duration_s
    while time.monotonic() < end or (len(out["ttft"]) < min_samples and time.monotonic() < last):
        sample = ttft_sample(target, probe_tokens, timeout=deadline_s or 30.0)
        out["ttft"].append(sample)
        out["t_ttft"].append(time.monotonic() - t0)
        if liveness:
            out["liveness"].append(liveness_sample(target, probe_timeout_s))
            out["t_liveness"].append(time.monotonic() - t0)
        time.sleep(probe_interval_s)
    return out


def latency_summary(values: Sequence[float | None]) -> dict[str, Any]:
    ok = [v for v in values if v is not None]

    def pct(q: float) -> float | None:
        value = report.percentile(ok, q)
        return None if value is None else round(value * 1000, 2)

    return {
        "n": len(values),
        "failed": len(values) - len(ok),
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "max_ms": None if not ok else round(max(ok) * 1000, 2),
    }


def running_requests(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return openengine_pb2_grpc.ControlStub(channel).GetLoad(server_pb2.GetLoadRequest(), timeout=5).running_requests


def wait_running(target: str, at_least: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    running = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            running = running_requests(target)
            if running >= at_least:
                break
        time.sleep(0.2)
    return running


# ---------------------------------------------------------------- the deployment


class Deployment:
    def __init__(self, out: Path, nodes: int, step_ms: float, max_batch: int, log_level: str = "warning") -> None:
        self.out, self.log_dir = out, out / "logs"
        self.log_level = log_level
        self.cpus = sorted(os.sched_getaffinity(0))
        self.coordinator = self._start("coordinator", "coordinator", "--heartbeat-s", "0.5")
        self.coordinator.wait_ready(60, lambda: is_serving(self.coordinator.target))
        self.nodes: list[tuple[Process, int]] = []
        for rank in range(nodes):
            metrics_port = free_port(HOST)
            node = self._start(
                f"node{rank}",
                "node",
                "--coordinator-address",
                self.coordinator.target,
                "--node-rank",
                str(rank),
                "--engine",
                "simulated",
                "--step-ms",
                str(step_ms),
                "--max-batch",
                str(max_batch),
                "--max-queue",
                str(4 * max_batch),
                metrics_port=metrics_port,
                log_level=log_level,
            )
            self.nodes.append((node, metrics_port))
        for node, _ in self.nodes:
            node.wait_ready(180, lambda node=node: is_serving(node.target))
        self.frontend: Process | None = None
        self.frontend_metrics = 0

    def _start(self, name: str, *args: str, metrics_port: int = 0, log_level: str = "warning") -> Process:
        port = free_port(HOST)
        return Process(
            name,
            [
                sys.executable,
                "-m",
                "openengine_serve",
                *args,
                "--host",
                HOST,
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--log-level",
                log_level,
            ],
            self.cpus,
            self.log_dir / f"{name}.log",
            port,
        ).start()

    def start_frontend(self, server: str, *extra: str) -> Process:
        self.frontend_metrics = free_port(HOST)
        self.frontend = self._start(
            f"frontend-{server}",
            "frontend",
            "--coordinator-address",
            self.coordinator.target,
            "--grpc-server",
            server,
            "--workers",
            "1",
            "--heartbeat-s",
            "0.5",
            "--drain-timeout-s",
            "2",
            *extra,
            metrics_port=self.frontend_metrics,
            log_level=self.log_level,
        )
        self.frontend.wait_ready(90, lambda: is_serving(self.frontend.target))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ttft_sample(self.frontend.target)["ttft_s"] is None:
            time.sleep(0.5)
        return self.frontend

    def stop_frontend(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
            self.frontend = None

    def close(self) -> None:
        self.stop_frontend()
        for node, _ in self.nodes:
            node.stop()
        self.coordinator.stop()


# ---------------------------------------------------------------- a run


def run_one(deployment: Deployment, server: str, streams: int, args: argparse.Namespace) -> dict[str, Any]:
    frontend = deployment.start_frontend(server, "--max-in-flight", str(max(streams * 2, 1024)))
    target = frontend.target
    try:
        idle = measure_window(
            target,
            duration_s=args.idle_s,
            probe_tokens=args.probe_tokens,
            probe_timeout_s=args.probe_timeout_s,
            probe_interval_s=args.probe_interval_s,
        )
        pids = {node.name: node.pid for node, _ in deployment.nodes} | {"frontend": frontend.pid}
        ports: dict[str, tuple[int, Sequence[str]]] = {
            node.name: (port, NODE_METRICS) for node, port in deployment.nodes
        }
        ports["frontend"] = (deployment.frontend_metrics, FRONTEND_METRICS)
        sampler = Sampler(pids, ports, args.sample_s)
        sampler.start()
        started = time.monotonic()
        with Load(target, streams, args.tokens) as load:
            running = wait_running(target, streams, 60)
            time.sleep(args.warmup_s)
            loaded_at = time.monotonic() - started
            generated_before = scrape_values(deployment.frontend_metrics, (GENERATED_TOKENS,))[GENERATED_TOKENS]
            window = measure_window(
                target,
                duration_s=args.duration_s,
                probe_tokens=args.probe_tokens,
                probe_timeout_s=args.probe_timeout_s,
                probe_interval_s=args.probe_interval_s,
            )
            delivered = (
                scrape_values(deployment.frontend_metrics, (GENERATED_TOKENS,))[GENERATED_TOKENS] - generated_before
            ) / (time.monotonic() - started - loaded_at)
            load_counts = load.stop()
        samples = sampler.stop()
    finally:
        deployment.stop_frontend()
    rss = series(samples, "rss_mb")
    loaded_rss = {name: [(t, v) for t, v in points if t >= loaded_at] for name, points in rss.items()}
    lag = [v for _, v in series(samples, "openengine_frontend_event_loop_lag_seconds").get("frontend", [])]
    backlog = series(samples, "openengine_node_lane_backlog_steps")
    shed = series(samples, "openengine_node_lane_shed_requests_total")
    ttft = [s["ttft_s"] for s in window["ttft"]]
    result = {
        "server": server,
        "streams": streams,
        "running_at_start": running,
        "loaded_at_s": round(loaded_at, 2),
        "offered_tokens_per_s": round(streams * 1000 / args.step_ms),
        "delivered_tokens_per_s": round(delivered),
        "keeps_up": running >= streams and delivered >= KEEPS_UP * streams * 1000 / args.step_ms,
        "idle": {
            "ttft": latency_summary([s["ttft_s"] for s in idle["ttft"]]),
            "liveness": latency_summary(idle["liveness"]),
        },
        "ttft": latency_summary(ttft),
        "connect": latency_summary([s["connect_s"] for s in window["ttft"]]),
        "liveness": latency_summary(window["liveness"]),
        "event_loop_lag_max_ms": None if not lag else round(max(lag) * 1000, 1),
        "lane_backlog_max_steps": max((v for points in backlog.values() for _, v in points), default=None),
        "lane_shed_requests": sum(points[-1][1] for points in shed.values() if points),
        "node_rss_mb": {
            name: {
                "loaded_start": points[0][1] if points else None,
                "end": points[-1][1] if points else None,
                "max": max((v for _, v in points), default=None),
                "growth_mb_per_s": growth_mb_per_s(points),
            }
            for name, points in loaded_rss.items()
        },
        "load": load_counts
        | {"tokens_per_s": round(load_counts.get("tokens", 0) / max(time.monotonic() - started, 1e-9))}
        if load_counts
        else {},
        "samples": samples,
        "probes": {
            "t_ttft": window["t_ttft"],
            "ttft": ttft,
            "t_liveness": window["t_liveness"],
            "liveness": window["liveness"],
        },
    }
    if args.hops:
        result["hops"] = hop_timings(deployment.log_dir, window["ttft"])
    return result


def print_run(r: dict[str, Any]) -> None:
    nodes = ", ".join(
        f"{name} {v['loaded_start']:.0f}->{v['end']:.0f} MB ({(v['growth_mb_per_s'] or 0):+.2f} MB/s)"
        for name, v in r["node_rss_mb"].items()
        if name.startswith("node") and v["end"] is not None
    )
    print(
        f"[{r['server']}, {r['streams']} streams] TTFT p50 {r['ttft']['p50_ms']} ms p99 {r['ttft']['p99_ms']} ms "
        f"max {r['ttft']['max_ms']} ms (n={r['ttft']['n']}, failed {r['ttft']['failed']}; idle p99 "
        f"{r['idle']['ttft']['p99_ms']} ms) | liveness p50 {r['liveness']['p50_ms']} ms p99 "
        f"{r['liveness']['p99_ms']} ms (failed {r['liveness']['failed']}) | loop lag max "
        f"{r['event_loop_lag_max_ms']} ms | lane backlog max {r['lane_backlog_max_steps']} steps, shed "
        f"{r['lane_shed_requests']} | node RSS {nodes} | load {r['load'].get('tokens_per_s')} tokens/s, "
        f"{r['load'].get('errors')} errors | delivered {r['delivered_tokens_per_s']} of "
        f"{r['offered_tokens_per_s']} tokens/s offered (keeps up: {r['keeps_up']})",
        flush=True,
    )


def capacity(runs: Sequence[dict[str, Any]]) -> dict[str, int | None]:
    """Per server: the most streams the worker kept up with (delivered >= KEEPS_UP of the offered tokens) while
    no TTFT probe failed."""
    out: dict[str, int | None] = {}
    for server in report.SERVERS:
        ok = [r["streams"] for r in runs if r["server"] == server and r["keeps_up"] and not r["ttft"]["failed"]]
        out[server] = max(ok, default=None)
    return out


# ---------------------------------------------------------------- chart


def write_chart(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {report.GRPCIO: "#4C72B0", report.NATIVE: "#DD8452"}
    runs = result["runs"]
    sweep = len({r["streams"] for r in runs}) > 1
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (ax_ttft, ax_live), (ax_rss, ax_lag) = axes
    for r in runs:
        color = colors.get(r["server"], "gray")
        label = f"{r['server']}, {r['streams']} streams"
        alpha = 0.35 + 0.65 * (r["streams"] / max(x["streams"] for x in runs)) if sweep else 1.0
        probes = r["probes"]
        pts = [(t, v * 1000) for t, v in zip(probes["t_ttft"], probes["ttft"]) if v is not None]
        if not sweep:
            ax_ttft.plot([t for t, _ in pts], [v for _, v in pts], ".", color=color, label=label, ms=4)
            live = [(t, v * 1000) for t, v in zip(probes["t_liveness"], probes["liveness"]) if v is not None]
            ax_live.plot([t for t, _ in live], [v for _, v in live], ".", color=color, label=label, ms=4)
        for name, points in series(r["samples"], "rss_mb").items():
            if name.startswith("node"):
                ax_rss.plot(
                    [t for t, _ in points],
                    [v for _, v in points],
                    color=color,
                    alpha=alpha,
                    label=f"{label}: {name}",
                    lw=1,
                )
        lag = series(r["samples"], "openengine_frontend_event_loop_lag_seconds").get("frontend", [])
        ax_lag.plot([t for t, _ in lag], [v * 1000 for _, v in lag], color=color, alpha=alpha, label=label, lw=1)
    if sweep:
        for server in report.SERVERS:
            mine = sorted((r for r in runs if r["server"] == server), key=lambda r: r["streams"])
            for ax, key in ((ax_ttft, "ttft"), (ax_live, "liveness")):
                ax.plot(
                    [r["streams"] for r in mine],
                    [r[key]["p99_ms"] for r in mine],
                    "o-",
                    color=colors[server],
                    label=f"{server} p99",
                )
                ax.plot(
                    [r["streams"] for r in mine],
                    [r[key]["p50_ms"] for r in mine],
                    "o--",
                    color=colors[server],
                    alpha=0.5,
                    label=f"{server} p50",
                )
                ax.set_xlabel("long streams open on the worker")
    else:
        ax_ttft.axhline(100, color="red", lw=0.8, ls=":", label="target p99 100 ms")
        for ax in (ax_ttft, ax_live):
            ax.set_xlabel("seconds into the loaded window")
    ax_ttft.set_yscale("log")  # seconds-long outliers beside tens of milliseconds
    ax_ttft.set_title(
        f"new {result['meta']['probe_tokens']}-token request on a fresh connection: TTFT (ms)", fontsize=10
    )
    ax_live.set_title("liveness Check on a fresh connection (kubelet-style), ms", fontsize=10)
    ax_rss.set_title("node RSS (MB) over time (load starts after the idle probes)", fontsize=10)
    ax_lag.set_title("frontend event-loop lag (ms), sampled", fontsize=10)
    for ax in (ax_rss, ax_lag):
        ax.set_xlabel("seconds since the sampler started")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    meta = result["meta"]
    fig.suptitle(
        f"overload ({meta['mode']}): {meta['nodes']} nodes at {meta['step_ms']:g} ms/step, streams of "
        f"{meta['tokens']} tokens, one reading connection each",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m openengine_bench.overload", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode",
        choices=sorted(MODES),
        default="ttft",
        help="presets for --streams: ttft 64, health 128 (2x saturation), capacity a sweep",
    )
    parser.add_argument("--servers", default=",".join(report.SERVERS))
    parser.add_argument("--streams", help="comma-separated stream counts (default: from --mode)")
    parser.add_argument("--tokens", type=int, default=8000, help="tokens per long stream")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--step-ms", type=float, help="engine step (default: 2 ms; capacity 64 ms)")
    parser.add_argument("--max-batch", type=int, default=512, help="node max_batch (room for every stream)")
    parser.add_argument("--duration-s", type=float, help="loaded window per run (default 30 s; capacity 20 s)")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="after every stream runs, before probing")
    parser.add_argument("--idle-s", type=float, default=3.0, help="probes before the load starts")
    parser.add_argument("--probe-tokens", type=int, default=5)
    parser.add_argument("--probe-interval-s", type=float, default=0.1)
    parser.add_argument("--probe-timeout-s", type=float, default=5.0)
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument(
        "--hops",
        action="store_true",
        help="run the frontend and nodes at --log-level debug and time each hop of the probes' "
        "first token from their log lines (costs a few debug lines per request)",
    )
    parser.add_argument("--out", type=Path, default=Path("overload-out"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.step_ms = MODE_STEP_MS[args.mode] if args.step_ms is None else args.step_ms
    args.duration_s = MODE_DURATION_S[args.mode] if args.duration_s is None else args.duration_s
    try:
        streams = [int(s) for s in (args.streams or MODES[args.mode]).split(",")]
    except ValueError:
        raise SystemExit(f"--streams must be comma-separated integers, got {args.streams!r}") from None
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in servers if s not in report.SERVERS]
    if unknown:
        raise SystemExit(f"--servers: unknown {unknown}; choose from {list(report.SERVERS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "mode": args.mode,
        "nodes": args.nodes,
        "step_ms": args.step_ms,
        "tokens": args.tokens,
        "max_batch": args.max_batch,
        "duration_s": args.duration_s,
        "probe_tokens": args.probe_tokens,
        "cpus": len(os.sched_getaffinity(0)),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    unwind_on_sigterm()
    deployment = Deployment(
        args.out, args.nodes, args.step_ms, args.max_batch, log_level="debug" if args.hops else "warning"
    )
    runs = []
    try:
        for count in streams:
            for server in servers:  # alternate servers at each stream count: drift hits both alike
                runs.append(run_one(deployment, server, count, args))
                print_run(runs[-1])
                if args.hops:
                    print_hops(runs[-1]["hops"])
    finally:
        deployment.close()
    result = {"meta": meta, "runs": runs}
    if args.mode == "capacity":
        result["capacity_streams"] = capacity(runs)
        print(
            f"most streams one worker kept up with at the {args.step_ms:g} ms step (delivered >= "
            f"{KEEPS_UP:.0%} of offered): {result['capacity_streams']}"
        )
    (args.out / "overload.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    write_chart(result, args.out / "overload.png")
    print(f"wrote {args.out / 'overload.json'} and {args.out / 'overload.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
