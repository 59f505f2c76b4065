"""A frontend started inside a real 1-CPU cgroup quota (every core visible, as under `docker --cpus` or a
Kubernetes limit) reports that budget, and pygrpc-native runs the I/O threads it reports."""

from __future__ import annotations

import os

import pytest
from google.protobuf import json_format

from openengine_bench.cgroups import CgroupUnavailable, QuotaCgroup
from openengine_serve.api.openengine.v1 import server_pb2
from openengine_serve.client import Client, is_serving
from openengine_serve.local import free_port

from . import processes
from .conftest import SERVERS

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
NATIVE_IO_THREAD_NAME = "grpc-native-io"  # the name pygrpc-native gives its Rust I/O threads


@pytest.fixture
def one_cpu_cgroup():
    try:
        cgroup = QuotaCgroup(cpus=1.0).create()
    except CgroupUnavailable as exc:
        if IN_CI:
            pytest.fail(f"CI=true and the CPU-quota test cannot run: {exc}", pytrace=False)
        pytest.skip(str(exc))
    try:
        yield cgroup
    finally:
        cgroup.close()


def _server_info_extra(target: str) -> dict:
    with Client(target) as client:
        info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
    return json_format.MessageToDict(info.extra)


def _threads_named(pid: int, name: str) -> int:
    count = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                count += f.read().strip() == name
        except OSError:
            pass
    return count


@pytest.mark.parametrize(
    "server, workers, io_threads_override, budget, expected_io_threads",
    [(server, 1, "", 1.0, 1) for server in SERVERS]
    + [("pygrpc-native", 1, "2", 1.0, 2), ("pygrpc-native", 2, "", 0.5, 1)],
)
def test_frontend_in_a_one_cpu_quota(one_cpu_cgroup, server, workers, io_threads_override, budget, expected_io_threads):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs visible to tell the quota from the affinity")
    # No coordinator: ServerInfo and liveness answer without one.
    env = {"OPENENGINE_NATIVE_IO_THREADS": io_threads_override} if io_threads_override else {}
    frontend = processes.frontend(f"127.0.0.1:{free_port()}", server, "--workers", str(workers), **env)
    frontend.preexec_fn = one_cpu_cgroup.enter
    log_path = processes.LOG_DIR / f"{frontend.name}-{frontend.port}.log"
    logged_before = log_path.stat().st_size if log_path.exists() else 0  # logs append: an earlier run's port
    try:
        frontend.start()
        serving = [frontend.proc.pid] if workers == 1 else []

        def started() -> bool:
            assert frontend.proc.poll() is None, f"frontend exited with {frontend.proc.returncode}"
            if workers > 1:  # the supervisor's workers serve, each with its share of the budget
                serving[:] = [
                    p
                    for p in processes.descendants(frontend.proc.pid)
                    if "openengine_serve frontend" in processes.cmdline(p)
                ]
            return len(serving) == workers and is_serving(frontend.target, "liveness")

        processes.wait_for(started, 90, "frontend liveness")
        for pid in serving:
            with open(f"/proc/{pid}/cgroup") as f:
                assert one_cpu_cgroup.name in f.read()
            assert len(os.sched_getaffinity(pid)) >= 2  # all cores visible: only the quota limits
        extra = _server_info_extra(frontend.target)
        assert extra["cpu_budget"] == budget, extra
        if server == "pygrpc-native":
            assert extra["io_threads"] == expected_io_threads, extra
            # the port answers as soon as one worker serves; the others may still be building their servers
            processes.wait_for(
                lambda: (
                    [_threads_named(pid, NATIVE_IO_THREAD_NAME) for pid in serving] == [expected_io_threads] * workers
                ),
                30,
                f"{expected_io_threads} native I/O thread(s) in each of {workers} worker(s)",
            )
        else:
            assert "io_threads" not in extra, extra
    finally:
        frontend.stop()
    log = log_path.read_bytes()[logged_before:].decode()
    listening = [
        line for line in log.splitlines() if 'event="frontend listening"' in line and f"port={frontend.port}" in line
    ]
    assert len(listening) == workers and all(f"cpu_budget={budget}" in line for line in listening), listening
