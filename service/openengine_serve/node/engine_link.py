"""The node's asyncio view of its engine worker: ZMQ in and out, liveness, restarts.

The link binds two ZMQ sockets on loopback (commands out, steps in), starts
`openengine_serve.engine.launcher` (which MPI-spawns the worker ranks) and
hands every EngineStep to `on_step`. It keeps its own book of outstanding
requests and their open outputs, so admission does not lag behind the last
step and so that, when the worker is lost (launcher exit, or no step for
`stall_timeout_s`), every open output can be failed with a retryable error
before a new worker is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import cast

import zmq

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.attempts import request_id_of
from openengine_serve.common.logging_setup import log_event
from openengine_serve.engine.config import LAUNCHER_MODULE, WORKER_MODULE, WorkerConfig
from openengine_serve.engine.interface import EngineLoad

log = logging.getLogger(__name__)

_MAX_RESTART_DELAY_S = 5.0
# How long the link remembers a request that ended here, and an abort of one that has not arrived yet (see
# EngineLink.abort): far longer than a release or a Submit takes to arrive, at most this many ids each.
RECENT_IDS_KEPT_S = 60.0
RECENT_IDS_KEPT = 65536


class EngineUnavailable(RuntimeError):
    """The engine worker is not stepping (starting, restarting or stopped)."""


class EngineFull(RuntimeError):
    """Running plus queued sequences would exceed max_batch + max_queue."""


class RecentIds:
    """Request ids remembered for `keep_s` seconds, at most `limit` of them (the oldest forgotten first)."""

    def __init__(self, keep_s: float = RECENT_IDS_KEPT_S, limit: int = RECENT_IDS_KEPT) -> None:
        self._keep_s = keep_s
        self._limit = limit
        self._added_at: OrderedDict[str, float] = OrderedDict()  # in the order added

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        added_at = self._added_at
        added_at[request_id] = now
        added_at.move_to_end(request_id)
        while len(added_at) > self._limit or next(iter(added_at.values())) < now - self._keep_s:
            added_at.popitem(last=False)

    def pop(self, request_id: str) -> bool:
        """Whether the id is remembered; it is forgotten."""
        added = self._added_at.pop(request_id, None)
        return added is not None and added >= time.monotonic() - self._keep_s

    def __contains__(self, request_id: str) -> bool:
        added = self._added_at.get(request_id)
        return added is not None and added >= time.monotonic() - self._keep_s

    def __len__(self) -> int:
        return len(self._added_at)


class _Outstanding:
    """A submitted request: its result lane and the outputs not finished yet."""

    __slots__ = ("lane", "open_outputs")

    def __init__(self, lane: str, open_outputs: set[int]) -> None:
        self.lane = lane
        self.open_outputs = open_outputs


class _StepSocket:
    """The PULL socket the worker's steps arrive on, read on the event loop through one reader on its file
    descriptor and a non-blocking receive per step (pyzmq's asyncio sockets make a future per receive and
    register and drop their reader each time: about 45 us of the node's CPU per step)."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self._loop = asyncio.get_running_loop()
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        self._readable: asyncio.Future | None = None
        self._loop.add_reader(self._fd, self._wake)

    def _wake(self) -> None:
        if self._readable is not None and not self._readable.done():
            self._readable.set_result(None)

    async def recv(self) -> bytes:
        while True:
            with contextlib.suppress(zmq.Again):
                return self.socket.recv(zmq.NOBLOCK)
            # The descriptor signals ZMQ's command mailbox, not messages: the failed receive may have handled
            # the command that made a step ready, and then the descriptor stays quiet.
            if self.pending():
                continue
            self._readable = self._loop.create_future()
            try:
                await self._readable
            finally:
                self._readable = None

    def pending(self) -> bool:
        """A step is waiting to be received. The check handles the mailbox too, so it wakes the receiver."""
        waiting = bool(cast(int, self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        if waiting:
            self._wake()
        return waiting

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        self.socket.close(linger=0)


class _Incarnation:
    """One launcher process and the sockets its workers talk to."""

    def __init__(self, launcher: asyncio.subprocess.Process, commands: zmq.Socket, steps: _StepSocket) -> None:
        self.launcher = launcher
        self.commands = commands
        self.steps = steps
        self.exited = asyncio.ensure_future(launcher.wait())
        self.receiver: asyncio.Task | None = None
        self.worker_pids: tuple[int, ...] = ()


class EngineLink:
    """Runs the engine worker for the node; see the module docstring.

    `on_step` gets every EngineStep (heartbeats included) after the link's
    bookkeeping took its finished outputs out; `on_ready_change` is called
    whenever `ready` flips (worker stepping, lost, restarted). Neither may block.
    """

    def __init__(
        self,
        *,
        step_ms: float,
        max_batch: int,
        max_queue: int,
        ranks: int,
        on_step: Callable[[cluster_pb2.EngineStep], None],
        on_ready_change: Callable[[], None] = lambda: None,
        on_queue_time: Callable[[float], None] = lambda seconds: None,
        stall_timeout_s: float = 3.0,
        start_timeout_s: float = 60.0,
        engine_options: dict | None = None,
    ) -> None:
        """`engine_options`: the WorkerConfig's engine fields (engine, model_path, context_size, ...); without
        them the worker runs the simulated engine."""
        if max_batch < 1 or max_queue < 0 or ranks < 1 or step_ms <= 0:
            raise ValueError("need max_batch >= 1, max_queue >= 0, ranks >= 1 and step_ms > 0")
        self._engine_options = dict(engine_options or {})
        self._step_ms = step_ms
        self._max_batch = max_batch
        self._capacity = max_batch + max_queue
        self._ranks = ranks
        self._stall_timeout_s = stall_timeout_s
        self._start_timeout_s = start_timeout_s
        self._on_step = on_step
        self._on_ready_change = on_ready_change
        self._on_queue_time = on_queue_time
        # request_id -> when it was submitted, until its first token: the time it waited for a batch slot
        self._waiting_since: dict[str, float] = {}
        self._idle = asyncio.Event()  # set while no request is outstanding
        self._idle.set()
        self._zmq: zmq.Context | None = None
        self._incarnation: _Incarnation | None = None
        self._supervisor: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._restarts = 0
        self._requests: dict[str, _Outstanding] = {}
        # Both by request id (common/attempts.py: `_requests` is by attempt id), for the coordinator's abort.
        self._ended = RecentIds()  # requests that ended here lately (see abort)
        self._held_cancels = RecentIds()  # aborted before they were submitted here (see abort)
        self._open_sequences = 0
        # Failed by fail_all() while the worker still runs them: their events are
        # dropped until the worker confirms each output's cancellation.
        self._failed_in_worker: dict[str, set[int]] = {}
        self._last_step_at = 0.0
        self._last_step = 0
        self._load = EngineLoad()
        self._lora_waiters: deque[asyncio.Future] = deque()  # LoraCommands sent, answered in order

    # ------------------------------------------------------------ state

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def worker_pids(self) -> tuple[int, ...]:
        return self._incarnation.worker_pids if self._incarnation else ()

    @property
    def launcher_pid(self) -> int | None:
        return self._incarnation.launcher.pid if self._incarnation else None

    @property
    def outstanding(self) -> dict[str, frozenset[int]]:
        """request_id -> output indices not finished yet."""
        return {request_id: frozenset(entry.open_outputs) for request_id, entry in self._requests.items()}

    @property
    def open_sequences(self) -> int:
        return self._open_sequences

    @property
    def load(self) -> EngineLoad:
        return self._load

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is outstanding; False if some still are after `timeout` seconds."""
        if self._idle.is_set():
            return True  # also with timeout 0, which wait_for would turn into a TimeoutError
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _set_ready(self, ready: bool) -> None:
        if ready == self._ready.is_set():
            return
        if ready:
            self._ready.set()
        else:
            self._ready.clear()
        self._on_ready_change()

    def _requests_changed(self) -> None:
        if self._requests:
            self._idle.clear()
        else:
            self._idle.set()

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Starts the worker and returns once its first step arrived.

        Raises EngineUnavailable when it does not step within `start_timeout_s`.
        """
        self._zmq = zmq.Context()
        failure = await self._spawn()
        if failure:
            await self._discard_incarnation()
            self._zmq.destroy(linger=0)
            self._zmq = None
            raise EngineUnavailable(f"engine worker did not start: {failure}")
        self._supervisor = asyncio.create_task(self._supervise(), name="engine-link-supervisor")

    async def stop(self, timeout: float = 5.0) -> None:
        """Asks the worker to shut down, waits up to `timeout`, then kills what is left.

        Outputs still open are finished with a retryable error.
        """
        if self._supervisor:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        incarnation = self._incarnation
        if incarnation:
            if self.ready:
                await self._shut_down_gracefully(incarnation, timeout)
            await self._discard_incarnation()
        self._fail_outstanding("the engine worker was stopped")
        if self._zmq:
            self._zmq.destroy(linger=0)
            self._zmq = None

    async def _shut_down_gracefully(self, incarnation: _Incarnation, timeout: float) -> None:
        """Sends `shutdown` and waits until the launcher and every rank exited, or `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with contextlib.suppress(zmq.Again):
            self._send(cluster_pb2.EngineCommand(shutdown=True))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(incarnation.exited), timeout)
        # The ranks leave a moment after the launcher; killing them mid-exit makes hydra shout.
        while any(map(_is_engine_worker, incarnation.worker_pids)) and loop.time() < deadline:
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------ requests

    def submit(self, request: cluster_pb2.EngineRequest) -> None:
        if not self.ready:
            raise EngineUnavailable("the engine worker is not ready (starting or restarting)")
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already running on this engine")
        sequences = max(1, request.num_sequences)
        if sequences > self._max_batch:
            raise ValueError(f"num_sequences={sequences} exceeds the engine batch of {self._max_batch}")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self._open_sequences + sequences > self._capacity:
            raise EngineFull(
                f"engine holds {self._open_sequences} sequences; {sequences} more would exceed "
                f"max_batch + max_queue = {self._capacity}"
            )
        try:
            self._send(cluster_pb2.EngineCommand(add=request))
        except zmq.Again as error:
            raise EngineUnavailable("the engine worker is not connected") from error
        self._requests[request.request_id] = _Outstanding(request.frontend_id, set(range(sequences)))
        self._waiting_since[request.request_id] = time.monotonic()
        self._open_sequences += sequences
        self._requests_changed()
        if self._held_cancels and self._held_cancels.pop(request_id_of(request.request_id)):
            self.cancel(request.request_id)  # aborted before it arrived: it ends CANCELLED at once

    async def set_lora(self, command: cluster_pb2.LoraCommand) -> cluster_pb2.LoraOutcome:
        """Loads or unloads an adapter in the worker; its outcome. Raises EngineUnavailable (no worker, or it was
        lost before it answered)."""
        if not self.ready:
            raise EngineUnavailable("the engine worker is not ready (starting or restarting)")
        try:
            self._send(cluster_pb2.EngineCommand(lora=command))
        except zmq.Again as error:
            raise EngineUnavailable("the engine worker is not connected") from error
        answered: asyncio.Future = asyncio.get_running_loop().create_future()
        self._lora_waiters.append(answered)
        return await answered

    def cancel(self, request_id: str, output_index: int | None = None) -> bool:
        """Asks the worker to cancel a request (or one output); False when it is not open here.

        The worker answers with `finished CANCELLED` events through `on_step`.
        """
        entry = self._requests.get(request_id)
        if entry is None or (output_index is not None and output_index not in entry.open_outputs):
            return False
        cancel = cluster_pb2.CancelRequest(request_id=request_id)
        if output_index is not None:
            cancel.output_index = output_index
        with contextlib.suppress(zmq.Again):
            # Not connected means the worker is lost: the error events are on their way.
            self._send(cluster_pb2.EngineCommand(cancel=cancel))
        return True

    def pause(self, request_id: str, resume: bool, lane: str) -> bool:
        """Asks the worker to pause (or resume) a request of the frontend `lane`: its outputs get no tokens
        meanwhile and keep their slots. False when no such request is open here."""
        entry = self._requests.get(request_id)
        if entry is None or entry.lane != lane:
            return False
        with contextlib.suppress(zmq.Again):  # not connected: the worker is lost, its error events are on their way
            self._send(cluster_pb2.EngineCommand(pause=cluster_pb2.PauseRequest(request_id=request_id, resume=resume)))
        return True

    def abort(self, request_id: str) -> cluster_pb2.CancelReply:
        """The coordinator's Abort of one request it has reserved on this node (`request_id`: the request id, not
        an attempt id). Not open here, the request either ended here (its release is still on its way to the
        coordinator) or has not arrived yet (reserved, its Submit still on its way): the second kind is cancelled
        as soon as it is submitted."""
        attempts = [attempt for attempt in self._requests if request_id_of(attempt) == request_id]
        if attempts:
            for attempt in attempts:
                self.cancel(attempt)
            return cluster_pb2.CancelReply(found=True)
        if request_id in self._ended:
            return cluster_pb2.CancelReply(ended=True)
        self._held_cancels.add(request_id)
        return cluster_pb2.CancelReply(held=True)

    def lane_of(self, request_id: str) -> str | None:
        """The lane (frontend id) of an open request; None when it is not open here."""
        entry = self._requests.get(request_id)
        return None if entry is None else entry.lane

    def lanes_of_outstanding(self) -> dict[str, str]:
        """request_id -> the lane (frontend id) its events go to."""
        return {request_id: entry.lane for request_id, entry in self._requests.items()}

    def fail_all(self, message: str, retryable: bool = True) -> None:
        """Finishes every open output now with ERROR (through `on_step`) and cancels them.

        Nothing the worker still produces for those requests reaches `on_step`.
        """
        for request_id, entry in self._requests.items():
            with contextlib.suppress(zmq.Again):
                self._send(cluster_pb2.EngineCommand(cancel=cluster_pb2.CancelRequest(request_id=request_id)))
            self._failed_in_worker[request_id] = set(entry.open_outputs)
        self._fail_outstanding(message, retryable)

    def _send(self, command: cluster_pb2.EngineCommand) -> None:
        if self._incarnation is None:
            raise zmq.Again()
        self._incarnation.commands.send(command.SerializeToString(), zmq.NOBLOCK)

    # ------------------------------------------------------------ steps

    async def _receive_steps(self, incarnation: _Incarnation) -> None:
        steps = incarnation.steps
        while True:
            # pyzmq hands a step that is already queued back as a finished future, and awaiting one does not
            # yield: a node behind on its steps would run only this loop, and every gRPC call (result lanes and
            # their credits, Submit, heartbeats) waited until it caught up. One turn of the event loop per step.
            await asyncio.sleep(0)
            step = cluster_pb2.EngineStep.FromString(await steps.recv())
            if self._failed_in_worker:
                step = self._without_failed_requests(step)
            self._last_step_at = time.monotonic()
            if not self._ready.is_set():
                incarnation.worker_pids = tuple(step.worker_pids)
                self._set_ready(True)
            self._last_step = step.step
            self._load = EngineLoad(
                step.running,
                step.queued,
                step.running_tokens,
                step.waiting_tokens,
                step.prefilled_tokens,
                step.cached_prompt_tokens,
                step.cached_blocks,
                tuple(step.running_loras),
                tuple(step.waiting_loras),
            )
            if self._waiting_since:
                self._note_first_tokens(step)
            for event in step.events:
                if event.finish:
                    self._close_output(event.request_id, event.output_index)
            for outcome in step.lora_outcomes:
                if self._lora_waiters:
                    waiter = self._lora_waiters.popleft()
                    if not waiter.done():
                        waiter.set_result(outcome)
            self._deliver(step)

    def _note_first_tokens(self, step: cluster_pb2.EngineStep) -> None:
        """Reports the queue time of each request whose first token is in `step` (one that ended without a
        token, cancelled while queued, reports none)."""
        now = time.monotonic()
        for event in step.events:
            submitted = self._waiting_since.pop(event.request_id, None)
            if submitted is not None and event.tokens:
                self._on_queue_time(now - submitted)

    def _close_output(self, request_id: str, output_index: int) -> None:
        entry = self._requests.get(request_id)
        if entry is None or output_index not in entry.open_outputs:
            return
        entry.open_outputs.discard(output_index)
        self._open_sequences -= 1
        if not entry.open_outputs:
            del self._requests[request_id]
            self._ended.add(request_id_of(request_id))
            self._waiting_since.pop(request_id, None)
            self._requests_changed()

    def _without_failed_requests(self, step: cluster_pb2.EngineStep) -> cluster_pb2.EngineStep:
        kept = []
        for event in step.events:
            failed_outputs = self._failed_in_worker.get(event.request_id)
            if failed_outputs is None:
                kept.append(event)
            elif event.finish:
                failed_outputs.discard(event.output_index)
                if not failed_outputs:
                    del self._failed_in_worker[event.request_id]
        if len(kept) == len(step.events):
            return step
        filtered = cluster_pb2.EngineStep()
        filtered.CopyFrom(step)
        del filtered.events[:]
        filtered.events.extend(kept)
        return filtered

    def _deliver(self, step: cluster_pb2.EngineStep) -> None:
        try:
            self._on_step(step)
        except Exception:
            log.exception("engine step delivery failed", extra={"kv": {"step": step.step}})

    def _fail_outstanding(self, message: str, retryable: bool = True) -> None:
        """Finishes every open output with ERROR, delivered as one synthetic step."""
        if not self._requests:
            return
        step = cluster_pb2.EngineStep(step=self._last_step)
        for request_id, entry in self._requests.items():
            self._ended.add(request_id_of(request_id))
            for output_index in sorted(entry.open_outputs):
                step.events.add(
                    request_id=request_id,
                    output_index=output_index,
                    lane=entry.lane,
                    finish=cluster_pb2.ENGINE_FINISH_ERROR,
                    message=message,
                    retryable=retryable,
                )
        self._requests.clear()
        self._waiting_since.clear()
        self._open_sequences = 0
        self._requests_changed()
        self._deliver(step)

    # ------------------------------------------------------------ worker processes

    async def _spawn(self) -> str | None:
        """Starts a launcher with fresh sockets; None once it stepped, else why it did not."""
        try:
            launcher, commands, steps = await self._start_launcher()
        except (OSError, zmq.ZMQError) as error:
            return f"could not start the launcher: {error!r}"
        incarnation = _Incarnation(launcher, commands, steps)
        self._incarnation = incarnation
        self._last_step_at = time.monotonic()
        incarnation.receiver = asyncio.create_task(self._receive_steps(incarnation), name="engine-link-steps")
        ready = asyncio.ensure_future(self._ready.wait())
        done, _ = await asyncio.wait(
            {ready, incarnation.exited, incarnation.receiver},
            timeout=self._start_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if ready in done:
            log_event(
                log,
                "engine spawned",
                launcher_pid=launcher.pid,
                worker_pids=",".join(map(str, incarnation.worker_pids)),
            )
            return None
        ready.cancel()
        if incarnation.exited in done:
            return f"the launcher exited with status {launcher.returncode}"
        if incarnation.receiver in done:
            return f"reading its steps failed: {incarnation.receiver.exception()!r}"
        return f"no step within {self._start_timeout_s:g}s"

    async def _start_launcher(self) -> tuple[asyncio.subprocess.Process, zmq.Socket, _StepSocket]:
        assert self._zmq is not None
        commands = self._zmq.socket(zmq.PUSH)
        commands.setsockopt(zmq.SNDHWM, 0)  # admission already bounds what is queued
        steps = self._zmq.socket(zmq.PULL)
        for sock in (commands, steps):
            sock.setsockopt(zmq.LINGER, 0)
        # Abstract Unix sockets (Linux): a message costs both ends less CPU than on loopback TCP, no file is
        # left behind, and each worker gets fresh names: nothing a lost worker sent can reach its successor.
        name = f"openengine-engine-{os.getpid()}-{secrets.token_hex(8)}"
        command_address, step_address = f"ipc://@{name}-commands", f"ipc://@{name}-steps"
        commands.bind(command_address)
        steps.bind(step_address)
        config = WorkerConfig(
            command_address=command_address,
            step_address=step_address,
            max_batch=self._max_batch,
            step_ms=self._step_ms,
            ranks=self._ranks,
            **self._engine_options,
        )
        env = dict(os.environ)
        # MPI Spawn runs `mpiexec`, which lives next to the interpreter in a venv.
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        starting = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                LAUNCHER_MODULE,
                "--config",
                config.to_json(),
                env=env,
                # Own session: hydra answers a lost rank by SIGKILLing the launcher's process group.
                start_new_session=True,
            )
        )
        try:
            launcher = await asyncio.shield(starting)
        except BaseException:
            # Failed, or cancelled by stop() mid-start: then kill the launcher once it exists.
            starting.add_done_callback(_kill_started_launcher)
            commands.close()
            steps.close()
            raise
        return launcher, commands, _StepSocket(steps)

    async def _supervise(self) -> None:
        """Watches the running worker; when it is lost, fails its outputs and starts another."""
        while True:
            reason = await self._wait_until_lost()
            log_event(log, "engine worker lost", logging.ERROR, reason=reason, open_sequences=self._open_sequences)
            await self._discard_incarnation()
            self._fail_outstanding(f"the engine worker was lost ({reason}); the request may be retried")
            attempt = 0
            while True:
                if attempt:
                    await asyncio.sleep(min(_MAX_RESTART_DELAY_S, 0.25 * 2**attempt))
                attempt += 1
                self._restarts += 1
                failure = await self._spawn()
                if failure is None:
                    break
                log_event(log, "engine restart failed", logging.ERROR, attempt=attempt, reason=failure)
                await self._discard_incarnation()

    async def _wait_until_lost(self) -> str:
        incarnation = self._incarnation
        assert incarnation is not None and incarnation.receiver is not None
        check_every = min(0.5, self._stall_timeout_s / 4)
        while True:
            done, _ = await asyncio.wait(
                {incarnation.exited, incarnation.receiver}, timeout=check_every, return_when=asyncio.FIRST_COMPLETED
            )
            if incarnation.exited in done:
                return f"launcher exited with status {incarnation.launcher.returncode}"
            if incarnation.receiver in done:
                return f"reading engine steps failed: {incarnation.receiver.exception()!r}"
            silent_for = time.monotonic() - self._last_step_at
            # Steps already waiting in the socket mean our own loop was slow, not the worker.
            if silent_for > self._stall_timeout_s and not incarnation.steps.pending():
                return f"no engine step for {silent_for:.1f}s"

    async def _discard_incarnation(self) -> None:
        """Kills the launcher and the worker ranks (if still alive) and closes the sockets."""
        incarnation = self._incarnation
        if incarnation is None:
            return
        self._incarnation = None
        self._set_ready(False)
        self._failed_in_worker.clear()  # the next worker never heard of them
        self._load = EngineLoad()
        while self._lora_waiters:
            waiter = self._lora_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(EngineUnavailable("the engine worker was lost before it answered; retry"))
        if incarnation.receiver:
            incarnation.receiver.cancel()
        if incarnation.launcher.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(incarnation.launcher.pid, signal.SIGKILL)
        # The ranks run in sessions of their own (hydra's); hydra ends them when the
        # launcher dies, but do not count on it.
        for pid in incarnation.worker_pids:
            _kill_engine_worker(pid)
        await incarnation.exited
        incarnation.commands.close()
        incarnation.steps.close()


def _kill_started_launcher(starting: asyncio.Future) -> None:
    if not starting.cancelled() and starting.exception() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(starting.result().pid, signal.SIGKILL)


def _is_engine_worker(pid: int) -> bool:
    """Whether `pid` is a live engine worker (the pid may have been reused or be a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return WORKER_MODULE.encode() in cmdline.read()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _kill_engine_worker(pid: int) -> None:
    if _is_engine_worker(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
