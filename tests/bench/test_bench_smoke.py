"""`openengine-bench --quick` end to end: both servers measured, tokens flow, outputs identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)  # two bench runs when the first reads above a bound

# native/grpcio frontend CPU per message under the quota, one round: 0.58-0.89 in 12 s rounds on a 2-core VM
# shared with other work (docs/benchmarks.md); the bound only has to hold there.
QUOTA_NATIVE_PER_MESSAGE_BOUND = 1.0
# native/grpcio frontend wake-ups per message under the quota. A count, so it moves far less with the machine's
# load than CPU time; with grpcio's EventEngine threads off in every component it reads 0.74-0.90 on a 2-core VM
# shared with other work. A native path that wakes as often as grpcio's fails it. A reading above the bound is
# measured again, and the guard fails when the second run reads above it too.
QUOTA_NATIVE_WAKE_UPS_BOUND = 0.95


def _bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # mpiexec for the node
    return env


def run_quick(out) -> dict:
    """`openengine-bench --quick` (pinned and quota placements, and the budgeted saturation): its bench.json."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_bench",
            "--quick",
            "--placement",
            "pinned,quota",
            "--connections",
            "32",
            "--fixed-window-s",
            "6",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=_bench_env(),
    )
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads((out / "bench.json").read_text())


def quota_rounds(result: dict) -> dict[str, dict]:
    """Server -> its stack round in the quota placement, from a bench.json."""
    return {
        r["server"]: r
        for r in result["rounds"]
        if (r["mode"], r["placement"], r["scenario"]) == ("stack", "quota", "fixed-c32")
    }


def test_bench_quick(tmp_path):
    """Two placements (pinned with its baseline, and a real 1-CPU cgroup quota) plus the budgeted saturation."""
    if os.geteuid() != 0:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true and bench --quick cannot create its quota cgroup: not root", pytrace=False)
        pytest.skip("the quota placement creates a cgroup: needs root (CI runs as root)")
    out = tmp_path / "bench"
    result = run_quick(out)
    stack = [r for r in result["rounds"] if r["mode"] == "stack"]
    assert {(r["placement"], r["scenario"], r["server"]) for r in stack} == {
        (placement, scenario, server)
        for server in ("grpcio", "pygrpc-native")
        for placement, scenario in (("pinned", "fixed-c32"), ("quota", "fixed-c32"), ("budget", "saturation-c32"))
    }
    for r in stack:
        assert r["tokens"] > 0, r
        assert r["cpu_us_per_token"] and r["cpu_us_per_token"] > 0, r
        assert r["client_us_per_token"] and r["client_us_per_token"] > 0, r
        assert r["errors"] == 0, (r["scenario"], r["server"], r["error_kinds"])
    # The guard of the deployment pygrpc-native is for (a container with a CPU quota): in the same interleaved
    # run, its frontend spends less CPU per streamed message than grpcio's. Per message, not per token: a grpcio
    # frontend that falls behind on a busy machine packs several tokens into a message, which lowers its CPU per
    # token but not per message.
    quota = quota_rounds(result)
    per_message = {server: r["frontend_cpu_s"] * 1e6 / r["messages"] for server, r in quota.items()}
    assert per_message["pygrpc-native"] < QUOTA_NATIVE_PER_MESSAGE_BOUND * per_message["grpcio"], (
        f"under the 1-CPU quota pygrpc-native's frontend spent {per_message['pygrpc-native']:.1f} µs per message, "
        f"grpcio's {per_message['grpcio']:.1f} µs: native must stay below {QUOTA_NATIVE_PER_MESSAGE_BOUND}x grpcio "
        "(windows: "
        + ", ".join(f"{s} {r['tokens_per_s']:.0f} tokens/s, limited by {r['bottleneck']}" for s, r in quota.items())
        + ")"
    )
    wake_ups = {server: r["wake_ups_per_message"] for server, r in quota.items()}
    if wake_ups["pygrpc-native"] >= QUOTA_NATIVE_WAKE_UPS_BOUND * wake_ups["grpcio"]:
        # one more interleaved run decides: a regression reads above the bound in both
        again = quota_rounds(run_quick(tmp_path / "bench-again"))
        wake_ups = {server: r["wake_ups_per_message"] for server, r in again.items()}
    assert wake_ups["pygrpc-native"] < QUOTA_NATIVE_WAKE_UPS_BOUND * wake_ups["grpcio"], (
        f"under the 1-CPU quota pygrpc-native's frontend threads woke {wake_ups['pygrpc-native']:.2f} times per "
        f"message, grpcio's {wake_ups['grpcio']:.2f}: native must stay below {QUOTA_NATIVE_WAKE_UPS_BOUND}x grpcio"
    )
    for r in stack:
        if r["placement"] != "pinned":  # the frontend saw every core, and the quota's accounting was read
            assert r["throttled_share"] is not None and r["frontend_core_busy"] is None, r
    # A small quota with 512 streams in flight: the frontend cannot use more than its quota; each window says
    # whether the quota alone limited it (whether it did depends on the machine's load).
    budget = [r for r in stack if r["placement"] == "budget"]
    quota = result["meta"]["budget_cpus"]
    assert all(r["frontend_util"] <= quota * 1.15 for r in budget), (quota, [r["frontend_util"] for r in budget])
    assert all(isinstance(r["frontend_limited"], bool) for r in budget)
    assert all(r["bottleneck"] != "unknown" for r in stack)
    assert all(r["errors"] == 0 for r in result["rounds"])
    assert {r["server"] for r in result["rounds"] if r["mode"] == "baseline"} == {"grpcio", "pygrpc-native"}

    compared = sum(v["compared"] for v in result["identical"].values())
    assert compared > 0
    assert all(v["mismatched"] == 0 for v in result["identical"].values()), result["identical"]
    # Every target was measured (N/A means a round it needs is missing); the timing targets may MISS on a
    # shared machine, the correctness ones may not.
    targets = {t["name"]: t for t in result["targets"]}
    budget_target = "budget: saturation tokens/s native/grpcio, 32 conn, worst frontend-limited round"
    assert [
        name for name, t in targets.items() if name != budget_target and (t["value"] is None or t["verdict"] == "N/A")
    ] == []
    valid = all(r["frontend_limited"] for r in budget)  # one round: one window per server
    assert targets[budget_target]["detail"].startswith(f"{int(valid)} of 1 rounds frontend-limited in both windows")
    assert (targets[budget_target]["value"] is None) == (not valid)
    assert targets["errors (all rounds, both servers, every mode)"]["verdict"] == "PASS"
    assert targets["requests with different tokens on the two servers"]["verdict"] == "PASS"
    assert sorted(targets) == sorted(
        [
            "pinned: CPU/token native/grpcio at fixed load, 32 conn",
            "pinned: TTFT p99 native/grpcio at fixed load, 32 conn",
            "quota: CPU/token native/grpcio at fixed load, 32 conn",
            "quota: TTFT p99 native/grpcio at fixed load, 32 conn",
            budget_target,
            "pinned: native CPU/token / bare per-message floor, fixed load, 32 conn",
            "errors (all rounds, both servers, every mode)",
            "requests with different tokens on the two servers",
        ]
    )

    png = out / "bench.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "report.md").read_text()
    assert "## Placement `pinned`" in text and "## Placement `quota`" in text and "## Placement `budget`" in text


def test_bench_target_drives_a_running_stack(tmp_path):
    """`bench --target` against a running stack (coordinator, node, frontend; started here as the harness starts
    them, unpinned): tokens, latencies and the frontend's CPU, with both load generator clients.

    One server only: this tests the load generator's side; the server under it does not change what it checks
    (both servers are driven by the same load generator in test_bench_quick)."""
    from openengine_bench.stack import Stack

    server = "pygrpc-native"
    cpus = sorted(os.sched_getaffinity(0))
    stack = Stack(tmp_path / "stack", cpus, cpus, step_ms=2.0, max_batch=256, max_queue=1024)
    try:
        stack.start_cluster()
        frontend = stack.start_frontend(server, pinned=False)
        for client in ("grpc-aio", "h2"):  # both load generator clients against the same frontend
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "openengine_bench",
                    "--target",
                    frontend.target,
                    "--frontend-pids",
                    str(frontend.pid),
                    "--connections",
                    "4",
                    "--rate",
                    "20",
                    "--saturation",
                    "16",
                    "--rounds",
                    "1",
                    "--warmup-s",
                    "0.5",
                    "--window-s",
                    "1.5",
                    "--client",
                    client,
                    "--output",
                    str(tmp_path / client),
                ],
                capture_output=True,
                text=True,
                timeout=120,
                env=_bench_env(),
            )
            assert done.returncode == 0, f"{client} ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    finally:
        stack.stop_all()
    for client in ("grpc-aio", "h2"):
        result = json.loads((tmp_path / client / "target.json").read_text())
        assert [(r["scenario"], r["round"]) for r in result["rounds"]] == [("fixed-c4", 1), ("saturation-c4", 1)]
        for r in result["rounds"]:
            assert r["errors"] == 0 and r["tokens"] > 0, (client, r)
            assert r["cpu_us_per_token"] > 0 and r["client_us_per_token"] > 0, (client, r)
            assert r["ttft_p50_ms"] is not None and r["itl_p99_ms"] >= r["itl_p50_ms"] > 0, (client, r)
        assert result["meta"]["server_info"]["extra"]["grpc_server"] == server, result["meta"]
        assert "| fixed-c4" in (tmp_path / client / "target.md").read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "openengine_bench", "--target", "127.0.0.1:1", "--frontend-pids", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--frontend-pids 'x'" in bad.stderr


def test_bench_one_token_short(tmp_path):
    """`bench --one-token` for one server, short: requests flow through `up` and are counted with CPU per request."""
    out = tmp_path / "one-token"
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # mpiexec for the nodes
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "openengine_bench",
            "--one-token",
            "--servers",
            "grpcio",
            "--nodes",
            "1",
            "--inflight",
            "16",
            "--window-s",
            "1",
            "--warmup-s",
            "1",
            "--label",
            "smoke",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    [result] = [json.loads(line) for line in (out / "one-token.jsonl").read_text().splitlines()]
    assert result["server"] == "grpcio" and result["label"] == "smoke"
    assert result["requests_per_s"] > 0 and result["errors"] == 0, result
    assert result["frontend_cpu_us_per_request"] > 0, result
    # every request reserves its node on the coordinator: hundreds a second cost it some CPU ticks
    assert result["coordinator_cpu_us_per_request"] > 0, result
    assert result["load_generator_cpu_us_per_request"] > 0, result
    assert result["load_generator_loop"] in ("uvloop", "asyncio"), result
