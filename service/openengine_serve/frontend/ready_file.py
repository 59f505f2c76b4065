"""How a frontend worker tells its supervisor that it serves: it creates the file the supervisor named.

A worker that dies before that "cannot start", and the supervisor gives up
(exit 1) instead of restarting it forever.
"""

from __future__ import annotations

import os

READY_FILE_VARIABLE = "OPENENGINE_WORKER_READY_FILE"


def mark_worker_ready() -> None:
    """Creates the ready file when a supervisor asked for one (no-op for a frontend run on its own)."""
    if ready_file := os.environ.get(READY_FILE_VARIABLE):
        open(ready_file, "w").close()
