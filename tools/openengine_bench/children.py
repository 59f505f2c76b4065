"""What a benchmark starts stops with it: stacks and servers are not left running when the benchmark is
stopped (SIGTERM, e.g. `timeout`) or killed (its children start with openengine_serve.local.stop_with_parent)."""

from __future__ import annotations

import signal
import sys


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds the benchmark like Ctrl-C (exit status 143), so its finally blocks stop what it started;
    Python's default would end it at once."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
