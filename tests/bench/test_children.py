"""A benchmark stopped or killed leaves nothing it started running (openengine_bench.children,
openengine_serve.local.stop_with_parent), with real
processes: a benchmark stand-in that starts a long-lived child the way the benchmarks start their stacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..integration.processes import alive, wait_for

BENCH = textwrap.dedent(
    """
    import subprocess, sys, time
    from openengine_bench.children import unwind_on_sigterm
    from openengine_serve.local import stop_with_parent

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


def _start_bench(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH, str(tmp_path / "finally")], stdout=subprocess.PIPE, text=True
    )
    assert bench.stdout is not None
    child = int(bench.stdout.readline())
    assert alive(child)
    return bench, child


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_benchmark_takes_its_children_down(tmp_path):
    bench, child = _start_bench(tmp_path)
    try:
        bench.kill()  # SIGKILL: no finally block runs
        bench.wait()
        wait_for(lambda: not alive(child), 10, "the killed benchmark's child to go", interval=0.05)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_sigterm_unwinds_the_benchmark(tmp_path):
    bench, child = _start_bench(tmp_path)
    try:
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(10) == 128 + signal.SIGTERM
        assert (tmp_path / "finally").read_text() == "unwound"  # its finally blocks ran: stacks are stopped there
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
