"""`openengine-bench --target HOST:PORT`: the harness's workload against a deployment that already runs.

Nothing is started but the load generator: the same requests (32 prompt token ids -> 128 output tokens,
`ignore_eos`, seeded), at a fixed open-loop rate over 32 and 1 connections, optionally saturation (N in
flight). Reported per window, like the tools users point at endpoints: tokens/s, TTFT and ITL percentiles,
errors; and, when the frontend's processes are on this machine (`--frontend-pids`, each with everything
below it, e.g. the workers of a supervisor), their CPU per token from /proc. The load generator's own CPU per
token is reported too: it is the first thing to check when figures differ from the harness's.

Results: <output>/target.json, <output>/target.md (also printed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from openengine_serve.client_args import add_credential_arguments, credentials

from . import report

SCENARIO_COLUMNS = (
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "cpu_us_per_token",
    "frontend_util",
    "tokens_per_message",
    "client_us_per_token",
    "errors",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openengine-bench --target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="the public frontend to drive")
    p.add_argument(
        "--frontend-pids",
        default="",
        help="comma-separated pids of the frontend's processes on this machine (children included): "
        "their CPU per token is reported",
    )
    add_credential_arguments(p)  # the same TLS / API key flags as the other client commands
    p.add_argument("--model", default="", help="model name in the requests (default: the harness's)")
    p.add_argument("--connections", default="32,1", help="client connection counts (default 32,1)")
    p.add_argument("--rate", type=float, default=40.0, help="fixed load: requests/s, open-loop (default 40)")
    p.add_argument(
        "--saturation",
        type=int,
        default=0,
        metavar="N",
        help="also measure saturation with N requests in flight (default 0: off)",
    )
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="windows per scenario (default 3)")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--drain-s", type=float, default=30.0, help="fixed load: wait this long for open requests")
    p.add_argument("--client-procs", type=int, default=1, help="load generator processes (default 1)")
    p.add_argument("--client-cpus", default="", help="pin the load generator to these CPUs (e.g. '1')")
    p.add_argument(
        "--client",
        choices=("grpc-aio", "h2"),
        default="grpc-aio",
        help="load generator client (h2: minimal HTTP/2, plaintext only, experimental)",
    )
    p.add_argument(
        "--client-loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="the load generator's event loop (default uvloop, as the harness; asyncio: as a plain grpc.aio client)",
    )
    p.add_argument("--output", default="bench-target", help="directory for target.json and target.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return TargetBench(args).run()
    except KeyboardInterrupt:
        print("openengine-bench --target: interrupted", file=sys.stderr)
        return 130


class TargetBench:
    def __init__(self, args: argparse.Namespace) -> None:
        from .stack import parse_cpus

        self.args = args
        self.out = Path(args.output)
        self.connections = [int(c) for c in args.connections.split(",") if c.strip()]
        try:
            self.frontend_pids = [int(p) for p in args.frontend_pids.split(",") if p.strip()]
        except ValueError:
            raise SystemExit(f"--frontend-pids {args.frontend_pids!r}: expected comma-separated process ids") from None
        for pid in self.frontend_pids:
            if not os.path.exists(f"/proc/{pid}"):
                raise SystemExit(f"--frontend-pids: no process {pid} on this machine")
        self.client_cpus = parse_cpus(args.client_cpus) if args.client_cpus else None
        self.credentials = credentials(args)
        self.extra: dict[str, Any] = {"api_key": self.credentials.api_key, "client": args.client}
        if self.credentials.uses_tls:
            self.extra["tls"] = {
                "ca_file": self.credentials.ca_file,
                "cert_file": self.credentials.cert_file,
                "key_file": self.credentials.key_file,
                "server_name": self.credentials.server_name,
            }
        if args.model:
            self.extra["model"] = args.model
        self.rounds: list[dict[str, Any]] = []

    def run(self) -> int:
        from .load import LoadPool

        started = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        plan = [("fixed", c) for c in self.connections]
        if self.args.saturation > 0:
            plan += [("saturation", c) for c in self.connections]
        pool = LoadPool(self.args.client_procs, self.client_cpus, self.args.client_loop)
        try:
            for r in range(1, self.args.rounds + 1):
                for workload, c in plan:
                    self.measure(pool, workload, c, r)
        finally:
            pool.close()
        result = {
            "meta": self.meta(time.monotonic() - started),
            "rounds": self.rounds,
            "summary": report.summarize_rounds(self.rounds, SCENARIO_COLUMNS),
        }
        report.write_json(result, self.out / "target.json")
        text = render(result)
        (self.out / "target.md").write_text(text + "\n", encoding="utf-8")
        print(text)
        print(f"\nwrote {self.out / 'target.json'}, {self.out / 'target.md'}")
        return 0

    def measure(self, pool, workload: str, connections: int, r: int) -> dict[str, Any]:
        from .load import CONNECT_MARGIN_S, SETTLE_S, make_jobs, merge_results, poisson_arrivals, sleep_until
        from .stack import CpuSampler, descendants

        scenario = report.scenario_name(workload, connections)
        start_at = time.monotonic() + CONNECT_MARGIN_S
        t0 = start_at + self.args.warmup_s
        t1 = t0 + self.args.window_s
        tag = f"target-{scenario}-r{r}-{os.getpid()}"  # fresh ids on every run: a deployment may remember ids
        common = dict(
            target=self.args.target,
            connections=connections,
            procs=pool.size,
            start_at=start_at,
            t0=t0,
            t1=t1,
            stop_at=t1,
            id_prefix=tag,
            key_base=zlib.crc32(tag.encode()) << 24,
            prompt_tokens=self.args.prompt_tokens,
            output_tokens=self.args.output_tokens,
            extra=self.extra,
        )
        if workload == "fixed":
            jobs = make_jobs(
                kind="fixed",
                drain_timeout_s=self.args.drain_s,
                arrivals=poisson_arrivals(self.args.rate, t1 - start_at, tag),
                **common,
            )
        else:
            jobs = make_jobs(kind="saturation", drain_timeout_s=0.0, inflight=self.args.saturation, **common)
        sampler = CpuSampler()
        sampler.set_group("frontend", [p for root in self.frontend_pids for p in descendants(root)])
        sampler.set_group("load generator", pool.pids[: len(jobs)])
        pool.submit(jobs)
        sleep_until(t0)
        before = sampler.snapshot()
        sleep_until(t1)
        after = sampler.snapshot()
        merged = merge_results(pool.collect(len(jobs), timeout=self.args.drain_s + 60.0))
        cpu = CpuSampler.delta(before, after)
        window = self.args.window_s
        tokens = merged["window_tokens"]
        ttft, itl = report.latency_stats(merged["ttft"]), report.latency_stats(merged["itl"])
        front = cpu["frontend"] if self.frontend_pids else None
        record = {
            "mode": "target",
            "scenario": scenario,
            "workload": workload,
            "connections": connections,
            "server": "target",
            "round": r,
            "window_s": window,
            "tokens": tokens,
            "tokens_per_s": tokens / window,
            "messages": merged["window_messages"],
            "tokens_per_message": tokens / merged["window_messages"] if merged["window_messages"] else None,
            "cpu_us_per_token": front / tokens * 1e6 if front is not None and tokens else None,
            "frontend_util": None if front is None else front / window,
            "client_us_per_token": cpu["load generator"] / tokens * 1e6 if tokens else None,
            "client_util": cpu["load generator"] / window,
            "ttft_p50_ms": ttft["p50_ms"],
            "ttft_p99_ms": ttft["p99_ms"],
            "ttft_samples": ttft["n"],
            "itl_p50_ms": itl["p50_ms"],
            "itl_p99_ms": itl["p99_ms"],
            "itl_samples": itl["n"],
            "requests_started": merged["started"],
            "requests_completed": merged["completed"],
            "errors": sum(merged["errors"].values()),
            "error_kinds": merged["errors"],
            "client_lag_max_ms": merged["lag_max_s"] * 1e3,
        }
        self.rounds.append(record)
        print(
            f"[bench --target {time.strftime('%H:%M:%S')}] {scenario:15s} r{r}: {record['tokens_per_s']:8.0f} "
            f"tok/s  TTFT p99 {report.fmt_number(record['ttft_p99_ms'])} ms  frontend "
            f"{report.fmt_number(record['cpu_us_per_token'])} µs/tok  client "
            f"{report.fmt_number(record['client_us_per_token'])} µs/tok  errors {record['errors']}",
            flush=True,
        )
        time.sleep(SETTLE_S * (2 if workload == "saturation" else 1))
        return record

    def meta(self, duration_s: float) -> dict[str, Any]:
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "duration_s": round(duration_s, 1),
            "target": self.args.target,
            "frontend_pids": self.frontend_pids,
            "connections": self.connections,
            "rate": self.args.rate,
            "saturation": self.args.saturation,
            "prompt_tokens": self.args.prompt_tokens,
            "output_tokens": self.args.output_tokens,
            "rounds": self.args.rounds,
            "warmup_s": self.args.warmup_s,
            "window_s": self.args.window_s,
            "client_procs": self.args.client_procs,
            "client_cpus": self.client_cpus,
            "client_loop": self.args.client_loop,
            "tls": "tls" in self.extra,
            "api_key": bool(self.extra.get("api_key")),
            "nproc": os.cpu_count(),
        }
        meta["server_info"] = self.server_info()
        return meta

    def server_info(self) -> dict[str, Any]:
        """The frontend's ServerInfo (implementation, CPU budget, ...), {} when it does not answer."""
        from google.protobuf import json_format

        from openengine_serve.api.openengine.v1 import server_pb2
        from openengine_serve.client import Client

        with contextlib.suppress(Exception):
            with Client(self.args.target, credentials=self.credentials) as client:
                info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
            return json_format.MessageToDict(info)
        return {}


def render(result: dict[str, Any]) -> str:
    meta = result["meta"]
    info = meta.get("server_info") or {}
    parts = [
        f"# openengine-bench --target {meta['target']}",
        "",
        f"{meta['rate']:g} req/s open-loop"
        + (f", saturation {meta['saturation']} in flight" if meta["saturation"] else "")
        + f"; {meta['prompt_tokens']} prompt -> {meta['output_tokens']} output tokens; {meta['rounds']} "
        f"window(s) of {meta['window_s']:g} s per scenario; frontend pids {meta['frontend_pids'] or '(none)'}"
        + (f"; server {info.get('extra', {}).get('grpc_server', '?')}" if info else ""),
        "",
    ]
    headers = ["scenario", "windows", *(report.metric_title(m) if m in report.METRICS else m for m in SCENARIO_COLUMNS)]
    rows = []
    for scenario in sorted(result["summary"].get("target", {}), key=report._scenario_order):
        stats = result["summary"]["target"][scenario]["target"]
        rows.append(
            [
                scenario,
                str(max(s["n"] for s in stats.values())),
                *(report.fmt_range(stats[m]) for m in SCENARIO_COLUMNS),
            ]
        )
    parts.append(report.format_table(headers, rows))
    return "\n".join(parts)
