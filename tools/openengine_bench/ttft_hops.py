"""TTFT by stage: where every request's first token spent its time, from a bench run's debug logs.

    openengine-bench --placement pinned --no-budget --no-baseline --fixed-rounds 1 --log-level debug \
        --output ttft-out
    python -m openengine_bench.ttft_hops ttft-out

The frontend's "first token" and the node's "first event on lane" debug lines (CLOCK_MONOTONIC, one machine)
time each request's first token per hop (overload.HOPS without the client's two: validation before `opened_at`
and the client's receipt are the rest of the frontend's `ttft_s`). Per frontend log (one server, one round):
TTFT p50/p99 and, per hop, p50, p99 and its mean over the slowest 1 % of requests (what makes the tail).
Debug logging costs CPU on every hop's process: compare servers with each other, not with info-level figures.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from . import report
from .overload import HOPS, log_lines

STAGES = tuple(hop for hop in HOPS if not hop[1].startswith("c.") and not hop[2].startswith("c."))
TAIL_SHARE = 0.01


def stage_times(
    frontend: list[tuple[str, dict[str, float]]], node: dict[str, list[dict[str, float]]]
) -> dict[str, list[dict[str, float]]]:
    """Scenario (the request id without its number) -> per request timed by both its TTFT (`ttft`, s) and each
    stage's duration (s). The bench reuses request ids across servers and rounds: the node's line is the one
    submitted while the frontend's request was (between its reservation and its first write)."""
    out: dict[str, list[dict[str, float]]] = {}
    for request_id, front in frontend:
        times = {f"f.{k}": v for k, v in front.items()}
        for candidate in node.get(request_id, ()):
            if front["reserved_at"] <= candidate["submitted_at"] <= front["written_at"]:
                times |= {f"n.{k}": v for k, v in candidate.items()}
                break
        if not all(start in times and end in times for _, start, end in STAGES):
            continue
        row = {hop: times[end] - times[start] for hop, start, end in STAGES}
        row["ttft"] = front["ttft_s"]
        row["before open + after write"] = front["ttft_s"] - (times["f.written_at"] - times["f.opened_at"])
        out.setdefault(request_id.rsplit("-", 1)[0], []).append(row)
    return out


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    """TTFT p50/p99 and per stage p50 / p99 / mean over the slowest TAIL_SHARE of TTFTs (ms)."""
    if not rows:
        return {"n": 0}
    slowest = sorted(rows, key=lambda r: r["ttft"])[-max(1, round(len(rows) * TAIL_SHARE)) :]
    ms = lambda v: round(v * 1000, 2)  # noqa: E731
    stages = {}
    for stage in [hop for hop, _, _ in STAGES] + ["before open + after write"]:
        values = [r[stage] for r in rows]
        stages[stage] = {
            "p50_ms": ms(report.percentile(values, 50)),
            "p99_ms": ms(report.percentile(values, 99)),
            "tail_mean_ms": ms(statistics.fmean(r[stage] for r in slowest)),
        }
    ttfts = [r["ttft"] for r in rows]
    return {
        "n": len(rows),
        "ttft_p50_ms": ms(report.percentile(ttfts, 50)),
        "ttft_p99_ms": ms(report.percentile(ttfts, 99)),
        "stages": stages,
    }


def run_summaries(out_dir: Path) -> dict[str, dict[str, Any]]:
    """ "<frontend log> <scenario>" -> its summary, from `<out_dir>/logs` (a bench run at --log-level debug)."""
    log_dir = out_dir / "logs" if (out_dir / "logs").is_dir() else out_dir
    node: dict[str, list[dict[str, float]]] = {}
    for path in sorted(log_dir.glob("node*.log")):
        for request_id, fields in log_lines(path, "first event on lane"):
            node.setdefault(request_id, []).append(fields)
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(log_dir.glob("frontend*.log")):
        rows = stage_times(list(log_lines(path, "first token", numeric=("ttft_s",))), node)
        out |= {f"{path.name} {scenario}": summarize(scenario_rows) for scenario, scenario_rows in rows.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="a bench --output directory run with --log-level debug")
    args = parser.parse_args(argv)
    summaries = run_summaries(args.out_dir)
    if not summaries:
        raise SystemExit(f"no first-token lines in {args.out_dir} (was the bench run at --log-level debug?)")
    for name, summary in summaries.items():
        print(f"{name}: {summary['n']} requests, TTFT p50 {summary['ttft_p50_ms']} ms, p99 {summary['ttft_p99_ms']} ms")
        print(f"  {'stage':<30} {'p50':>8} {'p99':>8} {'slowest 1%':>11}  (ms)")
        for stage, v in summary["stages"].items():
            print(f"  {stage:<30} {v['p50_ms']:>8} {v['p99_ms']:>8} {v['tail_mean_ms']:>11}")


if __name__ == "__main__":
    main()
