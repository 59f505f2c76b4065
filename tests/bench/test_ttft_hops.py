"""openengine_bench.ttft_hops: every request's first-token stages from a debug bench run's logs."""

from __future__ import annotations

from openengine_bench import ttft_hops


def frontend_line(request_id: str, ttft_s: float, opened: float) -> str:
    """A frontend "first token" line as inference._log_first_token writes it; hops 3, 4, 10, 1, 1 ms after opened."""
    at = [opened, opened + 0.003, opened + 0.010, opened + 0.017, opened + 0.018, opened + 0.019]
    names = ("opened_at", "reserved_at", "submitted_at", "first_event_at", "taken_at", "written_at")
    fields = " ".join(f"{name}={value:.6f}" for name, value in zip(names, at))
    return (
        f'ts=2026-12-01T12:00:00.000Z level=debug component=frontend event="first token" request_id={request_id} '
        f"ttft_s={ttft_s:.6f} {fields}\n"
    )


def node_line(request_id: str, submitted: float) -> str:
    """A node "first event on lane" line: step 2 ms after the submission, built 1 ms later, taken 0.5 ms later."""
    return (
        f'ts=2026-12-01T12:00:00.000Z level=debug component=node event="first event on lane" '
        f"request_id={request_id} submitted_at={submitted:.6f} step_at={submitted + 0.002:.6f} "
        f"built_at={submitted + 0.003:.6f} taken_at={submitted + 0.0035:.6f} message_events=1\n"
    )


def test_each_frontend_round_is_joined_with_the_node_line_of_its_own_request_and_split_by_scenario(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    # The bench reuses request ids across servers: the same ids at 100 s (grpcio) and 200 s (native).
    (logs / "frontend-01-grpcio.log").write_text(
        frontend_line("pinned-stack-fixed-c32-r1-0", 0.020, 100.0)
        + frontend_line("pinned-stack-fixed-c32-r1-1", 0.040, 100.5)
        + frontend_line("pinned-stack-fixed-c1-r1-0", 0.020, 101.0)
    )
    (logs / "frontend-02-pygrpc-native.log").write_text(frontend_line("pinned-stack-fixed-c32-r1-0", 0.020, 200.0))
    (logs / "node.log").write_text(
        node_line("pinned-stack-fixed-c32-r1-0", 200.005)
        + node_line("pinned-stack-fixed-c32-r1-0", 100.005)
        + node_line("pinned-stack-fixed-c32-r1-1", 100.505)
        + node_line("pinned-stack-fixed-c1-r1-0", 101.005)
    )
    summaries = ttft_hops.run_summaries(tmp_path)
    assert sorted(summaries) == [
        "frontend-01-grpcio.log pinned-stack-fixed-c1-r1",
        "frontend-01-grpcio.log pinned-stack-fixed-c32-r1",
        "frontend-02-pygrpc-native.log pinned-stack-fixed-c32-r1",
    ]
    grpcio = summaries["frontend-01-grpcio.log pinned-stack-fixed-c32-r1"]
    assert grpcio["n"] == 2 and grpcio["ttft_p50_ms"] == 30.0
    stages = grpcio["stages"]
    assert stages["reserve"]["p50_ms"] == 3.0
    assert stages["submit -> node"]["p50_ms"] == 2.0  # reserved at +3 ms, the node's own line at +5 ms
    assert stages["engine admission + step"]["p50_ms"] == 2.0
    assert stages["waiting in the node's lane"]["p50_ms"] == 1.0
    assert stages["transport + lane reader"]["p50_ms"] == 8.5
    assert stages["before open + after write"]["p50_ms"] == 11.0  # ttft 20 / 40 ms, opened -> written 19 ms
    assert stages["before open + after write"]["tail_mean_ms"] == 21.0  # the slowest request alone
    native = summaries["frontend-02-pygrpc-native.log pinned-stack-fixed-c32-r1"]
    assert native["n"] == 1 and native["stages"]["submit -> node"]["p50_ms"] == 2.0


def test_a_request_without_the_node_line_is_left_out(tmp_path):
    (tmp_path / "frontend-01-grpcio.log").write_text(frontend_line("fixed-c32-r1-0", 0.020, 100.0))
    (tmp_path / "node.log").write_text(node_line("fixed-c32-r1-0", 300.0))  # another round's
    assert ttft_hops.run_summaries(tmp_path) == {}
