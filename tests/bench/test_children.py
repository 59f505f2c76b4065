"""A benchmark stopped or killed leaves nothing it started running (openengine_bench.children), with real
processes: a benchmark stand-in that starts a long-lived child the way the benchmarks start their stacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BENCH = textwrap.dedent(
    """
    import subprocess, sys, time
    from openengine_bench.children import stop_with_parent, unwind_on_sigterm

    unwind_on_sigterm()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True, preexec_fn=stop_with_parent
    )
    print(child.pid, flush=True)
    try:
        time.sleep(60)
    finally:
        with open(sys.argv[1], "w") as f:
            f.write("unwound")
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _start_bench(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH, str(tmp_path / "finally")], stdout=subprocess.PIPE, text=True
    )
    assert bench.stdout is not None
    child = int(bench.stdout.readline())
    assert _alive(child)
    return bench, child


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_benchmark_takes_its_children_down(tmp_path):
    bench, child = _start_bench(tmp_path)
    try:
        bench.kill()  # SIGKILL: no finally block runs
        bench.wait()
        assert _wait_gone(child), "the child outlived the killed benchmark"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_sigterm_unwinds_the_benchmark(tmp_path):
    bench, child = _start_bench(tmp_path)
    try:
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(10) == 128 + signal.SIGTERM
        assert (tmp_path / "finally").read_text() == "unwound"  # its finally blocks ran: stacks are stopped there
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
