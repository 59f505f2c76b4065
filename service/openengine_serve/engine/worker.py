"""The engine worker: a continuous-batching loop over one engine (engine/interface.py).

    python -m openengine_serve.engine.worker

Started only by `openengine_serve.engine.launcher` through MPI Spawn; its
WorkerConfig (engine/config.py) arrives broadcast over the parent intercommunicator.

Rank 0 owns the sockets and the engine (llama.cpp or simulated). It loads the
model first: its first EngineStep tells the node the worker is ready. Every
step it drains the commands, lets the engine admit what fits and step, and
sends one EngineStep with all of the step's events. When idle (nothing queued,
every admitted request paused or none) it waits up to 100 ms for a command and
sends an empty EngineStep as a heartbeat. Other ranks (the simulated engine
only) follow rank 0's per-step plan, so all ranks step together (simulated
tensor parallelism).
"""

from __future__ import annotations

import array
import os
import time

import zmq
from mpi4py import MPI

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.logging_setup import setup_logging
from openengine_serve.engine.config import WorkerConfig
from openengine_serve.engine.interface import Engine, step_message
from openengine_serve.engine.launcher import WORKER_PIDS_TAG, WORKERS_DONE_TAG

_IDLE_WAIT_MS = 100
# Followers test for the next plan instead of blocking (blocking MPI calls busy-poll
# a core), backing off while rank 0 idles between heartbeats.
_FOLLOWER_MIN_POLL_S = 0.0005
_FOLLOWER_MAX_POLL_S = 0.01

# The per-step plan rank 0 broadcasts to the other ranks.
_PLAN_STEP, _PLAN_BATCH, _PLAN_SHUTDOWN = range(3)


def create_engine(config: WorkerConfig) -> Engine:
    """The engine the config names, with its model loaded (the engines' modules are imported only here)."""
    if config.engine == "llama.cpp":
        from openengine_serve.engine.llamacpp.kv_layout import KvLayoutEngine

        return KvLayoutEngine(config)
    from openengine_serve.engine.simulated.batch import SimulatedEngine

    return SimulatedEngine(config)


class _Scheduler:
    """Rank 0: the command socket, the step socket, and the steps of its engine."""

    def __init__(self, engine: Engine, config: WorkerConfig, world: MPI.Intracomm, worker_pids: list[int]) -> None:
        self._world = world
        self._engine = engine
        self._step_s = engine.step_period_s
        self._worker_pids = worker_pids
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PULL)
        self._commands.connect(config.command_address)
        self._steps = self._zmq.socket(zmq.PUSH)
        self._steps.connect(config.step_address)
        self._poller = zmq.Poller()
        self._poller.register(self._commands, zmq.POLLIN)
        self._step = 0
        self._plan = array.array("q", [0, 0, 0])
        self._shutdown = False
        self._lora_outcomes: list[cluster_pb2.LoraOutcome] = []  # sent with the next step

    def run(self) -> None:
        while not self._shutdown:
            if self._engine.idle and not self._wait_for_command():
                continue
            started = time.monotonic()
            if not self._run_step(started):
                # queued work that cannot run yet (the batch holds paused requests): wait for a command
                self._wait_for_command()
                continue
            delay = started + self._step_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        self._broadcast_plan()
        self._commands.close(linger=0)
        self._steps.close(linger=0)
        self._zmq.term()

    def _wait_for_command(self) -> bool:
        """Up to 100 ms for a command (True when one came); without one, an empty step as the heartbeat."""
        if self._poller.poll(_IDLE_WAIT_MS):
            return True
        self._broadcast_plan()
        self._steps.send(step_message(self._step, [], self._engine.load(), 0.0, self._worker_pids))
        return False

    def _run_step(self, started: float) -> bool:
        """One step: False when the engine had nothing it could run (then no step is sent, unless a command
        produced events)."""
        events: list[bytes] = []
        self._drain_commands(events)
        if self._shutdown:
            return True
        self._step += 1
        self._broadcast_plan()
        stepped = self._engine.step(events)
        kv_events = self._engine.take_kv_events()
        if stepped or events or kv_events or self._lora_outcomes:
            load = self._engine.load()
            seconds = time.monotonic() - started
            self._steps.send(
                step_message(self._step, events, load, seconds, self._worker_pids, kv_events, self._lora_outcomes)
            )
            self._lora_outcomes = []
        else:
            self._step -= 1  # nothing sent: step numbers stay consecutive (only the simulated engine has followers,
            # and it always steps)
        return stepped

    def _broadcast_plan(self) -> None:
        if self._world.size == 1:
            return
        plan = self._plan
        plan[_PLAN_STEP] = self._step
        plan[_PLAN_BATCH] = self._engine.load().running
        plan[_PLAN_SHUTDOWN] = self._shutdown
        self._world.Ibcast(plan, root=0).Wait()

    def _drain_commands(self, events: list[bytes]) -> None:
        while True:
            try:
                command = cluster_pb2.EngineCommand.FromString(self._commands.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = command.WhichOneof("command")
            if kind == "add":
                self._engine.enqueue(command.add)
            elif kind == "cancel":
                self._engine.cancel(command.cancel, events)
            elif kind == "pause":
                self._engine.pause(command.pause)
            elif kind == "lora":
                self._lora_outcomes.append(self._engine.set_lora(command.lora))
            elif kind == "shutdown":
                self._shutdown = True
                return


def _follow(world: MPI.Intracomm) -> None:
    """Ranks other than 0: keep in lockstep with rank 0's steps until it shuts down."""
    plan = array.array("q", [0, 0, 0])
    while True:
        request = world.Ibcast(plan, root=0)
        delay = _FOLLOWER_MIN_POLL_S
        while not request.Test():
            time.sleep(delay)
            delay = min(delay * 2, _FOLLOWER_MAX_POLL_S)
        if plan[_PLAN_SHUTDOWN]:
            return


def main() -> None:
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise SystemExit("the engine worker is started by openengine_serve.engine.launcher (MPI Spawn)")
    world = MPI.COMM_WORLD
    config: WorkerConfig = parent.bcast(None, root=0)
    setup_logging("engine-worker", config.log_level)
    worker_pids = world.gather(os.getpid(), root=0)
    if world.rank == 0:
        assert worker_pids is not None  # the root of the gather gets the list
        parent.send(worker_pids, dest=0, tag=WORKER_PIDS_TAG)
        engine = create_engine(config)  # loads the model: the node is not ready before the first step
        try:
            _Scheduler(engine, config, world, worker_pids).run()
        finally:
            engine.close()
        parent.send(None, dest=0, tag=WORKERS_DONE_TAG)
    else:
        _follow(world)
    parent.Disconnect()


if __name__ == "__main__":
    main()
