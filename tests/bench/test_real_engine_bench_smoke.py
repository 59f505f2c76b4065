"""The short forms of the real-engine benchmarks, end to end: `openengine_bench.engines` against our stack on
both frontends (llama-server's build and the peers are left to the full run) and `openengine_bench.features`'
prefix cache and isolation parts. They check that each measurement ran and holds together, not how fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(450)

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run_bench(module: str, *args: str) -> None:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # mpiexec for the node
    done = subprocess.run(
        [sys.executable, "-m", f"openengine_bench.{module}", "--quiet-wait", "0", *args],
        cwd=TOOLS,
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    assert done.returncode == 0, f"{module} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_engines_short_run_measures_both_frontends_and_where_the_cpu_goes(tmp_path):
    run_bench(
        "engines",
        "--targets",
        "openengine-grpcio,openengine-native,openengine-http",
        "--concurrency",
        "1,4",
        "--rounds",
        "1",
        "--window",
        "3",
        "--warmup",
        "1",
        "--max-tokens",
        "16",
        "--output",
        str(tmp_path),
    )
    result = json.loads((tmp_path / "engines.json").read_text())
    summary = result["summary"]
    assert set(summary) == {"openengine-grpcio", "openengine-native", "openengine-http"}
    for target, levels in summary.items():
        assert set(levels) == {"1", "4"}, target
        for n, level in levels.items():
            assert level["tok_s"] > 0 and level["requests"] > 0 and level["errors"] == 0, (target, n, level)
            assert level["short"] == 0, "every request streamed its 16 tokens"
            roles = level["cpus_by_role"]
            assert {"engine worker", "frontend", "node", "benchmark client"} <= set(roles), roles
            assert roles["engine worker"] > roles["frontend"], "the model's steps are the work"
    # No peer ran, and the HTTP goal (against our gRPC) is at 8 and 32 streams: nothing can be judged
    assert all(v["met"] is None for v in result["verdicts"]), "no peer ran: no target can be judged"
    report = (tmp_path / "report.md").read_text()
    assert "## Where the CPU goes" in report and "| OpenEngine (pygrpc-native) | 4 |" in report


def test_features_short_run_measures_the_prefix_cache_and_isolation(tmp_path):
    run_bench(
        "features", "--quick", "--parts", "cache,isolation", "--cache-system-tokens", "200", "--output", str(tmp_path)
    )
    result = json.loads((tmp_path / "features.json").read_text())
    assert result["errors"] == []
    # Problems but the load of other processes (what a test run leaves winding down is no fault of the bench).
    assert [p for p in result["problems"] if "did not start" not in p] == []
    requests = result["prefix_cache"]["requests"]
    assert requests["cached"] and requests["bypass"]
    for r in requests["cached"]:  # all but the question's own tokens from the cache, by the node's counters too
        assert 200 < r["cached_prompt_tokens"] == r["hits"] < r["prompt_tokens"], r
        assert r["prefilled"] == r["prompt_tokens"] - r["cached_prompt_tokens"], r
    for r in requests["bypass"]:
        assert r["cached_prompt_tokens"] == 0 and r["hits"] == 0 and r["prefilled"] == r["prompt_tokens"], r
    burst = result["prefix_cache"]["burst"]  # sent at once: the others share the first's system prompt cells
    together, bypass = burst["together"], burst["bypass"]
    assert together["errors"] == bypass["errors"] == 0
    assert together["hits"] >= (burst["requests"] - 1) * 200, together
    assert together["prefilled"] == together["prompt_tokens"] - together["hits"], together
    assert bypass["hits"] == 0 and bypass["prefilled"] == bypass["prompt_tokens"], bypass
    summary = result["isolation"]["summary"]
    for run in ("without", "plain", "with"):
        assert summary[run]["gaps"] > 0 and summary[run]["itl_p99_ms"] > 0, run
    assert summary["with_extra"]["errors"] == 0 and summary["with_extra"]["requests"] > 0, "the huge guides were served"
    verdicts = {v["goal"].split(":")[0]: v["met"] for v in result["verdicts"]}
    assert len(verdicts) == 2 and all(met is not None for met in verdicts.values()), verdicts
