"""Statistics and the report of `openengine-bench`: pure functions over plain dicts.

A *round record* is one measured window of one server on one scenario (see
`cli.measure`): a flat dict with `mode` ("stack" or "baseline"), `scenario`,
`workload` ("fixed" or "saturation"), `connections`, `server`, `round` and the
metrics named in `METRICS`. Everything here takes and returns plain data so it
can be unit-tested and round-tripped through JSON; only `write_chart` touches
matplotlib (Agg backend, imported lazily).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

GRPCIO = "grpcio"
NATIVE = "pygrpc-native"
SERVERS = (GRPCIO, NATIVE)

# metric key -> (column title, unit, decimals hint: None = automatic)
METRICS: dict[str, tuple[str, str]] = {
    "cpu_us_per_token": ("frontend CPU/token", "µs"),
    "tokens_per_s": ("tokens/s", "1/s"),
    "ttft_p50_ms": ("TTFT p50", "ms"),
    "ttft_p99_ms": ("TTFT p99", "ms"),
    "itl_p50_ms": ("ITL p50", "ms"),
    "itl_p99_ms": ("ITL p99", "ms"),
    "frontend_util": ("frontend process (cores)", "fraction"),
    "other_util": ("rest of stack (cores/core)", "fraction"),
    "frontend_core_busy": ("frontend core busy", "fraction"),
    "other_core_busy": ("other cores busy", "fraction"),
    "foreign_frontend_core": ("foreign load on frontend core", "fraction"),
    "tokens_per_message": ("tokens/message", "ratio"),
    "wake_ups_per_message": ("frontend wake-ups/message", "ratio"),
    "client_us_per_token": ("load generator CPU/token", "µs"),
    "errors": ("errors", "count"),
}
STACK_COLUMNS = (
    "cpu_us_per_token",
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "frontend_util",
    "frontend_core_busy",
    "foreign_frontend_core",
    "other_core_busy",
    "tokens_per_message",
    "wake_ups_per_message",
    "client_us_per_token",
    "errors",
)
# Unpinned placements have no core of their own: the per-core columns do not apply.
UNPINNED_COLUMNS = (
    "cpu_us_per_token",
    "tokens_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "frontend_util",
    "other_core_busy",
    "tokens_per_message",
    "wake_ups_per_message",
    "client_us_per_token",
    "errors",
)
BASELINE_COLUMNS = (
    "cpu_us_per_token",
    "tokens_per_s",
    "frontend_util",
    "frontend_core_busy",
    "other_core_busy",
    "errors",
)

# Thresholds the report compares against (never asserted).
TARGET_CPU_RATIO = 0.65  # native/grpcio CPU per token at fixed load, <=, in every placement
TARGET_SATURATION_RATIO = 1.6  # native/grpcio tokens/s at saturation, >= (budgeted: in every round)
TARGET_FLOOR_MULTIPLE = 1.5  # native CPU/token / native bare CPU/message, <=
TARGET_TTFT_RATIO = 0.5  # native/grpcio TTFT p99 at fixed load, <=

BUSY = 0.90  # a core this busy over the window counts as saturated
THROTTLED = 0.10  # a quota throttled in this share of its periods limited the frontend
IDLE = 0.10  # machine idle below this many cores: the machine's CPU limited the window
# Budgeted saturation: a window measures the servers only when the frontend's quota limited it and nothing else
# did. At its quota: the frontend used QUOTA_USED of it over the window (the throttled share alone is not
# enough: a bursty process is throttled in some periods far below its quota). Headroom for the rest (node,
# engine, coordinator, load generator, pinned to the other cores): those cores, from /proc/stat (every process,
# interrupts, steal), below OTHER_BUSY_MAX busy on average; with no separate cores, HEADROOM_IDLE cores idle.
QUOTA_USED = 0.90
OTHER_BUSY_MAX = 0.85
HEADROOM_IDLE = 0.15
REST_SHOWN = 0.05  # the rest's consumers named in a verdict: this many cores or more

# Placements in report order; the harness's `budget` is the saturation run under a small quota.
PINNED, BUDGET = "pinned", "budget"
PLACEMENT_ORDER = (PINNED, "quota", "shared", BUDGET)
PLACEMENT_TITLES = {
    PINNED: "frontend pinned to its own CPU before it starts",
    "quota": "frontend in a cgroup CPU quota, every core visible (as under `docker --cpus` or a Kubernetes limit)",
    "shared": "frontend unconstrained, every core visible",
    BUDGET: "budgeted saturation: frontend in a small cgroup CPU quota, meant to be the bottleneck (checked per "
    "window)",
}


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).

    None for no values. The input need not be sorted.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must be between 0 and 100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


def summarize(values: Iterable[float | None]) -> dict[str, Any]:
    """Median with its [min, max] range over rounds; None values (a metric a round could not measure) are skipped."""
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": median(present), "min": min(present), "max": max(present), "n": len(present)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def verdict(value: float | None, op: str, threshold: float) -> str:
    """PASS / MISS for `value op threshold` (op one of <=, >=, <, >, ==); N/A when there is no value."""
    if value is None:
        return "N/A"
    ok = {
        "<=": value <= threshold,
        ">=": value >= threshold,
        "<": value < threshold,
        ">": value > threshold,
        "==": value == threshold,
    }[op]
    return "PASS" if ok else "MISS"


def latency_stats(samples_s: Sequence[float]) -> dict[str, float | None]:
    """p50/p99 in milliseconds of samples in seconds."""
    p50, p99 = percentile(samples_s, 50), percentile(samples_s, 99)
    return {
        "p50_ms": None if p50 is None else p50 * 1e3,
        "p99_ms": None if p99 is None else p99 * 1e3,
        "n": len(samples_s),
    }


def bottleneck(
    frontend_util: float | None, frontend_core_busy: float | None, other_core_busy: float | None, workload: str
) -> str:
    """Which side limited a round.

    frontend_util: the frontend process's CPU over the window (cores); *_core_busy: how busy the cores were in
    total (every process, interrupts, steal; per core). A saturated frontend core that the frontend itself did
    not fill means another user's processes took it.
    """
    if frontend_core_busy is None or other_core_busy is None or frontend_util is None:
        return "unknown"
    if frontend_core_busy >= BUSY and frontend_core_busy >= other_core_busy:
        if frontend_util >= BUSY - 0.1:
            return "frontend"
        return f"frontend core, shared with foreign load ({frontend_core_busy - frontend_util:.2f} core)"
    if other_core_busy >= BUSY:
        return "other core(s): node/engine/load generator"
    if workload == "fixed":
        return "none (open-loop arrivals; nothing saturated)"
    return "none saturated (latency-bound: engine step pacing / queueing)"


def limiter(
    workload: str,
    frontend_util: float | None,
    quota_cpus: float | None,
    throttled_share: float | None,
    machine_idle_cores: float | None,
    node_util: float | None,
) -> str:
    """What limited a window of an unpinned frontend: its quota (throttled periods from the cgroup's cpu.stat),
    the machine's CPU (no idle left on any core), or the backend (the node's one Python loop)."""
    reasons = []
    if quota_cpus and ((throttled_share or 0.0) >= THROTTLED or (frontend_util or 0.0) >= BUSY * quota_cpus):
        reasons.append(
            f"frontend quota ({fmt_number(frontend_util)} of {quota_cpus:g} CPU, throttled in "
            f"{(throttled_share or 0.0) * 100:.0f} % of periods)"
        )
    if machine := machine_reason(machine_idle_cores):
        reasons.append(machine)
    if node_util is not None and node_util >= BUSY:
        reasons.append(f"backend (node at {node_util:.2f} core)")
    if reasons:
        return "; ".join(reasons)
    if workload == "fixed":
        return "none (open-loop arrivals; nothing saturated)"
    return "none saturated (latency-bound: engine step pacing / queueing)"


def budget_limiter(
    frontend_util: float | None,
    quota_cpus: float | None,
    throttled_share: float | None,
    other_core_busy: float | None,
    machine_idle_cores: float | None,
    rest_util: Mapping[str, float] | None = None,
) -> tuple[str, bool]:
    """What limited a budgeted-saturation window, and whether it was the frontend's quota alone.

    frontend_util: the frontend's CPU over the window (cores); other_core_busy: mean busy share of the cores the
    rest of the stack is pinned to (None when there are none of its own); rest_util: {process group: cores} of
    everything else, to name what filled those cores. Frontend-limited means at its quota (QUOTA_USED) with
    headroom elsewhere (other cores below OTHER_BUSY_MAX busy, or HEADROOM_IDLE cores idle without them);
    a window that is not is no measure of the servers' relative cost.
    """
    at_quota = bool(quota_cpus) and frontend_util is not None and frontend_util >= QUOTA_USED * (quota_cpus or 0)
    quota_text = (
        f"frontend quota ({fmt_number(frontend_util)} of {quota_cpus:g} CPU, throttled in "
        f"{(throttled_share or 0.0) * 100:.0f} % of periods)"
        if quota_cpus
        else "no frontend quota"
    )
    consumers = sorted(
        ((cores, name) for name, cores in (rest_util or {}).items() if cores >= REST_SHOWN), reverse=True
    )
    named = ", ".join(f"{name} {cores:.2f}" for cores, name in consumers)
    if other_core_busy is not None:
        headroom = other_core_busy < OTHER_BUSY_MAX
        rest_text = f"other cores {other_core_busy:.2f} busy"
        limit_text = f"below {OTHER_BUSY_MAX:.2f}"
    elif machine_idle_cores is not None:
        headroom = machine_idle_cores >= HEADROOM_IDLE
        rest_text = f"machine idle {machine_idle_cores:.2f} core"
        limit_text = f"at least {HEADROOM_IDLE:.2f}"
    else:
        return "unknown (no per-core figures)", False
    if at_quota and headroom:
        return f"{quota_text}; {rest_text}", True
    reasons = []
    if not headroom:
        reasons.append(f"rest of the machine ({rest_text}, headroom needs {limit_text}{f'; {named}' if named else ''})")
    if at_quota:
        reasons.append(quota_text)
    elif quota_cpus and frontend_util is not None:
        reasons.append(
            f"not the frontend: {fmt_number(frontend_util)} of its {quota_cpus:g}-CPU quota, below "
            f"{QUOTA_USED * 100:.0f} %"
        )
    if headroom:
        reasons.append(f"not the rest: {rest_text}")
    return "; ".join(reasons), False


REST_EXCLUDED = ("frontend", "bare server", "idle (all cores)")


def classify_budget_window(record: Mapping[str, Any]) -> tuple[str, bool]:
    """`budget_limiter` over a round record's stored figures (so older bench.json files can be rerendered)."""
    util = record.get("process_util") or {}
    rest = {name: cores for name, cores in util.items() if name not in REST_EXCLUDED}
    return budget_limiter(
        record.get("frontend_util"),
        record.get("quota_cpus"),
        record.get("throttled_share"),
        record.get("other_core_busy"),
        record.get("machine_idle_cores"),
        rest,
    )


def frontend_limited(record: Mapping[str, Any]) -> bool:
    """Whether a budgeted window was limited by the frontend's quota alone (recomputed if not stored)."""
    if "frontend_limited" in record:
        return bool(record["frontend_limited"])
    return classify_budget_window(record)[1]


def machine_reason(machine_idle_cores: float | None) -> str:
    """'' unless the machine had no idle CPU left over the window."""
    if machine_idle_cores is not None and machine_idle_cores < IDLE:
        return f"machine CPU (idle {machine_idle_cores:.2f} core)"
    return ""


def placement_of(record: Mapping[str, Any]) -> str:
    """Rounds written before placements existed were all pinned."""
    return record.get("placement", PINNED)


def placements_in(rounds: Iterable[Mapping[str, Any]]) -> list[str]:
    present = {placement_of(r) for r in rounds}
    return [p for p in PLACEMENT_ORDER if p in present] + sorted(present - set(PLACEMENT_ORDER))


def by_placement(rounds: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    return {p: [r for r in rounds if placement_of(r) == p] for p in placements_in(rounds)}


# ---------------------------------------------------------------- aggregation


def summarize_rounds(
    rounds: Sequence[Mapping[str, Any]], metrics: Iterable[str] = METRICS
) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{mode: {scenario: {server: {metric: summary}}}} over every round record."""
    metrics = tuple(metrics)
    grouped: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for record in rounds:
        grouped.setdefault((record["mode"], record["scenario"], record["server"]), []).append(record)
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for (mode, scenario, server), records in grouped.items():
        out.setdefault(mode, {}).setdefault(scenario, {})[server] = {
            m: summarize(r.get(m) for r in records) for m in metrics
        }
    return out


def paired_ratios(
    rounds: Sequence[Mapping[str, Any]],
    mode: str,
    scenario: str,
    metric: str,
    numerator: str = NATIVE,
    denominator: str = GRPCIO,
) -> dict[str, Any]:
    """numerator/denominator of `metric` per round pair (round r of one server against round r of the other).

    Consecutive rounds alternate the servers, so a pair saw the same machine drift; the result summarizes the
    per-pair ratios (median [min, max]).
    """
    by_round: dict[int, dict[str, float | None]] = {}
    for r in rounds:
        if r["mode"] == mode and r["scenario"] == scenario and r["server"] in (numerator, denominator):
            by_round.setdefault(r["round"], {})[r["server"]] = r.get(metric)
    values = [ratio(pair.get(numerator), pair.get(denominator)) for _, pair in sorted(by_round.items())]
    return summarize(values)


def median_ratio(
    summary: Mapping[str, Any],
    mode: str,
    scenario: str,
    metric: str,
    numerator: str = NATIVE,
    denominator: str = GRPCIO,
) -> float | None:
    """Ratio of the two servers' medians of `metric` (None when either is missing)."""
    try:
        servers = summary[mode][scenario]
        return ratio(servers[numerator][metric]["median"], servers[denominator][metric]["median"])
    except KeyError:
        return None


def compare_tokens(hashes: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """hashes: {server: {request_id: digest of its token ids}}. Compares the requests both servers completed."""
    servers = [s for s in SERVERS if s in hashes] or sorted(hashes)
    if len(servers) < 2:
        return {"compared": 0, "mismatched": 0, "mismatched_ids": [], "only_one_server": 0}
    a, b = hashes[servers[0]], hashes[servers[1]]
    common = a.keys() & b.keys()
    mismatched = sorted(rid for rid in common if a[rid] != b[rid])
    return {
        "compared": len(common),
        "mismatched": len(mismatched),
        "mismatched_ids": mismatched[:20],
        "only_one_server": len(a.keys() ^ b.keys()),
    }


def scenario_name(workload: str, connections: int) -> str:
    return f"{workload}-c{connections}"


def evaluate_targets(
    summary: Mapping[str, Any],
    rounds: Sequence[Mapping[str, Any]],
    identical: Mapping[str, Mapping[str, Any]],
    connections: Sequence[int],
) -> list[dict[str, Any]]:
    """The report's targets, each {name, value, op, threshold, verdict, detail}.

    summary: {placement: {mode: {scenario: {server: {metric: summary}}}}} (see `build_result`). Per placement
    with fixed-load rounds: CPU per token and TTFT p99 ratios; full-core saturation where it ran; the budgeted
    saturation's ratio in its worst frontend-limited round; the native floor from the pinned baseline; errors and
    tokens overall.
    """
    targets: list[dict[str, Any]] = []
    groups = by_placement(rounds)

    def add(name: str, value: float | None, op: str, threshold: float, detail: str = "") -> None:
        targets.append(
            {
                "name": name,
                "value": value,
                "op": op,
                "threshold": threshold,
                "verdict": verdict(value, op, threshold),
                "detail": detail,
            }
        )

    for placement in placements_in(rounds):
        stack = summary.get(placement, {}).get("stack", {})
        place_rounds = groups[placement]
        for c in connections:
            fixed = scenario_name("fixed", c)
            if fixed in stack:
                pair = paired_ratios(place_rounds, "stack", fixed, "cpu_us_per_token")
                add(
                    f"{placement}: CPU/token native/grpcio at fixed load, {c} conn",
                    median_ratio(summary[placement], "stack", fixed, "cpu_us_per_token"),
                    "<=",
                    TARGET_CPU_RATIO,
                    _pair_detail(pair),
                )
        for c in connections:
            fixed = scenario_name("fixed", c)
            if fixed in stack:
                add(
                    f"{placement}: TTFT p99 native/grpcio at fixed load, {c} conn",
                    median_ratio(summary[placement], "stack", fixed, "ttft_p99_ms"),
                    "<=",
                    TARGET_TTFT_RATIO,
                )
        for c in sorted({r["connections"] for r in place_rounds if r["workload"] == "saturation"}, reverse=True):
            sat = scenario_name("saturation", c)
            pair = paired_ratios(place_rounds, "stack", sat, "tokens_per_s")
            if placement == BUDGET:
                valid = budget_valid_rounds(place_rounds, sat)
                valid_pair = paired_ratios(
                    [r for r in place_rounds if valid.get(r["round"])], "stack", sat, "tokens_per_s"
                )
                add(
                    f"budget: saturation tokens/s native/grpcio, {c} conn, worst frontend-limited round",
                    valid_pair["min"],
                    ">=",
                    TARGET_SATURATION_RATIO,
                    _budget_detail(valid, valid_pair, pair),
                )
            else:
                add(
                    f"{placement}: saturation tokens/s native/grpcio, {c} conn (full cores)",
                    median_ratio(summary[placement], "stack", sat, "tokens_per_s"),
                    ">=",
                    TARGET_SATURATION_RATIO,
                    _pair_detail(pair),
                )
    pinned = summary.get(PINNED, {})
    for c in connections:
        fixed = scenario_name("fixed", c)
        try:
            stack_cpu = pinned["stack"][fixed][NATIVE]["cpu_us_per_token"]["median"]
            floor = pinned["baseline"][fixed][NATIVE]["cpu_us_per_token"]["median"]
        except KeyError:
            continue
        value = ratio(stack_cpu, floor)
        detail = "" if value is None else f"{stack_cpu:.1f} µs vs bare {floor:.1f} µs/message"
        add(
            f"pinned: native CPU/token / bare per-message floor, fixed load, {c} conn",
            value,
            "<=",
            TARGET_FLOOR_MULTIPLE,
            detail,
        )
    total_errors = sum(int(r.get("errors") or 0) for r in rounds)
    add("errors (all rounds, both servers, every mode)", float(total_errors), "==", 0.0)
    compared = sum(v["compared"] for v in identical.values())
    mismatched = sum(v["mismatched"] for v in identical.values())
    add(
        "requests with different tokens on the two servers",
        float(mismatched) if compared else None,
        "==",
        0.0,
        f"{compared} requests compared",
    )
    return targets


def budget_valid_rounds(rounds: Sequence[Mapping[str, Any]], scenario: str) -> dict[int, bool]:
    """{round: both servers' windows limited by the frontend's quota alone} for a budgeted scenario; only those
    rounds' ratios measure the servers."""
    by_round: dict[int, dict[str, Mapping[str, Any]]] = {}
    for r in rounds:
        if r["mode"] == "stack" and r["scenario"] == scenario and r["server"] in SERVERS:
            by_round.setdefault(r["round"], {})[r["server"]] = r
    return {
        number: all(s in pair and frontend_limited(pair[s]) for s in SERVERS)
        for number, pair in sorted(by_round.items())
    }


def _budget_detail(valid: Mapping[int, bool], valid_pair: Mapping[str, Any], every_pair: Mapping[str, Any]) -> str:
    counted = f"{sum(valid.values())} of {len(valid)} rounds frontend-limited in both windows"
    if valid_pair.get("median") is not None:
        counted += f" ({_pair_detail(valid_pair)})"
    if every_pair.get("median") is not None and not all(valid.values()):
        counted += f"; every round, including those that do not measure the servers: {_pair_detail(every_pair)}"
    return counted


def _pair_detail(pair: Mapping[str, Any]) -> str:
    if pair.get("median") is None:
        return ""
    return f"per round pair: median {pair['median']:.2f}, min {pair['min']:.2f}, max {pair['max']:.2f} ({pair['n']})"


# ---------------------------------------------------------------- formatting


def fmt_number(value: float | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and math.isnan(value):
        return "–"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_range(summary: Mapping[str, Any] | None) -> str:
    """'median [min–max]'; only the median when the range is a single value."""
    if not summary or summary.get("median") is None:
        return "–"
    med, lo, hi = summary["median"], summary["min"], summary["max"]
    if summary.get("n", 0) <= 1 or lo == hi:
        return fmt_number(med)
    return f"{fmt_number(med)} [{fmt_number(lo)}–{fmt_number(hi)}]"


def fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown pipe table with padded columns (reads well in a terminal too)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) + " |"

    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), separator, *(line(row) for row in cells[1:])])


def metric_title(metric: str) -> str:
    title, unit = METRICS[metric]
    return f"{title} ({unit})" if unit not in ("count", "fraction", "1/s", "ratio") else title


def scenario_table(
    summary: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]], mode: str, columns: Sequence[str]
) -> str:
    """One row per scenario and server (median [min–max]) plus a native/grpcio row of per-pair ratios."""
    headers = ["scenario", "server", "rounds", *(metric_title(m) for m in columns)]
    rows: list[list[str]] = []
    for scenario in sorted(summary.get(mode, {}), key=_scenario_order):
        servers = summary[mode][scenario]
        for server in [s for s in SERVERS if s in servers]:
            n = max((servers[server][m]["n"] for m in columns), default=0)
            rows.append([scenario, server, str(n), *(fmt_range(servers[server][m]) for m in columns)])
        if all(s in servers for s in SERVERS):
            ratio_cells = []
            for m in columns:
                if m == "errors":
                    ratio_cells.append("")
                    continue
                pair = paired_ratios(rounds, mode, scenario, m)
                ratio_cells.append(_fmt_ratio_range(pair))
            rows.append([scenario, "native/grpcio", "", *ratio_cells])
    return format_table(headers, rows)


def _fmt_ratio_range(pair: Mapping[str, Any]) -> str:
    if pair.get("median") is None:
        return "–"
    if pair["n"] <= 1 or pair["min"] == pair["max"]:
        return f"{pair['median']:.2f}×"
    return f"{pair['median']:.2f}× [{pair['min']:.2f}–{pair['max']:.2f}]"


def _scenario_order(name: str) -> tuple[int, int]:
    workload, _, conns = name.partition("-c")
    return (0 if workload == "fixed" else 1, -int(conns) if conns.isdigit() else 0)


def process_table(rounds: Sequence[Mapping[str, Any]], mode: str = "stack") -> str:
    """Median CPU utilisation (cores) per process group and scenario/server, and what limited the round."""
    groups: list[str] = []
    by_key: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rounds:
        if r["mode"] != mode:
            continue
        by_key.setdefault((r["scenario"], r["server"]), []).append(r)
        for g in r.get("process_util", {}):
            if g not in groups:
                groups.append(g)
    headers = ["scenario", "server", *(f"{g} (cores)" for g in groups), "limited by"]
    rows = []
    for scenario, server in sorted(
        by_key, key=lambda k: (_scenario_order(k[0]), SERVERS.index(k[1]) if k[1] in SERVERS else 9)
    ):
        records = by_key[(scenario, server)]
        cells = [fmt_number(summarize(r.get("process_util", {}).get(g) for r in records)["median"]) for g in groups]
        if all(placement_of(r) == BUDGET for r in records):  # one verdict per window: in the round table
            limits = [
                f"frontend quota alone in {sum(frontend_limited(r) for r in records)} of {len(records)} "
                "windows (each window's verdict: round table above)"
            ]
        else:
            limits = sorted({r.get("bottleneck", "unknown") for r in records})
        rows.append([scenario, server, *cells, "; ".join(limits)])
    return format_table(headers, rows)


def thread_table(rounds: Sequence[Mapping[str, Any]], mode: str = "stack") -> str:
    """Median cores per frontend thread name, per scenario and server (where the frontend's CPU goes)."""
    names: list[str] = []
    by_key: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in rounds:
        if r["mode"] != mode:
            continue
        by_key.setdefault((r["scenario"], r["server"]), []).append(r)
        for name, value in r.get("frontend_threads_util", {}).items():
            if name not in names and value >= 0.005:
                names.append(name)
    rows = []
    for scenario, server in sorted(by_key, key=lambda k: (_scenario_order(k[0]), k[1])):
        records = by_key[(scenario, server)]
        rows.append(
            [
                scenario,
                server,
                *(
                    fmt_number(summarize(r.get("frontend_threads_util", {}).get(n) for r in records)["median"])
                    for n in names
                ),
            ]
        )
    return format_table(["scenario", "server", *(f"{n} (cores)" for n in names)], rows)


def targets_table(targets: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for t in targets:
        value = t["value"]
        if value is None:
            shown = "–"
        elif t["op"] == "==":
            shown = f"{value:.0f}"
        else:
            shown = f"{value:.2f}"
        threshold = f"{t['threshold']:.0f}" if t["op"] == "==" else f"{t['threshold']:.2f}"
        rows.append([t["verdict"], t["name"], shown, f"{t['op']} {threshold}", t.get("detail", "")])
    return format_table(["verdict", "target", "value", "wanted", "detail"], rows)


def round_table(rounds: Sequence[Mapping[str, Any]], metric: str = "tokens_per_s") -> str:
    """One row per round pair of every budgeted saturation scenario: each server's value and tokens per message,
    the ratio, whether it measures the servers (both windows limited by the frontend's quota alone), what limited
    each window; then per scenario the rounds that count."""
    rows = []
    by_key: dict[tuple[str, int], dict[str, Mapping[str, Any]]] = {}
    for r in rounds:
        if r["mode"] == "stack" and r["workload"] == "saturation":
            by_key.setdefault((r["scenario"], r["round"]), {})[r["server"]] = r
    for (scenario, number), servers in sorted(by_key.items(), key=lambda kv: (_scenario_order(kv[0][0]), kv[0][1])):
        g, n = servers.get(GRPCIO, {}), servers.get(NATIVE, {})
        not_limited = [name for name, w in (("grpcio", g), ("native", n)) if not (w and frontend_limited(w))]
        counts = (
            "yes"
            if not not_limited
            else (f"no ({' and '.join(not_limited)} not limited by the frontend alone): not a measure of the servers")
        )
        rows.append(
            [
                scenario,
                str(number),
                fmt_number(g.get(metric)),
                fmt_number(n.get(metric)),
                fmt_ratio(ratio(n.get(metric), g.get(metric))),
                counts,
                fmt_number(g.get("tokens_per_message")),
                fmt_number(n.get("tokens_per_message")),
                g.get("bottleneck", "–"),
                n.get("bottleneck", "–"),
            ]
        )
    table = format_table(
        [
            "scenario",
            "round",
            f"grpcio {METRICS[metric][0]}",
            f"native {METRICS[metric][0]}",
            "native/grpcio",
            "measures the servers",
            "grpcio tokens/message",
            "native tokens/message",
            "grpcio limited by",
            "native limited by",
        ],
        rows,
    )
    lines = [table, ""]
    for scenario in sorted({key[0] for key in by_key}, key=_scenario_order):
        valid = budget_valid_rounds(rounds, scenario)
        pair = paired_ratios([r for r in rounds if valid.get(r["round"])], "stack", scenario, metric)
        lines.append(
            f"{scenario}: {sum(valid.values())} of {len(valid)} rounds frontend-limited in both windows "
            f"(frontend at ≥ {QUOTA_USED * 100:.0f} % of its quota, the other cores below "
            f"{OTHER_BUSY_MAX:.2f} busy); native/grpcio over them: "
            f"{_fmt_ratio_range(pair)} (the target counts only these)"
        )
    return "\n".join(lines)


def render(result: Mapping[str, Any]) -> str:
    """The whole text report of a result dict (see `build_result`): one section per placement."""
    rounds = result["rounds"]
    parts = [f"# openengine-bench ({'quick' if result['meta'].get('quick') else 'full'} run)", ""]
    meta = result["meta"]
    wake_up = meta.get("wake_up_cpu_us")
    parts.append(
        f"machine: {meta.get('nproc')} cores, {meta.get('cpu_model')}, Python {meta.get('python')}"
        f"{'' if wake_up is None else f', a thread wake-up costs {wake_up:g} µs of CPU'}; "
        f"frontend CPUs {meta.get('frontend_cpus')} (when pinned), everything else on "
        f"{meta.get('other_cpus')}; quota {meta.get('quota_cpus', '–')} CPU, budget "
        f"{meta.get('budget_cpus', '–')} CPU with {meta.get('budget_inflight') or meta.get('inflight')} "
        "in flight"
    )
    parts.append(
        f"workload: {meta.get('prompt_tokens')} prompt tokens, {meta.get('output_tokens')} output tokens "
        f"per request, engine step {meta.get('step_ms')} ms; fixed load {meta.get('rate')} req/s, "
        f"saturation {meta.get('inflight')} in flight; windows: fixed {meta.get('fixed_window_s')} s, "
        f"saturation {meta.get('saturation_window_s')} s, baseline {meta.get('baseline_window_s')} s"
    )
    for placement, place_rounds in by_placement(rounds).items():
        summary = result["summary"].get(placement, {})
        columns = STACK_COLUMNS if placement == PINNED else UNPINNED_COLUMNS
        parts.append("")
        parts.append(
            f"## Placement `{placement}`: {PLACEMENT_TITLES.get(placement, placement)}; median [min–max] over rounds"
        )
        parts.append(scenario_table(summary, place_rounds, "stack", columns))
        if placement == BUDGET:
            parts.append("")
            parts.append("### Budgeted saturation, round by round")
            parts.append(round_table(place_rounds))
        if "baseline" in summary:
            parts.append("")
            parts.append(
                "### Baseline: trivial streaming servicer (same server options, same client, same "
                "placement); 'CPU/token' = CPU per streamed message"
            )
            parts.append(scenario_table(summary, place_rounds, "baseline", BASELINE_COLUMNS))
        parts.append("")
        parts.append("### CPU by process (cores busy over the window, median) and what limited each scenario")
        parts.append(process_table(place_rounds, "stack"))
        if "baseline" in summary:
            parts.append("")
            parts.append(process_table(place_rounds, "baseline"))
        parts.append("")
        parts.append(
            "### Frontend CPU by thread name (cores, median); event_engine: grpcio's internal channels "
            "to node and coordinator; grpc-native-io: pygrpc-native's Rust I/O threads"
        )
        parts.append(thread_table(place_rounds, "stack"))
    parts.append("")
    parts.append("## Identical tokens on both servers (same request ids and seeds)")
    parts.append(
        format_table(
            ["placement/scenario", "compared", "mismatched", "completed on one server only"],
            [
                [s, v["compared"], v["mismatched"], v["only_one_server"]]
                for s, v in sorted(result["identical"].items(), key=lambda kv: _identical_order(kv[0]))
            ],
        )
    )
    parts.append("")
    parts.append("## Targets (compared, not asserted)")
    parts.append(targets_table(result["targets"]))
    comparison = result.get("published")
    if comparison and comparison["rows"]:
        parts.append("")
        parts.append(
            f"## Against the published figures ({comparison['source']}): CPU/token native/grpcio per round pair, "
            "median [min–max]"
        )
        parts.append(published_table(comparison))
    for server, scenarios in result.get("profiles", {}).items():
        for scenario, prof in scenarios.items():
            parts.append("")
            parts.append(
                f"## Profile: frontend on {server}, {scenario}: asyncio loop thread, "
                f"{prof['samples']} busy samples (py-spy; flame graph {prof.get('file', '')})"
            )
            parts.append(profile_table(prof, "self"))
            parts.append("")
            parts.append(profile_table(prof, "inclusive", 25))
    return "\n".join(parts)


def _identical_order(key: str) -> tuple[int, tuple[int, int]]:
    placement, _, scenario = key.rpartition("/")
    placement = placement or PINNED
    rank = PLACEMENT_ORDER.index(placement) if placement in PLACEMENT_ORDER else len(PLACEMENT_ORDER)
    return rank, _scenario_order(scenario)


# ---------------------------------------------------------------- profiles (py-spy raw / collapsed stacks)


def _function_of(frame: str) -> str:
    """'Handle._run (asyncio/events.py:80)' -> 'Handle._run (asyncio/events.py)'; line numbers merged."""
    name, sep, location = frame.partition(" (")
    if not sep:
        return frame.strip() or "<native/unknown>"
    file = location.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({file})"


def profile_summary(
    collapsed: str, top: int = 20, skip_idle: bool = True, main_thread_only: bool = True
) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's raw (collapsed stack) output.

    Each line is 'frame;frame;...;leaf COUNT' with the root first. Samples whose leaf is an idle wait (the
    event loop's epoll/select) are counted as `idle_samples` and left out of the shares when skip_idle is set.
    With main_thread_only, stacks of other threads (rooted in threading's `_bootstrap`) are counted as
    `other_thread_samples` and left out too: py-spy cannot tell that a thread blocked inside native code
    (grpc's poller, pygrpc-native's dispatch thread, idle executor workers) is idle, so their samples are
    mostly waiting, not work; their real CPU is in the per-thread /proc accounting. The shares are then of
    the samples in which the asyncio loop thread was busy.
    """
    self_counts: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = idle = other_threads = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_function_of(f) for f in stack.split(";") if f]
        if not frames:
            continue
        if main_thread_only and frames[0].split(" (")[0].endswith("_bootstrap") and "threading" in frames[0]:
            other_threads += n
            continue
        leaf = frames[-1]
        if skip_idle and (
            leaf.startswith("EpollSelector.select")
            or leaf.startswith("select ")
            or leaf.startswith("_run_once")
            and "select" in leaf
        ):
            idle += n
            continue
        total += n
        self_counts[leaf] = self_counts.get(leaf, 0) + n
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + n

    def ranked(counts: dict[str, int]) -> list[dict[str, Any]]:
        return (
            [
                {"function": f, "share": c / total}
                for f, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
            ]
            if total
            else []
        )

    return {
        "samples": total,
        "idle_samples": idle,
        "other_thread_samples": other_threads,
        "self": ranked(self_counts),
        "inclusive": ranked(inclusive),
    }


def profile_table(summary: Mapping[str, Any], kind: str = "self", top: int = 15) -> str:
    rows = [[f"{e['share'] * 100:.1f}%", e["function"]] for e in summary.get(kind, [])[:top]]
    return format_table([f"{kind} share", "function (file)"], rows)


# ---------------------------------------------------------------- result assembly and files


def build_result(
    meta: Mapping[str, Any],
    rounds: Sequence[Mapping[str, Any]],
    hashes: Mapping[str, Mapping[str, Mapping[str, str]]],
    connections: Sequence[int],
    profiles: Mapping[str, Any] | None = None,
    published: Mapping[str, Any] | None = None,
    published_source: str = "",
) -> dict[str, Any]:
    """hashes: {placement/scenario: {server: {request_id: digest}}}. Returns the JSON-able result, with the
    summary and the ratios per placement: {placement: {mode: {scenario: ...}}}, and with `published` (an earlier
    result) the comparison of the CPU ratios with it."""
    summary: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for placement, place_rounds in by_placement(rounds).items():
        summary[placement] = summarize_rounds(place_rounds)
        for mode, scenarios in summary[placement].items():
            for scenario in scenarios:
                ratios.setdefault(placement, {}).setdefault(mode, {})[scenario] = {
                    m: {
                        "of_medians": median_ratio(summary[placement], mode, scenario, m),
                        "per_round_pair": paired_ratios(place_rounds, mode, scenario, m),
                    }
                    for m in METRICS
                    if m != "errors"
                }
    identical = {key: compare_tokens(per_server) for key, per_server in hashes.items()}
    targets = evaluate_targets(summary, rounds, identical, connections)
    return {
        "meta": dict(meta),
        "rounds": [dict(r) for r in rounds],
        "summary": summary,
        "ratios": ratios,
        "identical": identical,
        "targets": targets,
        "profiles": dict(profiles or {}),
        "published": None if published is None else against_published(ratios, published, published_source),
    }


# The last published run (docs/benchmarks.md's figures): a new run is compared with it, placement by placement.
PUBLISHED_PATH = Path(__file__).resolve().parents[2] / "docs" / "bench" / "bench.json"
PUBLISHED_METRIC = "cpu_us_per_token"


def against_published(ratios: Mapping[str, Any], published: Mapping[str, Any], source: str = "") -> dict[str, Any]:
    """native/grpcio CPU per token of this run against the published run's, for every placement and stack
    scenario both have. A ratio has moved when the two medians of the per-round-pair ratios differ by more than
    their spread: the larger of the two runs' ranges (max − min over round pairs), so that a run with one pair
    is judged by the published run's range."""
    rows = []
    for placement, modes in ratios.items():
        for scenario, metrics in modes.get("stack", {}).items():
            try:
                before = published["ratios"][placement]["stack"][scenario][PUBLISHED_METRIC]["per_round_pair"]
            except KeyError:
                continue
            now = metrics[PUBLISHED_METRIC]["per_round_pair"]
            if before.get("median") is None or now.get("median") is None:
                continue
            spread = max(before["max"] - before["min"], now["max"] - now["min"])
            change = now["median"] - before["median"]
            rows.append(
                {
                    "placement": placement,
                    "scenario": scenario,
                    "published": before,
                    "now": now,
                    "change": change,
                    "spread": spread,
                    "moved": abs(change) > spread,
                }
            )
    return {"source": source, "rows": rows}


def published_table(comparison: Mapping[str, Any]) -> str:
    rows = []
    for row in comparison["rows"]:
        moved = ("up" if row["change"] > 0 else "down") if row["moved"] else ""
        rows.append(
            [
                f"{row['placement']}/{row['scenario']}",
                _fmt_ratio_range(row["published"]),
                _fmt_ratio_range(row["now"]),
                f"{row['change']:+.2f}",
                f"{row['spread']:.2f}",
                f"MOVED {moved} beyond the spread" if moved else "within the spread",
            ]
        )
    return format_table(["placement/scenario", "published", "this run", "change", "spread", "verdict"], rows)


def write_json(result: Mapping[str, Any], path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def read_json(path: Path | str) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_chart(result: Mapping[str, Any], path: Path | str) -> Path:
    """Two panels: frontend CPU per token (with the pinned bare per-message floor) and tokens/s, both servers,
    one group of bars per placement and scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = result["summary"]
    groups = [
        (placement, scenario)
        for placement in placements_in(result["rounds"])
        for scenario in sorted(summary.get(placement, {}).get("stack", {}), key=_scenario_order)
    ]
    colors = {GRPCIO: "#4C72B0", NATIVE: "#DD8452"}
    fig, axes = plt.subplots(1, 2, figsize=(max(13, 1.6 * len(groups) * 2), 5.8))
    width = 0.2
    for panel, (ax, metric, title) in enumerate(
        zip(
            axes,
            ("cpu_us_per_token", "tokens_per_s"),
            ("frontend CPU per token (µs), lower is better", "tokens/s, higher is better"),
        )
    ):
        for i, server in enumerate(SERVERS):
            for source in ("stack", "baseline"):
                if panel == 1 and source == "baseline":
                    continue  # the bare server's messages/s dwarf the stack's tokens/s; kept in the tables
                xs, meds, lows, highs = [], [], [], []
                for k, (placement, scenario) in enumerate(groups):
                    s = summary.get(placement, {}).get(source, {}).get(scenario, {}).get(server, {}).get(metric)
                    if not s or s["median"] is None:
                        continue
                    j = 1 if source == "baseline" else 0
                    offset = (i * 2 + j - 1.5) * width if panel == 0 else (i - 0.5) * width * 2
                    xs.append(k + offset)
                    meds.append(s["median"])
                    lows.append(s["median"] - s["min"])
                    highs.append(s["max"] - s["median"])
                if not xs:
                    continue
                label = server + (" (bare server floor)" if source == "baseline" else "")
                ax.bar(
                    xs,
                    meds,
                    width if panel == 0 else width * 2,
                    yerr=[lows, highs],
                    capsize=3,
                    color=colors[server],
                    alpha=0.45 if source == "baseline" else 1.0,
                    hatch="//" if source == "baseline" else None,
                    label=label,
                    edgecolor="black",
                    linewidth=0.4,
                )
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(
            [f"{placement}\n{_scenario_label(scenario, result['meta'])}" for placement, scenario in groups], fontsize=7
        )
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.suptitle(
        "openengine-serve frontend: grpcio vs pygrpc-native by placement (median, whiskers = min–max over rounds)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _scenario_label(scenario: str, meta: Mapping[str, Any]) -> str:
    workload, _, conns = scenario.partition("-c")
    if workload == "fixed":
        return f"{meta.get('rate', '?'):g} req/s, {conns} conn"
    return f"saturation, {conns} conn"
