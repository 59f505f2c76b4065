"""What a benchmark starts stops with it: stacks and servers are not left running when the benchmark is
stopped (SIGTERM, e.g. `timeout`) or killed."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2)


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds the benchmark like Ctrl-C (exit status 143), so its finally blocks stop what it started;
    Python's default would end it at once."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def stop_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGTERM when the benchmark's thread that started it dies, however it dies
    (Linux PR_SET_PDEATHSIG, as `up` does for its components). Start children from the main thread."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
