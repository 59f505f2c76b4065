"""The simulated engine worker: a continuous-batching loop over the simulated model.

    python -m openengine_serve.engine.worker

Started only by `openengine_serve.engine.launcher` through MPI Spawn; its
config arrives as a dict broadcast over the parent intercommunicator:

    command_address  ZMQ address the node binds for EngineCommand (worker PULLs)
    step_address     ZMQ address the node binds for EngineStep (worker PUSHes)
    step_ms          step period in milliseconds (default 2)
    max_batch        most sequences (outputs) running at once

Rank 0 owns the sockets and the batch. Every step it drains the commands,
admits queued requests by priority (higher first, then FIFO) while the batch
has room, gives every running output one token and sends one EngineStep with
all of the step's events. `running` and `queued` count sequences, the unit
`max_batch` limits. When idle it waits up to 100 ms for a command and sends an
empty EngineStep as a heartbeat. Other ranks follow rank 0's per-step plan, so
all ranks step together (simulated tensor parallelism).
"""

from __future__ import annotations

import array
import heapq
import itertools
import os
import time

import zmq
from mpi4py import MPI

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.protowire import length_delimited, varint
from openengine_serve.common.vocab import VOCAB_SIZE
from openengine_serve.engine import model
from openengine_serve.engine.launcher import WORKER_PIDS_TAG, WORKERS_DONE_TAG

_IDLE_WAIT_MS = 100
# Followers test for the next plan instead of blocking (blocking MPI calls busy-poll
# a core), backing off while rank 0 idles between heartbeats.
_FOLLOWER_MIN_POLL_S = 0.0005
_FOLLOWER_MAX_POLL_S = 0.01

# The per-step plan rank 0 broadcasts to the other ranks.
_PLAN_STEP, _PLAN_BATCH, _PLAN_SHUTDOWN = range(3)

_FINISH_WITH_TOKEN = (cluster_pb2.ENGINE_FINISH_EOS, cluster_pb2.ENGINE_FINISH_STOP_TOKEN)

# EngineStep messages are assembled from pre-encoded pieces: building a protobuf
# object per token costs several microseconds, which at hundreds of running
# sequences would eat the 2 ms step. Protobuf parsers merge concatenated fields,
# so `events` entries followed by a serialized EngineStep parse as one message.
_EVENTS_TAG = b"\x12"  # EngineStep.events: field 2, length-delimited
_TOKENS_TAG = b"\x1a"  # OutputEvent.tokens: field 3, length-delimited


def _event_field(event_payload: bytes) -> bytes:
    return length_delimited(_EVENTS_TAG, event_payload)


def _encode_token_fields() -> tuple[bytes, ...]:
    """token id -> the encoded `OutputEvent.tokens` entry holding just that token."""
    records = (b"\x08" + varint(token_id) for token_id in range(VOCAB_SIZE))  # TokenRecord.token_id
    return tuple(length_delimited(_TOKENS_TAG, record) for record in records)


class _RunningRequest:
    """A request in the batch with the encoded event header of each of its outputs."""

    __slots__ = ("state", "event_headers")

    def __init__(self, state: model.RequestState) -> None:
        self.state = state
        self.event_headers = {
            index: cluster_pb2.OutputEvent(request_id=state.request_id, output_index=index,
                                           lane=state.lane).SerializeToString()
            for index in state.outputs
        }


class _Scheduler:
    """Rank 0: the command socket, the queue, the batch and the step socket."""

    def __init__(self, config: dict, world: MPI.Intracomm, worker_pids: list[int]) -> None:
        self._world = world
        self._step_s = float(config.get("step_ms", 2.0)) / 1000.0
        self._max_batch = int(config["max_batch"])
        self._worker_pids = worker_pids
        self._zmq = zmq.Context()
        self._commands = self._zmq.socket(zmq.PULL)
        self._commands.connect(config["command_address"])
        self._steps = self._zmq.socket(zmq.PUSH)
        self._steps.connect(config["step_address"])
        self._poller = zmq.Poller()
        self._poller.register(self._commands, zmq.POLLIN)
        self._token_fields = _encode_token_fields()
        self._step = 0
        self._plan = array.array("q", [0, 0, 0])
        self._queued: dict[str, model.RequestState] = {}
        # (-priority, arrival, state): entries of cancelled requests stay until popped.
        self._queue_order: list[tuple[int, int, model.RequestState]] = []
        self._arrivals = itertools.count()
        self._queued_sequences = 0
        self._waiting_tokens = 0
        self._running: dict[str, _RunningRequest] = {}
        self._running_sequences = 0
        self._shutdown = False

    def run(self) -> None:
        while not self._shutdown:
            if not self._running and not self._queued:
                if not self._poller.poll(_IDLE_WAIT_MS):
                    self._broadcast_plan()
                    self._steps.send(self._step_trailer(0, 0.0))
                    continue
            started = time.monotonic()
            self._run_step(started)
            delay = started + self._step_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        self._broadcast_plan()
        self._commands.close(linger=0)
        self._steps.close(linger=0)
        self._zmq.term()

    def _run_step(self, started: float) -> None:
        events: list[bytes] = []
        self._drain_commands(events)
        if self._shutdown:
            return
        self._admit()
        self._step += 1
        self._broadcast_plan()
        running_tokens = self._generate(events)
        events.append(self._step_trailer(running_tokens, time.monotonic() - started))
        self._steps.send(b"".join(events))

    def _broadcast_plan(self) -> None:
        if self._world.size == 1:
            return
        plan = self._plan
        plan[_PLAN_STEP] = self._step
        plan[_PLAN_BATCH] = self._running_sequences
        plan[_PLAN_SHUTDOWN] = self._shutdown
        self._world.Ibcast(plan, root=0).Wait()

    def _step_trailer(self, running_tokens: int, step_seconds: float) -> bytes:
        return cluster_pb2.EngineStep(
            step=self._step, running=self._running_sequences, queued=self._queued_sequences,
            running_tokens=running_tokens, waiting_tokens=self._waiting_tokens,
            step_seconds=step_seconds, worker_pids=self._worker_pids,
        ).SerializeToString()

    # ------------------------------------------------------------ commands

    def _drain_commands(self, events: list[bytes]) -> None:
        while True:
            try:
                command = cluster_pb2.EngineCommand.FromString(self._commands.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = command.WhichOneof("command")
            if kind == "add":
                self._enqueue(command.add)
            elif kind == "cancel":
                self._cancel(command.cancel, events)
            elif kind == "shutdown":
                self._shutdown = True
                return

    def _enqueue(self, request: cluster_pb2.EngineRequest) -> None:
        state = model.RequestState(request)
        self._queued[state.request_id] = state
        heapq.heappush(self._queue_order, (-request.priority, next(self._arrivals), state))
        self._queued_sequences += len(state.outputs)
        self._waiting_tokens += state.prompt_length * len(state.outputs)

    def _cancel(self, cancel: cluster_pb2.CancelRequest, events: list[bytes]) -> None:
        request_id = cancel.request_id
        running = self._running.get(request_id)
        state = running.state if running else self._queued.get(request_id)
        if state is None:
            return  # already finished, or never arrived
        indices = [cancel.output_index] if cancel.HasField("output_index") else list(state.outputs)
        for index in indices:
            if state.outputs.pop(index, None) is None:
                continue
            events.append(self._event(state, index, cluster_pb2.ENGINE_FINISH_CANCELLED))
            if running:
                self._running_sequences -= 1
            else:
                self._queued_sequences -= 1
                self._waiting_tokens -= state.prompt_length
        if not state.outputs:
            if running:
                del self._running[request_id]
            else:
                del self._queued[request_id]

    # ------------------------------------------------------------ batch

    def _admit(self) -> None:
        order = self._queue_order
        while order:
            state = order[0][2]
            if self._queued.get(state.request_id) is not state:  # cancelled while queued
                heapq.heappop(order)
                continue
            sequences = len(state.outputs)
            # Whole requests only; one larger than the batch runs alone rather than never.
            if self._running_sequences and self._running_sequences + sequences > self._max_batch:
                return
            heapq.heappop(order)
            del self._queued[state.request_id]
            self._queued_sequences -= sequences
            self._waiting_tokens -= state.prompt_length * sequences
            self._running[state.request_id] = _RunningRequest(state)
            self._running_sequences += sequences

    def _generate(self, events: list[bytes]) -> int:
        """One token for every running output; returns the running tokens after the step."""
        token_fields = self._token_fields
        append = events.append
        finished_requests = []
        running_tokens = 0
        for running in self._running.values():
            state = running.state
            next_token = state.next_token
            headers = running.event_headers
            for sequence in tuple(state.outputs.values()):
                token_id, finish, record = next_token(sequence)
                if finish or record is not None or sequence.position == 1:
                    # Rare shapes (finish, logprobs, a first event) take the protobuf path.
                    append(self._event(state, sequence.output_index, finish, token_id, record))
                    if finish:
                        self._running_sequences -= 1
                        continue
                else:
                    append(_event_field(headers[sequence.output_index] + token_fields[token_id]))
                running_tokens += sequence.position
            running_tokens += state.prompt_length * len(state.outputs)
            if not state.outputs:
                finished_requests.append(state.request_id)
        for request_id in finished_requests:
            del self._running[request_id]
        return running_tokens

    @staticmethod
    def _event(state: model.RequestState, output_index: int, finish: int,
               token_id: int | None = None, record: cluster_pb2.TokenRecord | None = None) -> bytes:
        event = cluster_pb2.OutputEvent(request_id=state.request_id, output_index=output_index,
                                        lane=state.lane, finish=finish)
        if token_id is not None:
            event.tokens.append(record if record is not None else cluster_pb2.TokenRecord(token_id=token_id))
            if finish in _FINISH_WITH_TOKEN:
                event.finish_token_id = token_id
        prompt_records = state.take_prompt_records(output_index)
        if prompt_records:
            event.prompt_tokens.extend(prompt_records)
        return _event_field(event.SerializeToString())


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
    config = parent.bcast(None, root=0)
    worker_pids = world.gather(os.getpid(), root=0)
    if world.rank == 0:
        parent.send(worker_pids, dest=0, tag=WORKER_PIDS_TAG)
        model.warm_up()
        _Scheduler(config, world, worker_pids).run()
        parent.send(None, dest=0, tag=WORKERS_DONE_TAG)
    else:
        _follow(world)
    parent.Disconnect()


if __name__ == "__main__":
    main()
