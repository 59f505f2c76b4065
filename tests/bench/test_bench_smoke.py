"""`openengine-serve bench --quick` end to end: both servers measured, tokens flow, outputs identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_bench_quick(tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # mpiexec for the node
    done = subprocess.run([sys.executable, "-m", "openengine_serve", "bench", "--quick", "--output", str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    result = json.loads((out / "bench.json").read_text())
    stack = [r for r in result["rounds"] if r["mode"] == "stack"]
    assert {r["server"] for r in stack} == {"grpcio", "pygrpc-native"}
    assert {r["scenario"] for r in stack} == {"fixed-c32", "fixed-c1", "saturation-c32", "saturation-c1"}
    for r in stack:
        assert r["tokens"] > 0, r
        assert r["cpu_us_per_token"] and r["cpu_us_per_token"] > 0, r
        assert r["errors"] == 0, (r["scenario"], r["server"], r["error_kinds"])
    assert all(r["errors"] == 0 for r in result["rounds"])
    assert {r["server"] for r in result["rounds"] if r["mode"] == "baseline"} == {"grpcio", "pygrpc-native"}

    compared = sum(v["compared"] for v in result["identical"].values())
    assert compared > 0
    assert all(v["mismatched"] == 0 for v in result["identical"].values()), result["identical"]
    # Every target was measured (N/A means a round it needs is missing); the timing targets may MISS on a
    # shared machine, the correctness ones may not.
    targets = {t["name"]: t for t in result["targets"]}
    assert [name for name, t in targets.items() if t["value"] is None or t["verdict"] == "N/A"] == []
    assert targets["errors (all rounds, both servers, both modes)"]["verdict"] == "PASS"
    assert targets["requests with different tokens on the two servers"]["verdict"] == "PASS"
    assert len(targets) == 4 * 2 + 2, sorted(targets)  # four per-connection targets for c32 and c1, then those two

    png = out / "bench.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Targets" in (out / "report.md").read_text()


def test_bench_coordinator_small(tmp_path):
    """`bench --coordinator` at a toy size: both paths measured against two real coordinators sharing the ids (the
    general case of one), no errors."""
    out = tmp_path / "coordinator"
    done = subprocess.run([sys.executable, "-m", "openengine_serve", "bench", "--coordinator", "--coordinators", "2",
                           "--nodes", "20",
                           "--frontends", "4", "--concurrency", "32", "--rate", "40", "--window-s", "1",
                           "--warmup-s", "0.3", "--output", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out / "coordinator.json").read_text())
    assert [(s["path"], s["load"]) for s in result["scenarios"]] == [
        ("unary", "saturation (32 loops)"), ("batched", "saturation (32 loops)"),
        ("unary", "40/s"), ("batched", "40/s")]
    for scenario in result["scenarios"]:
        assert scenario["errors"] == 0, scenario
        assert scenario["reservations_per_s"] > 0 and scenario["coordinator_cpu_us_per_request"] > 0, scenario
        assert scenario["latency_p50_ms"] <= scenario["latency_p99_ms"], scenario
    assert result["scenarios"][1]["requests_per_batch"] > 1  # 32 loops over 4 frontends do share batches
    assert result["memory"]["rss_registered_mb"] > 0
    assert "| batched | saturation (32 loops) |" in (out / "coordinator.md").read_text()
    assert "Coordinator benchmark: 2 coordinator(s)" in (out / "coordinator.md").read_text()


def test_bench_one_token_short(tmp_path):
    """`bench --one-token` for one server, short: requests flow through `up` and are counted with CPU per request."""
    out = tmp_path / "one-token"
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # mpiexec for the nodes
    done = subprocess.run([sys.executable, "-m", "openengine_serve", "bench", "--one-token", "--servers", "grpcio",
                           "--nodes", "1", "--inflight", "16", "--window-s", "1", "--warmup-s", "1",
                           "--label", "smoke", "--output", str(out)], capture_output=True, text=True, timeout=200,
                          env=env)
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    [result] = [json.loads(line) for line in (out / "one-token.jsonl").read_text().splitlines()]
    assert result["server"] == "grpcio" and result["label"] == "smoke"
    assert result["requests_per_s"] > 0 and result["errors"] == 0, result
    assert result["frontend_cpu_us_per_request"] > 0 and result["coordinator_cpu_us_per_request"] >= 0, result
