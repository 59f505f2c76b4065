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
    return {
        "server": server,
        "streams": streams,
        "ttft": {"p50_ms": p99_ms / 2, "p99_ms": p99_ms, "failed": failed},
        "liveness": {"p50_ms": 5.0, "p99_ms": 9.0},
        "samples": list(samples),
        "keeps_up": keeps_up,
        "probes": {"t_ttft": [0.1, 0.2], "ttft": [0.01, None], "t_liveness": [0.15], "liveness": [0.005]},
    }


def test_capacity_is_the_most_streams_kept_up_with_without_failed_probes():
    runs = [
        run("grpcio", 256, 40),
        run("grpcio", 512, 90),
        run("grpcio", 640, 400, keeps_up=False),
        run("pygrpc-native", 256, 20),
        run("pygrpc-native", 512, 50, failed=1),
    ]
    assert overload.capacity(runs) == {"grpcio": 512, "pygrpc-native": 256}
    assert overload.capacity([run("grpcio", 256, 40, keeps_up=False)])["grpcio"] is None


def test_series_and_chart(tmp_path):
    samples = [
        {"t": t, "rss_mb.node0": 50.0 + t, "openengine_frontend_event_loop_lag_seconds.frontend": 0.01}
        for t in range(4)
    ]
    assert overload.series(samples, "rss_mb") == {"node0": [(t, 50.0 + t) for t in range(4)]}
    meta = {"mode": "ttft", "nodes": 2, "step_ms": 2.0, "tokens": 8000, "probe_tokens": 5}
    for runs in (
        [run("grpcio", 64, 90, samples=samples), run("pygrpc-native", 64, 30, samples=samples)],
        [run(s, n, n, samples=samples) for s in ("grpcio", "pygrpc-native") for n in (32, 64)],
    ):
        path = overload.write_chart({"meta": meta, "runs": runs}, tmp_path / "overload.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hop_timings_join_the_components_debug_lines_with_the_probe(tmp_path):
    """The lines the node and the frontend really log (their own functions and formatter) give every hop."""
    import logging
    from types import SimpleNamespace

    from openengine_serve.common.logging_setup import KeyValueFormatter
    from openengine_serve.frontend import inference
    from openengine_serve.node import server

    def logged_to(path, logger, component, write):
        handler = logging.FileHandler(path)
        handler.setFormatter(KeyValueFormatter(component))
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        try:
            write()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
            handler.close()

    # submitted 10.010, step 10.012, built 10.020; taken is the node's clock now (checked below)
    logged_to(
        tmp_path / "node0.log",
        server.logger,
        "node",
        lambda: server._log_first_events([("probe-1", 10.010, 10.012)], 10.020, 3),
    )
    accepted = SimpleNamespace(
        request_id="probe-1",
        hops=(10.002, 10.005, 10.011),
        sink=SimpleNamespace(first_event_at=10.030, writing_since=10.031),
    )
    logged_to(
        tmp_path / "frontend-grpcio.log",
        inference.logger,
        "frontend",
        lambda: inference._log_first_token(accepted, 0.04),
    )
    probes = [
        {"request_id": "probe-1", "called_at": 10.000, "first_at": 10.050},
        {"request_id": "probe-2", "called_at": 11.0, "first_at": None},
    ]  # failed: not timed
    hops = overload.hop_timings(tmp_path, probes)
    assert hops["call -> validated"]["p50_ms"] == 2.0
    assert hops["reserve"]["p50_ms"] == 3.0
    assert hops["submit -> node"]["p50_ms"] == 5.0
    assert hops["engine admission + step"]["p50_ms"] == 2.0
    assert hops["waiting in the node's lane"]["p50_ms"] == 8.0
    assert hops["inbox -> stream"]["p50_ms"] == 1.0
    assert all(v["n"] == 1 for v in hops.values()), hops
    # taken (node) and written (frontend) are stamped when logged: on this machine's clock, after the rest
    assert hops["gRPC send (node)"]["p50_ms"] > 0 and hops["detokenize + write"]["p50_ms"] > 0
