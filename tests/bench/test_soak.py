"""`openengine-bench --soak`: the growth verdict (pure), and a short soak of both servers end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from openengine_bench import soak
from openengine_bench.soak_load import EXPECTED, INJECTED, MIX, Tally, deck

pytestmark = pytest.mark.timeout(240)


def test_growth_compares_the_first_and_last_quarter_after_the_warm_up():
    values = [500.0, 400.0] + [100.0] * 4 + [110.0] * 4 + [120.0] * 4 + [130.0] * 4
    g = soak.growth(values, warmup_samples=2)  # the warm-up's 500 and 400 do not count
    assert (g["first"], g["last"], g["window"]) == (100.0, 130.0, 4)
    assert g["growth"] == pytest.approx(0.30)
    assert soak.growth([], 0)["growth"] is None


def run_of(series: dict, unexpected: int = 0, left: int = 0) -> dict:
    n = len(next(iter(series.values())))
    return {
        "times": [float(i) for i in range(n)],
        "duration_s": float(n),
        "series": series,
        "load": {"unexpected": unexpected},
        "left_behind": {"live reservations": left},
    }


def test_evaluate_fails_growth_exits_unexpected_outcomes_and_leaks():
    flat = [(10, 100.0, 20)] * 20
    assert soak.evaluate(run_of({"node-0": flat}), warmup=0.2, max_growth=0.05)["verdict"] == "PASS"
    leaking = [(10, 100.0 + i, 20) for i in range(20)]  # +1 MB per sample: far beyond 5 %
    fds = [(10, 100.0, 20 + i) for i in range(20)]
    gone = flat[:10] + [None] * 10
    restarted = flat[:10] + [(11, 100.0, 20)] * 10
    result = soak.evaluate(
        run_of(
            {"node-0": leaking, "coordinator": fds, "frontend worker-0": gone, "frontend worker-1": restarted},
            unexpected=2,
            left=1,
        ),
        0.2,
        0.05,
    )
    assert result["verdict"] == "FAIL"
    text = "\n".join(result["failures"])
    for needle in (
        "node-0: rss_mb grew",
        "coordinator: fds grew",
        "frontend worker-0: exited or was replaced",
        "frontend worker-1: exited or was replaced",
        "2 unexpected outcome(s)",
        "left behind after the load: 1 live reservations",
    ):
        assert needle in text, text
    assert "node-0: fds" not in text and "coordinator: rss_mb" not in text


def test_the_mix_is_dealt_in_its_proportions_and_outcomes_are_sorted():
    cards = deck(seed=3)
    assert {k: cards.count(k) for k in MIX} == MIX and cards != deck(seed=4)
    tally = Tally()
    tally.add("malformed", "INVALID_ARGUMENT")
    tally.add("stream", "completed")
    tally.add("stream", "UNAVAILABLE", "node went away")
    summary = tally.summary()
    assert summary["injected_errors"] == {"malformed: INVALID_ARGUMENT": 1} and summary["unexpected"] == 1
    assert summary["unexpected_samples"] == [{"kind": "stream", "outcome": "UNAVAILABLE", "detail": "node went away"}]
    assert all(INJECTED[k] <= EXPECTED[k] for k in INJECTED)


def test_short_soak_of_both_servers(tmp_path):
    """The CI form of the soak: 18 s of mixed load per server. Every kind of operation ran, every injected
    error was counted with its code (this fails if the injection stops working), nothing unexpected, nothing
    left behind, no process grew or went away, and the three outputs exist."""
    out = tmp_path / "soak"
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # mpiexec for the nodes
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_bench",
            "--soak",
            "0.3",
            "--sample-s",
            "1",
            "--warmup",
            "0.3",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
    )
    assert done.returncode == 0, f"soak failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out / "soak.json").read_text())
    assert [r["server"] for r in result["runs"]] == ["grpcio", "pygrpc-native"]
    for run in result["runs"]:
        assert run["verdict"] == "PASS" and run["failures"] == [], run["failures"]
        names = set(run["processes"])
        for name in (
            "up",
            "coordinator",
            "node-0",
            "node-1",
            "node-0 engine worker",
            "node-1 engine worker",
            "frontend",
            "frontend worker-0",
            "frontend worker-1",
        ):
            assert name in names, sorted(names)
        load = run["load"]
        assert load["unexpected"] == 0, load["unexpected_samples"]
        assert set(load["operations"]) == set(MIX)
        injected = load["injected_errors"]
        for key in (
            "malformed: INVALID_ARGUMENT",
            "invalid: INVALID_ARGUMENT",
            "invalid: NOT_FOUND",
            "duplicate: ALREADY_EXISTS",
            "disconnect: UNAVAILABLE",
        ):
            assert injected.get(key, 0) > 0, injected
        outcomes = load["outcomes"]
        assert outcomes["cancel"]["cancelled"] > 0 and outcomes["abort"]["aborted"] > 0
        assert outcomes["stream"]["completed"] > 0
        assert run["left_behind"] == {"running or queued requests": 0, "live reservations": 0}
        assert len(run["times"]) - run["warmup_samples"] >= 10
    assert (out / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Verdict: grpcio PASS, pygrpc-native PASS" in (out / "soak.md").read_text()
