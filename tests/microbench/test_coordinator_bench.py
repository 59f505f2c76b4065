"""The coordinator micro-benchmark's options, its 'limited by' verdict and its summary over rounds: pure functions, plus
one coordinator process started in a real CPU-quota cgroup."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import coordinator as bench

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REPO = Path(__file__).resolve().parents[2]  # `python -m tests.microbench.coordinator` runs from here


def test_options_parse():
    args = bench.build_parser().parse_args(["--coordinators", "1,2,1", "--coordinator-cpus", "0.25", "--rounds", "3"])
    assert (args.coordinators, args.coordinator_cpus, args.rounds) == ([1, 2], 0.25, 3)
    defaults = bench.build_parser().parse_args([])
    assert (defaults.coordinators, defaults.coordinator_cpus, defaults.rounds) == ([1], 0.0, 1)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--coordinators", "0,2", "every coordinator count must be >= 1"),
        ("--coordinators", "two", "expected coordinator counts like 1 or 1,2"),
        ("--coordinator-cpus", "-0.5", "the coordinator CPU quota must be between 0 and"),
        ("--coordinator-cpus", "quarter", "expected a number of CPUs like 0.25"),
    ],
)
def test_bad_options_are_named(option, value, message, capsys):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args([option, value])
    err = capsys.readouterr().err
    assert option in err and message in err, err
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        (bench.coordinator_counts if option == "--coordinators" else bench.cpu_budget)(value)


def test_limited_by_names_the_coordinators_quota_or_the_load_generator():
    sat = "saturation (512 loops)"
    limit, alone = bench.limited_by(
        sat, [0.25, 0.24], 0.25, [0.8, 0.7], load_generator_cores=0.5, machine_idle_cores=0.8
    )
    assert alone and limit.startswith(
        "coordinator CPU (2 of 2 at their 0.25-CPU quota; busiest 0.25 CPU, throttled in 80 % of periods)"
    )
    limit, alone = bench.limited_by(
        sat, [0.10, 0.11], 0.25, [0.0, 0.01], load_generator_cores=0.97, machine_idle_cores=0.6
    )
    assert not alone and limit == "load generator (0.97 core)"
    limit, alone = bench.limited_by(sat, [0.25], 0.25, [0.5], load_generator_cores=0.5, machine_idle_cores=0.02)
    assert not alone and "machine CPU (idle 0.02 core)" in limit and limit.startswith("coordinator CPU (1 of 1")
    # One of two at its quota is not 'the coordinators alone' (the other had room: the ids were not the limit).
    assert not bench.limited_by(sat, [0.25, 0.05], 0.25, [0.5, 0.0], 0.3, 0.9)[1]
    # Throttled now and then while far below the quota (bursts): not at the quota.
    assert bench.limited_by(sat, [0.04], 0.1, [0.11], 0.3, 0.9) == ("none saturated (latency-bound)", False)
    # Without a quota a coordinator is the limit at a full core.
    limit, alone = bench.limited_by(sat, [0.97], 0.0, [None], 0.4, 0.5)
    assert alone and limit == "coordinator CPU (1 of 1 at a full core; busiest 0.97)"
    assert bench.limited_by("40/s", [0.05], 0.25, [0.0], 0.1, 1.5) == (
        "none (open-loop arrivals; nothing saturated)",
        False,
    )


def _run(round_number, count, rate, limited=True):
    scenario = {
        "path": "batched",
        "load": "saturation (8 loops)",
        "reservations_per_s": rate,
        "coordinator_cpu_us_per_request": 50.0,
        "busiest_coordinator_cores": 0.25,
        "load_generator_cores": 0.4,
        "requests_per_batch": 10.0,
        "latency_p99_ms": 9.0,
        "coordinator_limited": limited,
        "errors": 0,
    }
    memory = [
        {"rss_empty_mb": 40.0, "rss_registered_mb": 41.0, "bytes_per_registered_peer": 1000.0 + i} for i in range(count)
    ]
    return {
        "round": round_number,
        "coordinators": count,
        "memory": memory,
        "scenarios": [scenario],
        "registration_s": 0.5,
    }


def test_summary_pairs_rounds_and_gives_min_and_median():
    runs = [
        _run(1, 1, 1000),
        _run(1, 2, 1900),
        _run(2, 1, 1100),
        _run(2, 2, 2300, limited=False),
        _run(3, 1, 900),
        _run(3, 2, 1800),
    ]
    summary = bench.summarize(runs)
    by_count = {row["coordinators"]: row for row in summary["scenarios"]}
    assert (by_count[1]["reservations_per_s_min"], by_count[1]["reservations_per_s_median"]) == (900, 1000)
    assert by_count[2]["coordinator_limited_rounds"] == 2 and by_count[2]["rounds"] == 3
    (scaling,) = summary["scaling"]
    # Same-round ratios: 1.9, 2.09.., 2.0 (not the ratio of the medians).
    assert scaling["ratios"] == pytest.approx([1.9, 2300 / 1100, 2.0])
    assert (scaling["ratio_min"], scaling["ratio_median"]) == (pytest.approx(1.9), pytest.approx(2.0))
    assert scaling["both_coordinator_limited_rounds"] == 2 and (scaling["coordinators"], scaling["versus"]) == (2, 1)
    memory = {m["coordinators"]: m for m in summary["memory_per_coordinator"]}
    assert (
        memory[2]["bytes_per_registered_peer_median"] == 1000.5 and memory[2]["bytes_per_registered_peer_max"] == 1001.0
    )
    text = bench.render(
        {
            "config": {
                "coordinators": [1, 2],
                "rounds": 3,
                "nodes": 4,
                "frontends": 2,
                "heartbeat_s": 1.0,
                "coordinator_cpus": 0.25,
            },
            "cpus": 2,
            "runs": [
                {
                    **run,
                    "heartbeat_only_cores": 0.01,
                    "heartbeat_peers_cores": 0.02,
                    "scenarios": [
                        {
                            **s,
                            "coordinator_cores": 0.5,
                            "marginal_cpu_us_per_request": 40.0,
                            "latency_p50_ms": 1.0,
                            "limited_by": "x",
                        }
                        for s in run["scenarios"]
                    ],
                }
                for run in runs
            ],
            "summary": summary,
        }
    )
    assert "each coordinator in its own 0.25-CPU cgroup quota" in text
    assert "| batched | saturation (8 loops) | 2 vs 1 | 1.90× | 2.00× | 2 of 3 |" in text


def test_coordinator_runs_inside_its_quota_cgroup(tmp_path):
    """`--coordinator-cpus`: the coordinator process is moved into a cgroup of its own with that quota (after the
    registrations), removed after."""
    args = bench.build_parser().parse_args(["--coordinator-cpus", "0.5", "--heartbeat-s", "1"])
    try:
        coordinators = bench.Coordinators(1, args.coordinator_cpus, args, tmp_path).__enter__()
    except SystemExit as exc:  # no cgroup could be made (not root)
        if IN_CI:
            pytest.fail(f"CI=true and the coordinator's quota cgroup cannot be made: {exc}", pytrace=False)
        pytest.skip(str(exc))
    try:
        coordinators.confine()
        (cgroup,) = coordinators.cgroups
        with open(f"/proc/{coordinators.pids[0]}/cgroup") as f:
            assert any(line.rstrip().endswith("/" + os.path.basename(cgroup.path)) for line in f), cgroup.path
        quota_files = [os.path.join(cgroup.path, name) for name in ("cpu.max", "cpu.cfs_quota_us")]
        quota = open(next(p for p in quota_files if os.path.exists(p))).read().split()[0]
        assert quota == "50000", quota
        path = cgroup.path
    finally:
        coordinators.__exit__(None, None, None)
    assert not os.path.exists(path)


def test_bench_coordinator_small(tmp_path):
    """The coordinator micro-benchmark at a toy size: one coordinator, then two sharing the ids, each in a 0.5-CPU quota
    cgroup of its own; both paths measured, no errors, every window says what limited it."""
    if os.geteuid() != 0:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true and the coordinator bench cannot create its quota cgroups: not root", pytrace=False)
        pytest.skip("--coordinator-cpus creates cgroups: needs root (CI runs as root)")
    out = tmp_path / "coordinator"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.microbench.coordinator",
            "--coordinators",
            "1,2",
            "--coordinator-cpus",
            "0.5",
            "--nodes",
            "20",
            "--frontends",
            "4",
            "--concurrency",
            "32",
            "--rate",
            "40",
            "--window-s",
            "0.6",
            "--rate-window-s",
            "0.6",
            "--warmup-s",
            "0.3",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out / "coordinator.json").read_text())
    assert [(run["round"], run["coordinators"], run["coordinator_cpus"]) for run in result["runs"]] == [
        (1, 1, 0.5),
        (1, 2, 0.5),
    ]
    for run in result["runs"]:
        assert [(s["path"], s["load"]) for s in run["scenarios"]] == [
            ("unary", "saturation (32 loops)"),
            ("batched", "saturation (32 loops)"),
            ("unary", "40/s"),
            ("batched", "40/s"),
            (bench.FLOOR_PATH, "40/s"),
        ]
        *through_coordinators, floor = run["scenarios"]
        # The floor: the same stream and client against a trivial server in a process of its own.
        assert floor["errors"] == 0 and floor["reservations_per_s"] > 0, floor
        assert 0 < floor["latency_p50_ms"] <= floor["latency_p99_ms"], floor
        for scenario in through_coordinators:
            assert scenario["errors"] == 0, scenario
            assert scenario["reservations_per_s"] > 0 and scenario["coordinator_cpu_us_per_request"] > 0, scenario
            assert scenario["latency_p50_ms"] <= scenario["latency_p99_ms"], scenario
            assert len(scenario["coordinator_throttled_share"]) == run["coordinators"], scenario
            assert all(share is not None for share in scenario["coordinator_throttled_share"]), scenario
            assert scenario["limited_by"], scenario
        assert len(run["memory"]) == run["coordinators"] and run["memory"][0]["rss_registered_mb"] > 0
    assert result["runs"][0]["scenarios"][1]["requests_per_batch"] > 1  # 32 loops over 4 frontends share batches
    assert [row["coordinators"] for row in result["summary"]["scaling"]] == [2] * 4  # not the floor's
    text = (out / "coordinator.md").read_text()
    assert "ms through the trivial server on the same stream" in text
    assert "| 1 | 2 | batched | saturation (32 loops) |" in text
    assert "Coordinator benchmark: 1,2 coordinator(s), 1 round(s)" in text
    assert "each coordinator in its own 0.5-CPU cgroup quota" in text
    # --in-step: each simulated frontend's requests share one message per coordinator (32 over 4 frontends: 8 each,
    # split over 2 coordinators with the releases riding along).
    in_step = tmp_path / "in-step"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.microbench.coordinator",
            "--coordinators",
            "2",
            "--in-step",
            "--paths",
            "batched",
            "--rate",
            "0",
            "--nodes",
            "4",
            "--frontends",
            "4",
            "--concurrency",
            "32",
            "--window-s",
            "0.5",
            "--warmup-s",
            "0.3",
            "--output",
            str(in_step),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (run,) = json.loads((in_step / "coordinator.json").read_text())["runs"]
    (scenario,) = run["scenarios"]
    assert scenario["load"] == "saturation (4 frontends × 8 in step)" and scenario["errors"] == 0, scenario
    assert scenario["reservations_per_s"] > 0 and scenario["requests_per_batch"] > 2, scenario
