"""`openengine-bench --soak MINUTES`: a steady mixed load on a whole deployment, per gRPC server.

For each server in --servers, starts `openengine-serve up --nodes 2 --workers 2 --grpc-server S` (coordinator,
two nodes with their MPI engine workers, a frontend supervisor with two workers), runs the mixed load of
`soak_load` for MINUTES at a steady --rate (operations/s: streams of varied lengths, client cancels, Abort
RPCs, duplicate ids, malformed bytes, invalid fields, abrupt disconnects) and samples every process of the
deployment (`up` and all its descendants, psutil) every --sample-s seconds: resident memory (RSS) and open
file descriptors.

Verdict per server (PASS needs all of them):
- growth < --max-growth (5 %) for every process, RSS and open fds: the first --warmup (20 %) of the run is
  warm-up; of the samples after it, the mean of the first quarter is compared with the mean of the last
  quarter: (last - first) / first;
- no process of the deployment exited or was replaced during the run;
- 0 unexpected outcomes (every injected error got its documented code; see soak_load);
- afterwards nothing is left behind: no running or queued request (GetLoad) and no live reservation at the
  coordinator.

Writes <output>/soak.json (every sample, every count), soak.png (RSS and fds per process over time, one
column per server) and soak.md (the report, also printed); component logs in <output>/logs/. Exits 1 when a
server fails.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from . import report

RSS_MB = 1024 * 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="openengine-bench --soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--soak", type=float, required=True, metavar="MINUTES", help="load duration per server")
    p.add_argument("--servers", default="grpcio,pygrpc-native", help="comma-separated, run one after the other")
    p.add_argument("--nodes", type=int, default=2, help="nodes of the deployment (default 2)")
    p.add_argument("--workers", type=int, default=2, help="frontend worker processes (default 2)")
    p.add_argument("--rate", type=float, default=10.0, help="operations started per second, evenly spaced (default 10)")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between process samples (default 2)")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of the run that is warm-up (default 0.2)")
    p.add_argument(
        "--max-growth",
        type=float,
        default=0.05,
        help="largest growth allowed per process, RSS and open fds (default 0.05 = 5 %%)",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the operation mix and lengths")
    p.add_argument("--drain-s", type=float, default=30.0, help="after the load: how long open operations get")
    p.add_argument("--output", default="bench-results", help="directory for soak.json, soak.png, soak.md, logs/")
    p.add_argument(
        "--rerender", action="store_true", help="measure nothing: rebuild soak.png and soak.md from <output>/soak.json"
    )
    return p


# ---------------------------------------------------------------- the processes of a deployment


def label_processes(root_pid: int) -> dict[int, str]:
    """pid -> a stable name for `up` and every process below it: the component (coordinator, node-<rank>,
    frontend) and, below a component, what runs there (frontend worker-<i>, engine launcher, mpiexec, ...)."""
    import psutil

    root = psutil.Process(root_pid)
    names: dict[int, str] = {root_pid: "up"}
    taken: set[str] = {"up"}

    def own_name(proc: psutil.Process) -> str:
        args = proc.cmdline()
        if "openengine_serve" in args:
            rest = args[args.index("openengine_serve") + 1 :]
            command = rest[0] if rest else "?"
            if command == "node" and "--node-rank" in rest:
                return f"node-{rest[rest.index('--node-rank') + 1]}"
            if command == "frontend" and "--frontend-id" in rest:
                return f"worker-{rest[rest.index('--frontend-id') + 1].rsplit('-w', 1)[-1]}"
            return command
        for module in ("openengine_serve.engine.launcher", "openengine_serve.engine.worker"):
            if module in args:
                return "engine " + module.rsplit(".", 1)[1]
        return os.path.basename(args[0]) if args else proc.name()

    def walk(proc: psutil.Process, component: str) -> None:
        for child in sorted(proc.children(), key=lambda c: (c.create_time(), c.pid)):
            try:
                name = own_name(child)
            except psutil.Error:
                continue
            full = f"{component} {name}" if component else name
            unique, k = full, 2
            while unique in taken:
                unique, k = f"{full} #{k}", k + 1
            taken.add(unique)
            names[child.pid] = unique
            walk(child, component or unique)

    walk(root, "")
    return names


def sample(pids: dict[int, str]) -> dict[str, tuple[int, float, int] | None]:
    """name -> (pid, RSS in MB, open fds), None for a process that is gone."""
    import psutil

    out: dict[str, tuple[int, float, int] | None] = {}
    for pid, name in pids.items():
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                out[name] = (pid, proc.memory_info().rss / RSS_MB, proc.num_fds())
        except psutil.Error:
            out[name] = None
    return out


# ---------------------------------------------------------------- analysis (pure)


def growth(values: list[float], warmup_samples: int) -> dict[str, Any]:
    """Growth of a series after its warm-up: mean of the last quarter vs mean of the first quarter."""
    after = values[warmup_samples:]
    window = max(1, len(after) // 4)
    if not after:
        return {"first": None, "last": None, "growth": None, "window": 0}
    first = sum(after[:window]) / window
    last = sum(after[-window:]) / window
    return {"first": first, "last": last, "growth": (last - first) / first if first else None, "window": window}


def evaluate(run: dict[str, Any], warmup: float, max_growth: float) -> dict[str, Any]:
    """Per process growth of RSS and fds, the failures, and the verdict of one server's run."""
    times = run["times"]
    warmup_samples = sum(1 for t in times if t < warmup * run["duration_s"])
    failures: list[str] = []
    processes: dict[str, Any] = {}
    for name, series in run["series"].items():
        gone = [i for i, s in enumerate(series) if s is None]
        pids = {s[0] for s in series if s is not None}
        entry: dict[str, Any] = {"pid": sorted(pids)}
        if gone or len(pids) > 1:
            failures.append(f"{name}: exited or was replaced during the run")
        present = [s for s in series[warmup_samples:] if s is not None]
        for i, metric in ((1, "rss_mb"), (2, "fds")):
            entry[metric] = growth([s[i] for s in series if s is not None], warmup_samples)
            g = entry[metric]["growth"]
            if g is None or not present:
                failures.append(f"{name}: no {metric} samples after the warm-up")
            elif g >= max_growth:
                failures.append(
                    f"{name}: {metric} grew {g * 100:.1f} % ({entry[metric]['first']:.1f} -> "
                    f"{entry[metric]['last']:.1f})"
                )
        processes[name] = entry
    if len(times) - warmup_samples < 4:
        failures.append(f"only {len(times) - warmup_samples} samples after the warm-up (need 4): run longer")
    load = run["load"]
    if load["unexpected"]:
        failures.append(f"{load['unexpected']} unexpected outcome(s)")
    for what, value in run["left_behind"].items():
        if value:
            failures.append(f"left behind after the load: {value} {what}")
    return {
        "warmup_samples": warmup_samples,
        "processes": processes,
        "failures": failures,
        "verdict": "FAIL" if failures else "PASS",
    }


# ---------------------------------------------------------------- one server


async def _soak(up, args: argparse.Namespace, server: str) -> dict[str, Any]:
    from .soak_load import SoakLoad, live_reservations, running_requests

    duration_s = args.soak * 60.0
    load = SoakLoad(up.target, rate=args.rate, seed=args.seed, id_prefix=f"soak-{server}-{os.getpid()}")
    await load.open()
    pids = label_processes(up.pid)
    times: list[float] = []
    series: dict[str, list] = {name: [] for name in pids.values()}
    ops_at: list[int] = []
    started = time.monotonic()
    cpu_started = time.process_time()

    async def sampler() -> None:
        while (now := time.monotonic()) - started <= duration_s:
            snapshot = await asyncio.to_thread(sample, pids)
            times.append(now - started)
            ops_at.append(sum(load.tally.started.values()))
            for name, value in snapshot.items():
                series[name].append(value)
            await asyncio.sleep(max(0.0, args.sample_s - (time.monotonic() - now)))

    sampling = asyncio.create_task(sampler())
    still_open = await load.run(duration_s, args.drain_s)
    load_cpu_s = time.process_time() - cpu_started
    await sampling
    await load.close()
    left: dict[str, int | None] = {"running or queued requests": None, "live reservations": None}
    deadline = time.monotonic() + 15.0
    while True:  # the nodes report their load with their heartbeat: give it a few
        left = {
            "running or queued requests": await running_requests(up.target),
            "live reservations": await live_reservations(up.coordinator_target),
        }
        if not any(left.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    return {
        "server": server,
        "duration_s": duration_s,
        "times": times,
        "series": series,
        "pids": {str(pid): name for pid, name in pids.items()},
        "operations_started_at_samples": ops_at,
        "load": load.tally.summary(),
        "operations_issued": load.issued,
        "still_open_after_drain": still_open,
        "schedule_lag_max_ms": load.lag_max_s * 1e3,
        "load_generator_cores": load_cpu_s / duration_s,
        "left_behind": left,
    }


def run_server(server: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from openengine_serve.common.lifecycle import new_event_loop

    from .stack import UpStack

    up = UpStack(server, nodes=args.nodes, workers=args.workers, log_path=out / "logs" / f"soak-{server}.log")
    log(f"{server}: starting `openengine-serve up --nodes {args.nodes} --workers {args.workers}`")
    up.start()
    loop = new_event_loop()
    try:
        log(f"{server}: {args.soak:g} min of mixed load at {args.rate:g} operations/s")
        run = loop.run_until_complete(_soak(up, args, server))
        if not up.alive():
            run["left_behind"]["`up` exited during the run"] = 1
    finally:
        loop.close()
        code = up.stop()
    run["up_exit_code"] = code
    run.update(evaluate(run, args.warmup, args.max_growth))
    log(f"{server}: {run['verdict']}" + "".join(f"\n  - {f}" for f in run["failures"]))
    return run


# ---------------------------------------------------------------- outputs


def render(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"# Soak: {meta['minutes']:g} min per server",
        "",
        f"Deployment: `openengine-serve up --nodes {meta['nodes']} --workers {meta['workers']}` (engine step "
        f"2 ms). Load: {meta['rate']:g} operations/s evenly spaced from one asyncio client (mix per 100: "
        f"{', '.join(f'{n} {k}' for k, n in meta['mix'].items())}). Samples every {meta['sample_s']:g} s; "
        f"warm-up: the first {meta['warmup'] * 100:.0f} %; growth = mean of the last quarter of the samples "
        f"after the warm-up vs the first quarter, allowed < {meta['max_growth'] * 100:.0f} %.",
        f"Machine: {meta['nproc']} cores, Python {meta['python']}, {meta['date']}.",
        "",
    ]
    for run in result["runs"]:
        load = run["load"]
        lines += [f"## {run['server']}: {run['verdict']}", ""]
        lines += [f"- {f}" for f in run["failures"]] + ([""] if run["failures"] else [])
        rows = []
        for name, p in run["processes"].items():
            rss, fds = p["rss_mb"], p["fds"]
            rows.append([name, _pair(rss, "{:.1f}"), _pct(rss["growth"]), _pair(fds, "{:.1f}"), _pct(fds["growth"])])
        lines.append(
            report.format_table(
                ["process", "RSS MB first → last", "RSS growth", "open fds first → last", "fd growth"], rows
            )
        )
        lines.append("")
        outcome_rows = [
            [kind, load["operations"].get(kind, 0), ", ".join(f"{o} {n}" for o, n in outcomes.items())]
            for kind, outcomes in load["outcomes"].items()
        ]
        lines.append(report.format_table(["operation", "started", "outcomes"], outcome_rows))
        lines += [
            "",
            f"Injected errors answered with their documented code: {load['injected_total']} "
            f"({', '.join(f'{k} {n}' for k, n in load['injected_errors'].items())}); unexpected: "
            f"{load['unexpected']}. Left behind: "
            f"{', '.join(f'{k} {v}' for k, v in run['left_behind'].items())}. Load generator: "
            f"{run['load_generator_cores']:.2f} cores, schedule lag max {run['schedule_lag_max_ms']:.0f} ms.",
            "",
        ]
        for u in load["unexpected_samples"][:10]:
            lines.append(f"- unexpected: {u['kind']} → {u['outcome']}: {u['detail']}")
    lines.append("Verdict: " + ", ".join(f"{r['server']} {r['verdict']}" for r in result["runs"]))
    return "\n".join(lines)


def _pair(g: dict[str, Any], fmt: str) -> str:
    return "–" if g["first"] is None else f"{fmt.format(g['first'])} → {fmt.format(g['last'])}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:+.1f} %"


def write_chart(result: dict[str, Any], path: Path) -> Path:
    """Per server (one column): RSS of every process over time, its change against the first window after
    the warm-up (with the allowed band), and open fds; the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    meta = result["meta"]
    fig, axes = plt.subplots(3, len(runs), figsize=(7.5 * len(runs), 12), squeeze=False)
    colors = plt.get_cmap("tab20")
    for col, run in enumerate(runs):
        warmup_end = meta["warmup"] * run["duration_s"]
        for k, (name, series) in enumerate(run["series"].items()):
            points = [(t, s) for t, s in zip(run["times"], series) if s is not None]
            if not points:
                continue
            times = [t for t, _ in points]
            first = run["processes"][name]["rss_mb"]["first"]
            style = dict(label=name, linewidth=1.1, color=colors(k % colors.N))
            axes[0][col].plot(times, [s[1] for _, s in points], **style)
            if first:
                axes[1][col].plot(times, [(s[1] / first - 1) * 100 for _, s in points], **style)
            axes[2][col].plot(times, [s[2] for _, s in points], **style)
        for bound in (-meta["max_growth"] * 100, meta["max_growth"] * 100):
            axes[1][col].axhline(bound, color="red", linewidth=0.8, linestyle="--")
        titles = (
            "RSS (MB, log scale)",
            "RSS change vs the first window after warm-up (%; dashed: allowed)",
            "open file descriptors (log scale)",
        )
        for row, title in enumerate(titles):
            ax = axes[row][col]
            ax.axvspan(0, warmup_end, color="grey", alpha=0.12)
            ax.set_title(f"{run['server']} ({run['verdict']}): {title}", fontsize=9)
            ax.grid(alpha=0.3)
            if row != 1:
                ax.set_yscale("log")
        axes[2][col].set_xlabel("seconds (shaded: warm-up)")
        axes[2][col].legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.suptitle(
        f"openengine-serve soak: every process of `up --nodes {meta['nodes']} --workers {meta['workers']}` "
        f"under {meta['rate']:g} mixed operations/s",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str]) -> int:
    from .soak_load import MIX

    args = build_parser().parse_args(argv)
    out = Path(args.output)
    if args.rerender:
        return write_outputs(report.read_json(out / "soak.json"), out)
    if args.soak <= 0 or args.rate <= 0 or args.sample_s <= 0 or not 0 <= args.warmup < 1:
        raise SystemExit("openengine-bench --soak: MINUTES, --rate and --sample-s must be > 0 and --warmup in [0, 1)")
    out.mkdir(parents=True, exist_ok=True)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    runs = [run_server(server, args, out) for server in servers]
    meta = {
        "minutes": args.soak,
        "servers": servers,
        "nodes": args.nodes,
        "workers": args.workers,
        "rate": args.rate,
        "sample_s": args.sample_s,
        "warmup": args.warmup,
        "max_growth": args.max_growth,
        "seed": args.seed,
        "mix": MIX,
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_at_end": list(os.getloadavg()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    return write_outputs({"meta": meta, "runs": runs}, out)


def write_outputs(result: dict[str, Any], out: Path) -> int:
    """soak.json, soak.png, soak.md (printed); 0 when every server passed, else 1."""
    # One line: every sample of every process (the readable summary is soak.md).
    (out / "soak.json").write_text(json.dumps(result, ensure_ascii=False) + "\n", encoding="utf-8")
    write_chart(result, out / "soak.png")
    text = render(result)
    (out / "soak.md").write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"\nwrote {out / 'soak.json'}, {out / 'soak.png'}, {out / 'soak.md'}")
    return 0 if all(r["verdict"] == "PASS" for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
