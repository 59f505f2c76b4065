"""The overload command's pure parts: RSS slope, latency summaries, the capacity verdict, the chart."""

from __future__ import annotations

from openengine_bench import overload


def test_growth_is_the_least_squares_slope_and_needs_three_points():
    assert overload.growth_mb_per_s([(0, 50.0), (1, 51.0), (2, 52.0), (3, 53.0)]) == 1.0
    assert abs(overload.growth_mb_per_s([(0, 50.0), (1, 50.2), (2, 49.8), (3, 50.0)])) < 0.1
    assert overload.growth_mb_per_s([(0, 50.0), (1, 60.0)]) is None


def test_latency_summary_counts_failures_apart():
    summary = overload.latency_summary([0.010, 0.020, None, 0.030])
    assert summary["n"] == 4 and summary["failed"] == 1
    assert summary["p50_ms"] == 20.0 and summary["max_ms"] == 30.0
    assert overload.latency_summary([None])["p99_ms"] is None


def run(server, streams, p99_ms, failed=0, samples=(), keeps_up=True):
    return {"server": server, "streams": streams, "ttft": {"p50_ms": p99_ms / 2, "p99_ms": p99_ms, "failed": failed},
            "liveness": {"p50_ms": 5.0, "p99_ms": 9.0}, "samples": list(samples), "keeps_up": keeps_up,
            "probes": {"t_ttft": [0.1, 0.2], "ttft": [0.01, None], "t_liveness": [0.15], "liveness": [0.005]}}


def test_capacity_is_the_most_streams_kept_up_with_without_failed_probes():
    runs = [run("grpcio", 256, 40), run("grpcio", 512, 90), run("grpcio", 640, 400, keeps_up=False),
            run("pygrpc-native", 256, 20), run("pygrpc-native", 512, 50, failed=1)]
    assert overload.capacity(runs) == {"grpcio": 512, "pygrpc-native": 256}
    assert overload.capacity([run("grpcio", 256, 40, keeps_up=False)])["grpcio"] is None


def test_series_and_chart(tmp_path):
    samples = [{"t": t, "rss_mb.node0": 50.0 + t, "openengine_frontend_event_loop_lag_seconds.frontend": 0.01}
               for t in range(4)]
    assert overload.series(samples, "rss_mb") == {"node0": [(t, 50.0 + t) for t in range(4)]}
    meta = {"mode": "ttft", "nodes": 2, "step_ms": 2.0, "tokens": 8000, "probe_tokens": 5}
    for runs in ([run("grpcio", 64, 90, samples=samples), run("pygrpc-native", 64, 30, samples=samples)],
                 [run(s, n, n, samples=samples) for s in ("grpcio", "pygrpc-native") for n in (32, 64)]):
        path = overload.write_chart({"meta": meta, "runs": runs}, tmp_path / "overload.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
