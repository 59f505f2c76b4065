"""The benchmark's statistics and report: pure functions over plain data."""

from __future__ import annotations

import hashlib
import math
import os
import struct
import threading
import time

import pytest

from openengine_bench import report
from openengine_bench.cgroups import QuotaCgroup
from openengine_bench.load import digest, make_jobs, merge_results, poisson_arrivals, prompt_ids, scan_response
from openengine_bench.stack import parse_cpus, parse_placements, wake_ups

G, N = report.GRPCIO, report.NATIVE


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("q, expected", [(0, 1.0), (50, 2.5), (100, 4.0), (25, 1.75), (99, 3.97)])
def test_percentile_interpolates_linearly(q, expected):
    assert report.percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_edge_cases():
    assert report.percentile([], 50) is None
    assert report.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        report.percentile([1.0], 101)


def test_percentile_matches_numpy_default():
    numpy = pytest.importorskip("numpy")
    values = [((i * 7919) % 1000) / 7.0 for i in range(1001)]
    for q in (1, 50, 90, 99, 99.9):
        assert report.percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


def test_summarize_gives_median_and_range_and_skips_missing():
    assert report.summarize([3.0, 1.0, 2.0, None, float("nan")]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert report.summarize([1.0, 2.0]) == {"median": 1.5, "min": 1.0, "max": 2.0, "n": 2}
    assert report.summarize([None]) == {"median": None, "min": None, "max": None, "n": 0}


def test_ratio_and_verdict():
    assert report.ratio(1.0, 4.0) == 0.25
    assert report.ratio(1.0, 0.0) is None
    assert report.ratio(None, 1.0) is None
    assert report.verdict(0.69, "<=", 0.70) == "PASS"
    assert report.verdict(0.71, "<=", 0.70) == "MISS"
    assert report.verdict(1.6, ">=", 1.6) == "PASS"
    assert report.verdict(0.0, "==", 0.0) == "PASS"
    assert report.verdict(None, ">=", 1.6) == "N/A"


def test_latency_stats_in_milliseconds():
    stats = report.latency_stats([0.001, 0.002, 0.003])
    assert stats["p50_ms"] == pytest.approx(2.0)
    assert stats["n"] == 3
    assert report.latency_stats([]) == {"p50_ms": None, "p99_ms": None, "n": 0}


def test_bottleneck_names_the_saturated_side():
    assert report.bottleneck(0.97, 0.99, 0.5, "saturation") == "frontend"
    assert report.bottleneck(0.4, 0.99, 0.5, "fixed").startswith("frontend core, shared with foreign load")
    assert report.bottleneck(0.5, 0.5, 0.95, "saturation").startswith("other core")
    assert report.bottleneck(0.3, 0.3, 0.3, "fixed").startswith("none")
    assert report.bottleneck(None, 0.3, 0.3, "fixed") == "unknown"


# ---------------------------------------------------------------- aggregation and targets


def _round(server, r, scenario="fixed-c32", mode="stack", **metrics):
    workload, _, conns = scenario.partition("-c")
    base = {
        "mode": mode,
        "scenario": scenario,
        "workload": workload,
        "connections": int(conns),
        "server": server,
        "round": r,
        "errors": 0,
    }
    base.update(metrics)
    return base


def _rounds():
    rounds = []
    for c in (32, 1):
        for r, (g, n) in enumerate([(100.0, 60.0), (110.0, 66.0), (90.0, 63.0)], start=1):
            rounds.append(_round(G, r, f"fixed-c{c}", cpu_us_per_token=g, tokens_per_s=5000.0, ttft_p99_ms=20.0))
            rounds.append(_round(N, r, f"fixed-c{c}", cpu_us_per_token=n, tokens_per_s=5000.0, ttft_p99_ms=18.0))
            rounds.append(_round(G, r, f"saturation-c{c}", cpu_us_per_token=g, tokens_per_s=8000.0))
            rounds.append(_round(N, r, f"saturation-c{c}", cpu_us_per_token=n, tokens_per_s=14000.0))
        rounds.append(_round(G, 1, f"fixed-c{c}", mode="baseline", cpu_us_per_token=50.0, tokens_per_s=5100.0))
        rounds.append(_round(N, 1, f"fixed-c{c}", mode="baseline", cpu_us_per_token=30.0, tokens_per_s=5100.0))
    return rounds


def test_summarize_rounds_groups_by_mode_scenario_server():
    summary = report.summarize_rounds(_rounds())
    cpu = summary["stack"]["fixed-c32"][G]["cpu_us_per_token"]
    assert cpu == {"median": 100.0, "min": 90.0, "max": 110.0, "n": 3}
    assert summary["baseline"]["fixed-c1"][N]["cpu_us_per_token"]["median"] == 30.0
    assert summary["stack"]["saturation-c32"][G]["ttft_p99_ms"]["n"] == 0


def test_ratios_of_medians_and_per_round_pairs():
    rounds = _rounds()
    summary = report.summarize_rounds(rounds)
    assert report.median_ratio(summary, "stack", "fixed-c32", "cpu_us_per_token") == pytest.approx(0.63)
    pairs = report.paired_ratios(rounds, "stack", "fixed-c32", "cpu_us_per_token")
    assert pairs["n"] == 3
    assert pairs["min"] == pytest.approx(0.6)
    assert pairs["max"] == pytest.approx(0.7)
    assert report.median_ratio(summary, "stack", "nope", "cpu_us_per_token") is None


def test_compare_tokens():
    same = report.compare_tokens({G: {"a": "1", "b": "2", "c": "3"}, N: {"a": "1", "b": "2", "d": "4"}})
    assert same == {"compared": 2, "mismatched": 0, "mismatched_ids": [], "only_one_server": 2}
    differ = report.compare_tokens({G: {"a": "1"}, N: {"a": "9"}})
    assert differ["mismatched"] == 1 and differ["mismatched_ids"] == ["a"]
    assert report.compare_tokens({G: {"a": "1"}})["compared"] == 0


def test_targets_pass_and_miss():
    rounds = _rounds()
    summary = {"pinned": report.summarize_rounds(rounds)}
    identical = {"pinned/fixed-c32": {"compared": 10, "mismatched": 0}}
    targets = {t["name"]: t for t in report.evaluate_targets(summary, rounds, identical, [32, 1])}
    assert targets["pinned: CPU/token native/grpcio at fixed load, 32 conn"]["verdict"] == "PASS"  # 0.63
    assert targets["pinned: saturation tokens/s native/grpcio, 1 conn (full cores)"]["verdict"] == "PASS"  # 1.75
    floor = targets["pinned: native CPU/token / bare per-message floor, fixed load, 32 conn"]
    assert floor["value"] == pytest.approx(63.0 / 30.0) and floor["verdict"] == "MISS"
    assert targets["pinned: TTFT p99 native/grpcio at fixed load, 1 conn"]["verdict"] == "MISS"  # 0.9
    assert targets["errors (all rounds, both servers, every mode)"]["verdict"] == "PASS"
    assert targets["requests with different tokens on the two servers"]["verdict"] == "PASS"
    rounds.append(_round(N, 9, "fixed-c32", errors=2))
    targets = {t["name"]: t for t in report.evaluate_targets(summary, rounds, {}, [32])}
    assert targets["errors (all rounds, both servers, every mode)"]["verdict"] == "MISS"
    assert targets["requests with different tokens on the two servers"]["verdict"] == "N/A"


def _placed_rounds():
    """Fixed load in the quota placement and budgeted saturation whose second round misses 1.6x."""
    rounds = []
    for r, (g, n) in enumerate([(150.0, 90.0), (160.0, 100.0)], start=1):
        for c in (32, 1):
            rounds.append(_round(G, r, f"fixed-c{c}", placement="quota", cpu_us_per_token=g, ttft_p99_ms=100.0))
            rounds.append(_round(N, r, f"fixed-c{c}", placement="quota", cpu_us_per_token=n, ttft_p99_ms=40.0))
    for r, (g, n) in enumerate([(2000.0, 3600.0), (2500.0, 3500.0), (2000.0, 3400.0)], start=1):
        rounds.append(_budget_round(G, r, g, other_core_busy=0.6))
        rounds.append(_budget_round(N, r, n, other_core_busy=0.7))
    return rounds


def _budget_round(server, r, tokens_per_s, other_core_busy, frontend_util=0.25, **metrics):
    record = _round(
        server,
        r,
        "saturation-c32",
        placement="budget",
        tokens_per_s=tokens_per_s,
        quota_cpus=0.25,
        frontend_util=frontend_util,
        throttled_share=0.95,
        other_core_busy=other_core_busy,
        machine_idle_cores=0.5,
        tokens_per_message=12.0,
        process_util={
            "frontend": frontend_util,
            "node": 0.3,
            "load generator": 0.4,
            "engine": 0.2,
            "idle (all cores)": 0.5,
        },
        **metrics,
    )
    record["bottleneck"], record["frontend_limited"] = report.classify_budget_window(record)
    return record


def test_targets_per_placement_and_budget_worst_round():
    rounds = _placed_rounds()
    result = report.build_result({}, rounds, {}, [32, 1])
    targets = {t["name"]: t for t in result["targets"]}
    assert targets["quota: CPU/token native/grpcio at fixed load, 32 conn"]["value"] == pytest.approx(95 / 155)
    assert targets["quota: TTFT p99 native/grpcio at fixed load, 1 conn"]["verdict"] == "PASS"  # 0.4
    worst = targets["budget: saturation tokens/s native/grpcio, 32 conn, worst frontend-limited round"]
    assert worst["value"] == pytest.approx(1.4) and worst["verdict"] == "MISS"  # median 1.7 would pass
    assert worst["detail"].startswith("3 of 3 rounds frontend-limited in both windows")
    assert "median 1.70" in worst["detail"]
    assert not any(name.startswith("pinned") for name in targets)  # no pinned rounds: no pinned targets
    assert set(result["summary"]) == {"quota", "budget"}


def test_render_has_one_section_per_placement_and_the_budget_rounds():
    text = report.render(report.build_result({"rate": 40}, _placed_rounds() + _rounds(), {}, [32, 1]))
    sections = [line for line in text.splitlines() if line.startswith("## Placement")]
    assert [s.split("`")[1] for s in sections] == ["pinned", "quota", "budget"]
    assert "### Budgeted saturation, round by round" in text
    assert "| saturation-c32 | 2     | 2,500" in text and "1.40×" in text
    assert "frontend quota (0.25 of 0.25 CPU, throttled in 95 % of periods); other cores 0.60 busy" in text
    assert "saturation-c32: 3 of 3 rounds frontend-limited in both windows" in text
    assert "frontend quota alone in 3 of 3 windows" in text


def test_the_machine_line_says_what_a_wake_up_costs_when_it_was_measured():
    def machine_line(meta):
        return report.render(report.build_result(meta, _rounds(), {}, [32, 1])).splitlines()[2]

    assert ", a thread wake-up costs 41.5 µs of CPU;" in machine_line({"rate": 40, "wake_up_cpu_us": 41.5})
    assert "wake-up" not in machine_line({"rate": 40})  # a result from before the probe, re-rendered


def test_the_wake_up_probe_measures_a_positive_cpu_time_per_sleep():
    from openengine_bench.cli import wake_up_cpu_us

    assert 0 < wake_up_cpu_us([min(os.sched_getaffinity(0))]) < 2000  # µs; 2 ms sleeps cannot cost more


# ---------------------------------------------------------------- budgeted saturation: what limited a window

REST = {"load generator": 0.45, "node": 0.3, "engine": 0.2, "coordinator": 0.02}


def test_budget_window_is_frontend_limited_only_at_quota_with_headroom():
    text, limited = report.budget_limiter(0.25, 0.25, 0.97, 0.60, 0.9, REST)
    assert limited and text == "frontend quota (0.25 of 0.25 CPU, throttled in 97 % of periods); other cores 0.60 busy"
    # "nearly" its quota: 90 % of it counts, below does not
    assert report.budget_limiter(0.226, 0.25, 0.5, 0.6, 0.9, REST)[1]
    text, limited = report.budget_limiter(0.20, 0.25, 0.3, 0.6, 0.9, REST)
    assert not limited and "not the frontend: 0.20 of its 0.25-CPU quota, below 90 %" in text
    assert "not the rest: other cores 0.60 busy" in text


def test_budget_window_with_a_busy_other_core_is_not_frontend_limited():
    # The seventh run's 0.81x round: native at its quota while the other core was full.
    text, limited = report.budget_limiter(
        0.48, 0.5, 0.79, 1.00, 0.53, {**REST, "steal (all cores)": 0.21, "irq+softirq (all cores)": 0.01}
    )
    assert not limited
    assert text.startswith(
        "rest of the machine (other cores 1.00 busy, headroom needs below 0.85; "
        "load generator 0.45, node 0.30, steal (all cores) 0.21, engine 0.20)"
    )
    assert text.endswith("; frontend quota (0.48 of 0.5 CPU, throttled in 79 % of periods)")
    assert "coordinator" not in text and "irq" not in text  # below 0.05 core: not named
    assert not report.budget_limiter(0.5, 0.5, 1.0, 0.85, 0.5, REST)[1]  # the threshold itself is no headroom
    text, limited = report.budget_limiter(0.3, 0.5, 0.1, 0.95, 0.1, REST)
    assert not limited and "rest of the machine" in text and "not the frontend" in text


def test_budget_window_without_cores_of_its_own_uses_machine_idle():
    assert report.budget_limiter(0.5, 0.5, 1.0, None, 0.40, REST) == (
        "frontend quota (0.50 of 0.5 CPU, throttled in 100 % of periods); machine idle 0.40 core",
        True,
    )
    text, limited = report.budget_limiter(0.5, 0.5, 1.0, None, 0.05, REST)
    assert not limited and text.startswith("rest of the machine (machine idle 0.05 core, headroom needs at least 0.15")
    assert report.budget_limiter(0.5, 0.5, 1.0, None, None, REST) == ("unknown (no per-core figures)", False)
    assert not report.budget_limiter(None, 0.5, None, 0.5, 0.5, REST)[1]


def test_budget_verdict_from_a_stored_record_and_rounds_that_count():
    rounds = [
        _budget_round(G, 1, 2000.0, 0.6),
        _budget_round(N, 1, 3600.0, 0.7),
        _budget_round(G, 2, 2500.0, 0.6),
        _budget_round(N, 2, 2000.0, 0.97),  # 0.8x, rest was full
        _budget_round(G, 3, 2000.0, 0.6, frontend_util=0.1),
        _budget_round(N, 3, 3400.0, 0.6),
    ]
    assert [r["frontend_limited"] for r in rounds] == [True, True, True, False, False, True]
    stored = {k: v for k, v in rounds[3].items() if k not in ("frontend_limited", "bottleneck")}  # older JSON
    assert report.frontend_limited(stored) is False
    assert "frontend" not in report.classify_budget_window(stored)[0].split("; ")[0]  # the rest, named first
    assert report.budget_valid_rounds(rounds, "saturation-c32") == {1: True, 2: False, 3: False}
    targets = {t["name"]: t for t in report.build_result({}, rounds, {}, [32])["targets"]}
    worst = targets["budget: saturation tokens/s native/grpcio, 32 conn, worst frontend-limited round"]
    assert worst["value"] == pytest.approx(1.8) and worst["verdict"] == "PASS"  # the 0.8x round does not count
    assert worst["detail"].startswith("1 of 3 rounds frontend-limited in both windows")
    assert (
        "every round, including those that do not measure the servers: per round pair: median 1.70, min 0.80"
        in worst["detail"]
    )
    all_valid = report.build_result({}, rounds[:2], {}, [32])["targets"]
    (budget,) = [t for t in all_valid if t["name"].startswith("budget")]
    assert (
        budget["detail"] == "1 of 1 rounds frontend-limited in both windows (per round pair: median 1.80, min 1.80, "
        "max 1.80 (1))"
    )  # no second figure when every round counts
    table = report.round_table(rounds)
    assert "| no (native not limited by the frontend alone): not a measure of the servers |" in table
    assert "| no (grpcio not limited by the frontend alone): not a measure of the servers |" in table
    assert "saturation-c32: 1 of 3 rounds frontend-limited in both windows" in table and "1.80×" in table
    none_valid = report.build_result({}, rounds[2:4], {}, [32])["targets"]
    assert [t["verdict"] for t in none_valid if t["name"].startswith("budget")] == ["N/A"]


def test_limiter_names_quota_machine_and_backend():
    assert report.limiter("saturation", 0.49, 0.5, 0.8, 0.6, 0.3).startswith("frontend quota (0.49 of 0.5 CPU")
    assert report.limiter("saturation", 0.3, 0.5, 0.0, 0.02, 0.3) == "machine CPU (idle 0.02 core)"
    assert report.limiter("saturation", 0.3, None, None, 0.5, 0.95) == "backend (node at 0.95 core)"
    assert report.limiter("fixed", 0.3, 1.0, 0.01, 0.5, 0.3).startswith("none")
    both = report.limiter("saturation", 0.5, 0.5, 0.5, 0.05, 0.2)
    assert both.startswith("frontend quota") and "machine CPU" in both


# ---------------------------------------------------------------- formatting


def test_number_and_range_formatting():
    assert report.fmt_number(None) == "–"
    assert report.fmt_number(math.nan) == "–"
    assert report.fmt_number(12345.6) == "12,346"
    assert report.fmt_number(123.4) == "123"
    assert report.fmt_number(12.34) == "12.3"
    assert report.fmt_number(1.234) == "1.23"
    assert report.fmt_range({"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}) == "2.00 [1.00–3.00]"
    assert report.fmt_range({"median": 2.0, "min": 2.0, "max": 2.0, "n": 1}) == "2.00"
    assert report.fmt_range({"median": None}) == "–"
    assert report.fmt_ratio(0.5) == "0.50×"


def test_format_table_pads_columns():
    table = report.format_table(["a", "long header"], [["xyz", 1], ["q", None]])
    lines = table.splitlines()
    assert lines[0] == "| a   | long header |"
    assert lines[1] == "|-----|-------------|"
    assert lines[2] == "| xyz | 1           |"
    assert lines[3] == "| q   |             |"


def test_scenario_table_has_ratio_rows():
    rounds = _rounds()
    table = report.scenario_table(report.summarize_rounds(rounds), rounds, "stack", ("cpu_us_per_token", "errors"))
    assert "| fixed-c32      | grpcio        | 3      | 100 [90.0–110]" in table
    assert "| fixed-c32      | native/grpcio |        | 0.60× [0.60–0.70]" in table
    assert table.index("fixed-c32") < table.index("fixed-c1") < table.index("saturation-c32")


def test_render_and_json_round_trip(tmp_path):
    rounds = _rounds()
    hashes = {"pinned/fixed-c32": {G: {"r1": "aa"}, N: {"r1": "aa"}}}
    profile = report.profile_summary(
        "main;loop;Handle._run (asyncio/events.py:80) 6\n"
        "main;loop;on_event (stream.py:10) 3\nmain;loop;EpollSelector.select "
        "(selectors.py:468) 9\n"
    )
    result = report.build_result(
        {"quick": True, "nproc": 2, "rate": 40, "inflight": 512}, rounds, hashes, [32, 1], {G: {"fixed-c32": profile}}
    )
    text = report.render(result)
    assert "## Targets" in text and "PASS" in text and "Profile: frontend on grpcio" in text
    path = report.write_json(result, tmp_path / "out" / "bench.json")
    back = report.read_json(path)
    assert back == result
    assert back["identical"]["pinned/fixed-c32"]["compared"] == 1
    assert back["ratios"]["pinned"]["stack"]["fixed-c32"]["cpu_us_per_token"]["of_medians"] == pytest.approx(0.63)


def test_profile_summary_shares_exclude_idle():
    summary = report.profile_summary(
        "a (x.py:1);b (y.py:2) 3\na (x.py:1);b (y.py:5) 1\na (x.py:1) 4\n"
        "a (x.py:1);EpollSelector.select (selectors.py:468) 10\n"
    )
    assert summary["samples"] == 8 and summary["idle_samples"] == 10
    assert summary["self"][0] == {"function": "a (x.py)", "share": 0.5}
    assert summary["self"][1] == {"function": "b (y.py)", "share": 0.5}
    assert summary["inclusive"][0] == {"function": "a (x.py)", "share": 1.0}
    threads = report.profile_summary(
        "main (m.py:1);work (w.py:2) 3\nThread._bootstrap (threading.py:1002);Thread.run (threading.py:982) 5\n"
    )
    assert threads["samples"] == 3 and threads["other_thread_samples"] == 5
    assert threads["self"] == [{"function": "work (w.py)", "share": 1.0}]
    every = report.profile_summary(
        "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982) 5\n", main_thread_only=False
    )
    assert every["samples"] == 5


def test_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rounds = _rounds()
    result = report.build_result({"rate": 40, "inflight": 512}, rounds, {}, [32, 1])
    path = report.write_chart(result, tmp_path / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- load plan (deterministic across servers)


def test_requests_are_deterministic():
    # Pinned values: every process of every run (and both servers' rounds) must send the same load, so a
    # change of the generators changes the benchmark and must show here.
    assert prompt_ids(7, 4) == [70413, 100763, 33468, 61421]
    assert prompt_ids(8, 2) == [15551, 77016]
    assert len(prompt_ids(1, 32)) == 32 and all(1000 <= t < 101_000 for t in prompt_ids(1, 32))
    arrivals = poisson_arrivals(40, 10, "x")
    assert len(arrivals) == 365
    assert arrivals[:3] == pytest.approx([0.02490958773685633, 0.04762503441297525, 0.06413998176972889])
    arrivals = poisson_arrivals(40, 100, "y")
    assert 3400 < len(arrivals) < 4600 and arrivals == sorted(arrivals) and arrivals[-1] < 100
    # the digest of token ids: BLAKE2b-64 of their little-endian uint32 bytes, computed here independently
    assert digest([1, 2, 3]) == hashlib.blake2b(struct.pack("<3I", 1, 2, 3), digest_size=8).hexdigest()
    assert digest([1, 2, 3]) != digest([1, 2, 4])


def test_jobs_split_connections_and_requests_over_processes():
    common = dict(
        target="t",
        start_at=0,
        t0=1,
        t1=2,
        stop_at=2,
        drain_timeout_s=1,
        id_prefix="p",
        key_base=0,
        prompt_tokens=32,
        output_tokens=128,
    )
    jobs = make_jobs(kind="fixed", connections=32, procs=2, arrivals=[0.1 * k for k in range(10)], **common)
    assert [j["index"] for j in jobs] == [0, 1]
    assert sorted(k for j in jobs for k, _ in j["arrivals"]) == list(range(10))
    assert all((k % 32) % 2 == j["index"] for j in jobs for k, _ in j["arrivals"])
    one = make_jobs(kind="saturation", connections=1, procs=4, inflight=512, **common)
    assert len(one) == 1 and len(one[0]["slots"]) == 512


def test_merge_results_sums_and_unions():
    import array

    part = {
        "window_tokens": 5,
        "window_messages": 5,
        "tokens": 10,
        "started": 1,
        "completed": 1,
        "cancelled_at_end": 0,
        "errors": {"X": 1},
        "ttft": array.array("d", [0.1]).tobytes(),
        "itl": array.array("d", [0.002, 0.003]).tobytes(),
        "hashes": {"a": "1"},
        "lag_max_s": 0.01,
    }
    other = dict(part, errors={"X": 2, "Y": 1}, hashes={"b": "2"}, lag_max_s=0.02)
    merged = merge_results([part, other])
    assert merged["window_tokens"] == 10 and merged["errors"] == {"X": 3, "Y": 1}
    assert merged["itl"] == [0.002, 0.003, 0.002, 0.003] and merged["hashes"] == {"a": "1", "b": "2"}
    assert merged["lag_max_s"] == 0.02


def test_scan_response_reads_events_and_token_ids_like_protobuf():
    from openengine_serve.api.openengine.v1 import generation_pb2 as pb

    token = pb.GenerateResponse(
        request_id="r-1",
        token=pb.TokenOutput(
            output_index=0,
            text="ab",
            tokens=[
                pb.TokenInfo(token_id=7, token="a"),
                pb.TokenInfo(token_id=0, token="b"),
                pb.TokenInfo(token_id=151_643, token="c", logprob=-0.5),
            ],
        ),
    )
    ids: list[int] = []
    assert scan_response(token.SerializeToString(), ids) == "token" and ids == [7, 0, 151_643]
    finished = pb.GenerateResponse(request_id="r-1", finished=pb.GenerationFinished(output_index=0))
    finished.usage.completion_tokens = 3
    assert scan_response(finished.SerializeToString(), ids) == "finished" and ids == [7, 0, 151_643]
    error = pb.GenerateResponse(request_id="r-1")
    error.error.message = "boom"
    assert scan_response(error.SerializeToString(), ids) == "error"
    assert scan_response(pb.GenerateResponse(request_id="r-1").SerializeToString(), ids) is None


def test_placements_parse():
    assert [(p.name, p.pinned, p.quota_cpus) for p in parse_placements("pinned,quota,shared,quota", 1.0)] == [
        ("pinned", True, None),
        ("quota", False, 1.0),
        ("shared", False, None),
    ]
    assert parse_placements("quota", 2.0)[0].describe() == "every core visible, 2-CPU cgroup quota"
    with pytest.raises(ValueError, match="unknown placement 'docker'"):
        parse_placements("pinned,docker")


def test_quota_cgroup_throttling_reads_v1_and_v2_cpu_stat(tmp_path):
    cgroup = QuotaCgroup(0.5)
    cgroup.path = str(tmp_path)
    (tmp_path / "cpu.stat").write_text("nr_periods 100\nnr_throttled 40\nthrottled_time 2500000000\n")
    assert cgroup.throttling() == {"periods": 100.0, "throttled_periods": 40.0, "throttled_s": 2.5}
    (tmp_path / "cpu.stat").write_text("usage_usec 9\nnr_periods 10\nnr_throttled 1\nthrottled_usec 1500000\n")
    assert cgroup.throttling() == {"periods": 10.0, "throttled_periods": 1.0, "throttled_s": 1.5}
    (tmp_path / "cpu.stat").unlink()
    assert cgroup.throttling() == {}
    cgroup.path = ""


def test_wake_ups_count_every_thread_that_blocked_and_woke():
    """20 handoffs, each side sleeping before it answers, so every wait blocks: 20 wake-ups of the helper and
    40 of this thread (its waits and its sleeps)."""
    ping, pong, done = threading.Event(), threading.Event(), threading.Event()

    def helper():
        for _ in range(20):
            ping.wait()
            ping.clear()
            time.sleep(0.002)
            pong.set()
        done.wait()  # alive until counted: an ended thread's count is gone with it

    before = wake_ups(os.getpid())
    thread = threading.Thread(target=helper)
    thread.start()
    for _ in range(20):
        time.sleep(0.002)
        ping.set()
        pong.wait()
        pong.clear()
    after = wake_ups(os.getpid())
    done.set()
    thread.join()
    assert after - before >= 60
    assert wake_ups(2**22 + 1) == 0  # no such process (above the largest pid_max)


def test_parse_cpus():
    assert parse_cpus("0") == [0]
    assert parse_cpus("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(ValueError):
        parse_cpus("")


def test_rerender_judges_older_budget_windows_again(tmp_path):
    """`bench --rerender` of a bench.json whose budget windows all said "frontend quota" (before the headroom
    rule): the window with the other core full no longer counts, and the target says so."""
    from openengine_bench import cli

    rounds = [
        _budget_round(G, 1, 2000.0, 0.6),
        _budget_round(N, 1, 3600.0, 0.7),
        _budget_round(G, 2, 2500.0, 0.6),
        _budget_round(N, 2, 2000.0, 1.0),
    ]
    for r in rounds:
        r["bottleneck"] = "frontend quota (0.25 of 0.25 CPU, throttled in 95 % of periods)"
        del r["frontend_limited"]
    result = report.build_result({}, rounds, {}, [32])
    result["identical"] = {}
    report.write_json(result, tmp_path / "bench.json")
    assert cli.main(["--rerender", "--output", str(tmp_path)]) == 0
    back = report.read_json(tmp_path / "bench.json")
    assert [r["frontend_limited"] for r in back["rounds"]] == [True, True, True, False]
    assert back["rounds"][3]["bottleneck"].startswith("rest of the machine (other cores 1.00 busy")
    worst = {t["name"]: t for t in back["targets"]}[
        "budget: saturation tokens/s native/grpcio, 32 conn, worst frontend-limited round"
    ]
    assert worst["value"] == pytest.approx(1.8) and worst["detail"].startswith("1 of 2 rounds")
    assert "1 of 2 rounds frontend-limited in both windows" in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------- against the published run


def _cpu_ratios(placement: str, pairs: list[float]) -> dict:
    summary = report.summarize(pairs)
    return {placement: {"stack": {"fixed-c32": {"cpu_us_per_token": {"per_round_pair": summary}}}}}


def test_a_ratio_beyond_the_spread_of_the_published_run_is_named_moved():
    published = {"ratios": _cpu_ratios("quota", [0.70, 0.74, 0.72])}  # spread 0.04
    within = report.against_published(_cpu_ratios("quota", [0.75]), published, "docs/bench/bench.json")
    [row] = within["rows"]
    assert not row["moved"] and row["change"] == pytest.approx(0.03) and row["spread"] == pytest.approx(0.04)
    moved = report.against_published(_cpu_ratios("quota", [0.80, 0.84, 0.86]), published)["rows"][0]
    assert moved["moved"] and moved["change"] == pytest.approx(0.12) and moved["spread"] == pytest.approx(0.06)
    down = report.against_published(_cpu_ratios("quota", [0.60]), published)["rows"][0]
    assert down["moved"] and down["change"] < 0
    table = report.published_table({"rows": [moved, down]})
    assert "MOVED up beyond the spread" in table and "MOVED down beyond the spread" in table
    # a placement the published run does not have is not compared
    assert report.against_published(_cpu_ratios("shared", [0.9]), published)["rows"] == []


def test_the_report_shows_the_comparison_with_the_published_run():
    rounds = [
        _round(server, r, placement="quota", cpu_us_per_token=cpu)
        for r, (native, grpcio) in enumerate([(90.0, 100.0)], start=1)
        for server, cpu in ((N, native), (G, grpcio))
    ]
    published = {"ratios": _cpu_ratios("quota", [0.70, 0.72])}
    result = report.build_result({}, rounds, {}, [32], published=published, published_source="published.json")
    [row] = result["published"]["rows"]
    assert row["moved"] and row["now"]["median"] == pytest.approx(0.9)
    assert "## Against the published figures (published.json)" in report.render(result)
    assert report.build_result({}, rounds, {}, [32])["published"] is None
