"""Starts the engine worker ranks with MPI Spawn and lives exactly as long as they do.

    python -m openengine_serve.engine.launcher --config '<json>'

The config is a WorkerConfig (engine/config.py) as JSON; the launcher spawns
`ranks` worker processes and broadcasts the config to them.

Why a process of its own between the node and the workers: killing an
MPI-spawned child makes hydra tear the whole job down, spawning
process included (with SIGKILL, to its whole process group). The node
therefore keeps MPI in this subprocess, started in a new session, and restarts
it when it dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from mpi4py import MPI

from openengine_serve.engine.config import WORKER_MODULE, WorkerConfig

# Tags of the launcher <-> rank 0 messages on the parent intercommunicator.
WORKER_PIDS_TAG = 1
WORKERS_DONE_TAG = 2

_POLL_INTERVAL_S = 0.05  # blocking MPI receives busy-poll a core; test and sleep instead


def _wait_for_message(intercomm: MPI.Intercomm, tag: int):
    request = intercomm.irecv(source=0, tag=tag)
    while True:
        done, message = request.test()
        if done:
            return message
        time.sleep(_POLL_INTERVAL_S)


def _exit_with_parent(parent_pid: int, worker_pids: list[int]) -> None:
    """Ends the launcher and its workers as soon as the node that started it is gone.

    Checks the parent pid rather than waiting for a signal, so that a node
    killed with SIGKILL leaves no orphan behind.
    """
    while os.getppid() == parent_pid:
        time.sleep(_POLL_INTERVAL_S * 4)
    for pid in list(worker_pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the WorkerConfig as JSON")
    config = WorkerConfig.from_json(parser.parse_args(argv).config)

    worker_pids: list[int] = []  # filled once rank 0 reports them; read by the watcher thread
    threading.Thread(
        target=_exit_with_parent, args=(os.getppid(), worker_pids), daemon=True, name="parent-watch"
    ).start()

    intercomm = MPI.COMM_SELF.Spawn(sys.executable, args=["-m", WORKER_MODULE], maxprocs=config.ranks)
    intercomm.bcast(config, root=MPI.ROOT)
    worker_pids.extend(_wait_for_message(intercomm, WORKER_PIDS_TAG))
    _wait_for_message(intercomm, WORKERS_DONE_TAG)
    intercomm.Disconnect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
