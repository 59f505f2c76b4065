"""The node: hosts the engine worker and serves the internal Node service (grpc.aio only).

Frontends submit requests here and hold one result lane each (`Lane`, with the
frontend's credits): what the engine steps produced for a
frontend goes out as StepResults messages, the steps it cannot send yet folded
into one waiting message (`ResultLane`). On `Lane` the frontend also pauses the
requests whose client takes no output, and resumes them. The node registers with the coordinator and
heartbeats its load; on SIGTERM it stops taking work, lets running requests
finish within the drain timeout, then stops its worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid

import grpc

from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from ..common import tracing
from ..common.attempts import request_id_of
from ..common.config import NodeConfig
from ..common.grpc_server import STATUS_BY_NUMBER, create_internal_server
from ..common.health_service import Health
from ..common.heartbeat_stream import HeartbeatFailed, HeartbeatStream, PeerHeartbeats
from ..common.lifecycle import bind_address, start_metrics
from ..common.logging_setup import log_event
from ..common.peer_identity import FRONTEND, InstanceCheck, caller_role, role_checks
from ..common.tls import add_internal_port, internal_channel
from ..common.tracing import SUBMIT_SPAN
from ..engine.model_card import without_tokenizer
from . import metrics
from .engine_link import EngineFull, EngineLink, EngineUnavailable
from .kv_events import FellBehind, KvEventLog, ReplayUnavailable
from .lora_files import LoraFileError, lora_file
from .model import engine_options, load_card

logger = logging.getLogger("openengine_serve.node")

_LANE_OPENED = cluster_pb2.StepResults(step=0)  # first message of every lane: "you are subscribed"
_SUBMITTED = cluster_pb2.SubmitOutcome()


class ResultLane:
    """One frontend's result lane: what the engine produced for it and gRPC has not taken yet. Never more
    than one message waits: while the frontend is behind, each step's events join the waiting message, and
    the plain token events of one output fold into one event holding all its tokens, so a frontend that fell
    behind catches up in one message of at most one event per output (plus prompt, finish and error
    events), whatever the number of steps: its cost to the frontend follows the streams, not the steps.
    When the waiting message holds more than `max_backlog_steps` steps the frontend has taken nothing for
    that long: `put` sheds, handing back the ids of the requests whose output waits (the node ends them
    with a retryable error).

    With a `window` (the frontend's credits, `Lane`), at most that many messages are handed to gRPC and not
    yet acknowledged by the frontend: the backlog stays here, where it folds, instead of in the transport's
    flow-control window, where every step stays its own message the frontend must read in turn.

    An output's first token does not wait for credits: it is its request's TTFT, and with the frontend's credit
    pacing the wait could be tens of ms. With no credit left, first tokens go out alone in one message past the
    window (one such message at a time), while the running streams' tokens keep folding: a frontend that is
    behind still gets them in few messages."""

    __slots__ = (
        "max_backlog_steps",
        "step",
        "events",
        "backlog_steps",
        "ready",
        "idle",
        "_folding",
        "first_events",
        "window",
        "unacknowledged",
        "credit",
        "first_tokens",
    )

    def __init__(self, max_backlog_steps: int, window: int = 0) -> None:
        self.max_backlog_steps = max_backlog_steps
        self.window = window  # 0: no credits, gRPC's flow control alone
        self.unacknowledged = 0  # messages handed to gRPC the frontend has not acknowledged
        # set: take() may send: unacknowledged < window (or no window), or first tokens wait and no message is
        # out past the window
        self.credit = asyncio.Event()
        self.credit.set()
        self.first_tokens: list[cluster_pb2.OutputEvent] = []  # first-token events held while no credit was left
        self.step = 0
        self.events: list[cluster_pb2.OutputEvent] = []
        self.backlog_steps = 0  # steps merged into the waiting message
        self.ready = asyncio.Event()  # set: a message waits
        self.idle = asyncio.Event()  # set: gRPC took everything
        self.idle.set()
        # (request id, output index) -> its plain token event in `events`, the one later tokens fold into
        self._folding: dict[tuple[str, int], cluster_pb2.OutputEvent] = {}
        # With debug logging only: (request id, submitted at, step arrived at) of the first events in the waiting
        # message, for the per-hop timing of a request's first token (logged once gRPC took the message).
        self.first_events: list[tuple[str, float, float]] = []

    def put(self, step: int, events: list[cluster_pb2.OutputEvent]) -> list[str]:
        self.step = step
        if self.window and self.unacknowledged >= self.window and any(event.first for event in events):
            self.first_tokens.extend(event for event in events if event.first)
            events = [event for event in events if not event.first]
            self.idle.clear()
            self._update_credit()
            if not events:
                return []
        if self.backlog_steps == 1:  # the first step behind: index the waiting message's own events
            unfolded, self.events = self.events, []
            self._fold(unfolded)
        if self.backlog_steps:
            self._fold(events)
        else:
            self.events.extend(events)
        self.backlog_steps += 1
        self.ready.set()
        self.idle.clear()
        if self.backlog_steps <= self.max_backlog_steps:
            return []
        ended = {e.request_id for e in self.events if e.finish != cluster_pb2.ENGINE_FINISH_NONE}
        waiting = list(dict.fromkeys(e.request_id for e in self.events if e.request_id not in ended))
        self.events = [e for e in self.events if e.request_id in ended] + [
            cluster_pb2.OutputEvent(
                request_id=request_id,
                finish=cluster_pb2.ENGINE_FINISH_ERROR,
                retryable=True,
                lane=events[0].lane,
                message=f"the frontend fell {self.max_backlog_steps} engine steps behind on its result lane; "
                "retry the request",
            )
            for request_id in waiting
        ]
        self._folding.clear()
        return waiting

    def _fold(self, events: list[cluster_pb2.OutputEvent]) -> None:
        folding = self._folding
        for event in events:
            key = (event.request_id, event.output_index)
            if event.finish == cluster_pb2.ENGINE_FINISH_NONE and not event.prompt_tokens:
                target = folding.get(key)
                if target is not None:
                    target.tokens.extend(event.tokens)
                    continue
                folding[key] = event
            else:
                folding.pop(key, None)  # what follows it must stay after it
            self.events.append(event)

    async def take(self) -> cluster_pb2.StepResults:
        await self.credit.wait()
        first_tokens, self.first_tokens = self.first_tokens, []
        if self.window and self.unacknowledged >= self.window:  # past the window: the first tokens alone
            # Stamped with the current step, so the frontend's fold detection (LaneAcknowledgements.handled) sees
            # the jump here rather than on the next message: it learns at once that it fell behind.
            message = cluster_pb2.StepResults(step=self.step, events=first_tokens)
        else:
            if not first_tokens:
                await self.ready.wait()
            message = cluster_pb2.StepResults(step=self.step, events=first_tokens + self.events)
            self.events = []
            self._folding.clear()
            self.backlog_steps = 0
            self.ready.clear()
        if self.window:
            self.unacknowledged += 1
            self._update_credit()
        return message

    def taken(self) -> None:
        if not self.ready.is_set() and not self.first_tokens:
            self.idle.set()

    def acknowledge(self, handled: int) -> None:
        """The frontend handled `handled` more of the messages it was sent."""
        self.unacknowledged = max(0, self.unacknowledged - handled)
        self._update_credit()

    def _update_credit(self) -> None:
        if (
            not self.window
            or self.unacknowledged < self.window
            or (self.first_tokens and self.unacknowledged == self.window)
        ):
            self.credit.set()
        else:
            self.credit.clear()


def _log_first_events(first_events: list[tuple[str, float, float]], built_at: float, events: int) -> None:
    """Debug: the node's hops of each request's first event (CLOCK_MONOTONIC, comparable across processes on
    one machine): submitted, its engine step arrived, the lane message holding it built, gRPC took it."""
    taken_at = time.monotonic()
    for request_id, submitted_at, arrived_at in first_events:
        log_event(
            logger,
            "first event on lane",
            logging.DEBUG,
            request_id=request_id,
            submitted_at=f"{submitted_at:.6f}",
            step_at=f"{arrived_at:.6f}",
            built_at=f"{built_at:.6f}",
            taken_at=f"{taken_at:.6f}",
            message_events=events,
        )


class NodeService(cluster_pb2_grpc.NodeServicer):
    def __init__(self, config: NodeConfig, node_id: str, card: cluster_pb2.ModelCard) -> None:
        self.config = config
        self.node_id = node_id
        self.card = card  # with the tokenizer: GetModel
        self.card_summary = without_tokenizer(card)  # in NodeEntry
        self.rank = config.node_rank
        self.lanes: dict[str, ResultLane] = {}
        # With debug logging only: request id -> when it was submitted, until its first event reaches its lane.
        self._awaiting_first_event: dict[str, float] = {}
        self.readiness_changed = asyncio.Event()  # set: the engine worker's readiness or the drain changed
        self.link = EngineLink(
            step_ms=config.step_ms,
            max_batch=config.max_batch,
            max_queue=config.max_queue,
            ranks=config.engine_ranks,
            on_step=self._on_step,
            on_ready_change=self.readiness_changed.set,
            on_queue_time=metrics.QUEUE_SECONDS.observe,
            stall_timeout_s=config.engine_stall_timeout_s,
            start_timeout_s=config.engine_start_timeout_s,
            engine_options=engine_options(config, card),
        )
        self.health = Health()
        self.draining = False
        self.wakes: dict[str, asyncio.Event] = {}  # per coordinator address; set: heartbeat it now
        self.drain_told: dict[str, asyncio.Event] = {}  # per coordinator address; set: it acknowledged the drain
        self.rank_assignment = asyncio.Lock()  # held by the registration that asks a coordinator for a rank
        self.kv_events = KvEventLog(max(self.rank, 0))
        self._kv_worker_restarts = 0  # the worker whose cache the KV events describe

    # ---------------------------------------------------------------- engine -> lanes

    def _on_step(self, step: cluster_pb2.EngineStep) -> None:
        metrics.observe_step(step, self.config.max_batch, self.card.max_loras)
        if self.link.restarts != self._kv_worker_restarts:  # a new worker: an empty cache
            self._kv_worker_restarts = self.link.restarts
            self.kv_events.clear()
        self.kv_events.record(step.kv_events)
        if not step.events:
            return
        by_lane: dict[str, list[cluster_pb2.OutputEvent]] = {}
        for event in step.events:
            by_lane.setdefault(event.lane, []).append(event)
        awaiting = self._awaiting_first_event
        arrived_at = time.monotonic() if awaiting else 0.0
        for lane_id, events in by_lane.items():
            lane = self.lanes.get(lane_id)
            if awaiting and lane is not None:
                for event in events:
                    submitted_at = awaiting.pop(event.request_id, None)
                    if submitted_at is not None:
                        lane.first_events.append((event.request_id, submitted_at, arrived_at))
            if lane is None:
                # The frontend is gone: its requests can never be delivered.
                for event in events:
                    if event.finish == cluster_pb2.ENGINE_FINISH_NONE:
                        self.link.cancel(event.request_id)
                continue
            shed = lane.put(step.step, events)
            if shed:
                self._shed(lane_id, lane, shed)
        metrics.LANE_BACKLOG.set(max((lane.backlog_steps for lane in self.lanes.values()), default=0))

    def _shed(self, frontend_id: str, lane: ResultLane, request_ids: list[str]) -> None:
        """The frontend took nothing from its lane for the backlog bound: end the requests waiting on it
        (retryable, their slots freed) rather than queue without bound."""
        for request_id in request_ids:
            self.link.cancel(request_id)
        metrics.LANE_SHED_REQUESTS.inc(len(request_ids))
        log_event(
            logger,
            "result lane shed",
            logging.WARNING,
            frontend_id=frontend_id,
            requests=len(request_ids),
            backlog_steps=self.config.lane_max_backlog_steps,
        )

    # ---------------------------------------------------------------- RPCs

    async def Submissions(self, request_iterator, context):
        """The submissions of one frontend: one SubmitOutcomes per SubmitBatch, each submission with its own span
        parented by the trace context it carries."""
        caller = InstanceCheck(context, FRONTEND, "Submissions")
        async for batch in request_iterator:
            yield cluster_pb2.SubmitOutcomes(outcome=[self._batched_outcome(submit, caller) for submit in batch.submit])

    def _batched_outcome(self, submit: cluster_pb2.SubmitRequest, caller: InstanceCheck) -> cluster_pb2.SubmitOutcome:
        engine_request = submit.request
        refusal = self._not_taken(engine_request, caller)
        if refusal is None:
            if logger.isEnabledFor(logging.DEBUG):
                self._awaiting_first_event[engine_request.request_id] = time.monotonic()
                log_event(
                    logger,
                    "request submitted",
                    logging.DEBUG,
                    request_id=engine_request.request_id,
                    traceparent=submit.traceparent or "-",
                )
            carried = (
                (("traceparent", submit.traceparent), ("tracestate", submit.tracestate)) if submit.traceparent else ()
            )
            span = tracing.start_server_span(
                SUBMIT_SPAN,
                carried,
                {
                    "rpc.system": "grpc",
                    "openengine.request_id": request_id_of(engine_request.request_id),
                    "openengine.attempt_id": engine_request.request_id,
                    "openengine.node_id": self.node_id,
                },
            )
            refusal = self._submit(engine_request, span)
            tracing.end_span(span, None if refusal is None else f"{refusal[0].name}: {refusal[1]}")
            if refusal is not None:
                self._awaiting_first_event.pop(engine_request.request_id, None)
        if refusal is None:
            return _SUBMITTED
        return cluster_pb2.SubmitOutcome(refusal_code=refusal[0].value[0], refusal=refusal[1])

    def _not_taken(
        self, engine_request: cluster_pb2.EngineRequest, caller: InstanceCheck
    ) -> tuple[grpc.StatusCode, str] | None:
        """Why this node takes no request from this frontend now (the code and message of the refusal)."""
        if not caller.allows(engine_request.frontend_id):  # results go only to the caller's own lane
            return grpc.StatusCode.PERMISSION_DENIED, caller.refusal(engine_request.frontend_id)
        if self.draining:
            return grpc.StatusCode.UNAVAILABLE, f"node {self.node_id} is draining"
        if engine_request.frontend_id not in self.lanes:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"frontend {engine_request.frontend_id!r} has no open result lane on this node",
            )
        return None

    def _submit(self, engine_request: cluster_pb2.EngineRequest, span) -> tuple[grpc.StatusCode, str] | None:
        """Hands the request to the engine; the refusal (code, message) when it does not take it."""
        try:
            if engine_request.lora_name:  # the engine loads it from here if it has not yet
                engine_request.lora_path = lora_file(self.config.lora_dir, engine_request.lora_path)
            self.link.submit(engine_request)
        except LoraFileError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except EngineFull as exc:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        except EngineUnavailable as exc:
            return grpc.StatusCode.UNAVAILABLE, str(exc)
        except ValueError as exc:  # a request this engine cannot take (duplicate id, too many sequences)
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        if span is not None:
            load = self.link.load
            span.set_attributes({"openengine.engine.running": load.running, "openengine.engine.queued": load.queued})
        return None

    async def Cancel(self, request: cluster_pb2.CancelRequest, context) -> cluster_pb2.CancelReply:
        if caller_role(context) == FRONTEND:  # a frontend cancels its own requests only (the coordinator any)
            caller = InstanceCheck(context, FRONTEND, "Cancel")
            if request.hold:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "Cancel with hold (a deployment-wide Abort) is the coordinator's; a frontend cancels by request id",
                )
            lane = self.link.lane_of(request.request_id)
            if lane is not None and not caller.allows(lane):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, caller.refusal(lane))
        if request.hold:
            return self.link.abort(request.request_id)
        output_index = request.output_index if request.HasField("output_index") else None
        return cluster_pb2.CancelReply(found=self.link.cancel(request.request_id, output_index))

    async def SetLora(self, request: cluster_pb2.LoraCommand, context) -> cluster_pb2.LoraOutcome:
        command = cluster_pb2.LoraCommand()
        command.CopyFrom(request)
        if not command.unload:
            try:
                command.adapter.source_path = lora_file(self.config.lora_dir, request.adapter.source_path)
            except LoraFileError as exc:
                await context.abort(exc.code, str(exc))
        try:
            outcome = await self.link.set_lora(command)
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if outcome.error:
            await context.abort(STATUS_BY_NUMBER[outcome.refusal_code], outcome.error)
        outcome.adapter.source_path = request.adapter.source_path  # as the caller named it
        log_event(
            logger,
            "LoRA adapter unloaded" if command.unload else "LoRA adapter loaded",
            lora_name=command.adapter.lora_name,
            source_path=command.adapter.source_path,
        )
        return outcome

    async def Lane(self, request_iterator, context):
        opening = await anext(aiter(request_iterator), None)
        if opening is None:
            return
        await InstanceCheck(context, FRONTEND, "Lane").require(context, opening.frontend_id)
        lane = ResultLane(self.config.lane_max_backlog_steps, opening.window)

        async def read_credits() -> None:
            with contextlib.suppress(Exception):  # the call ended: the lane's own loop sees it
                async for credit in request_iterator:
                    lane.acknowledge(credit.handled)
                    for pause in credit.pauses:  # only this frontend's own requests
                        self.link.pause(pause.request_id, pause.resume, opening.frontend_id)

        credits = asyncio.create_task(read_credits(), name="lane-credits")
        try:
            async with contextlib.aclosing(self._serve_lane(opening.frontend_id, lane)) as messages:
                async for message in messages:
                    yield message
        finally:
            credits.cancel()

    async def _serve_lane(self, frontend_id: str, lane: ResultLane):
        self.lanes[frontend_id] = lane  # a reconnecting frontend replaces its old lane
        log_event(logger, "result lane opened", frontend_id=frontend_id, window=lane.window)
        try:
            yield _LANE_OPENED
            while True:
                message = await lane.take()
                first_events, lane.first_events = lane.first_events, []
                built_at = time.monotonic() if first_events else 0.0
                yield message
                lane.taken()  # resumed: gRPC took the message, it wants the next one
                if first_events:
                    _log_first_events(first_events, built_at, len(message.events))
        finally:
            if self.lanes.get(frontend_id) is lane:
                del self.lanes[frontend_id]
                cancelled = self._cancel_lane(frontend_id)
                log_event(logger, "result lane closed", frontend_id=frontend_id, cancelled_requests=cancelled)

    def _cancel_lane(self, frontend_id: str) -> int:
        """A frontend that lost its lane cannot receive results: free the engine slots of its requests."""
        request_ids = [rid for rid, lane in self.link.lanes_of_outstanding().items() if lane == frontend_id]
        for request_id in request_ids:
            self.link.cancel(request_id)
        return len(request_ids)

    async def GetNodeLoad(self, request, context) -> cluster_pb2.NodeEntry:
        return self.entry()

    async def GetModel(self, request, context) -> cluster_pb2.ModelCard:
        return self.card

    async def KvEvents(self, request: cluster_pb2.KvEventsRequest, context):
        if not self.card.prefix_cache:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, f"the {self.card.engine} engine here has no prefix cache: no KV events"
            )
        try:
            subscription = self.kv_events.subscribe(request.include_snapshot, request.start_sequence_number)
        except ReplayUnavailable as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        try:
            while True:
                try:
                    yield await subscription.next()
                except FellBehind as exc:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; subscribe again with include_snapshot"
                    )
        finally:
            subscription.close()

    # ---------------------------------------------------------------- state

    def state(self) -> cluster_pb2.NodeState:
        if self.draining:
            return cluster_pb2.NODE_STATE_DRAINING
        return cluster_pb2.NODE_STATE_READY if self.link.ready else cluster_pb2.NODE_STATE_STARTING

    def load(self) -> cluster_pb2.NodeLoad:
        """The engine's last reported load; running and queued count sequences, the unit max_batch limits."""
        load = self.link.load
        return cluster_pb2.NodeLoad(
            running_requests=load.running,
            queued_requests=load.queued,
            running_tokens=load.running_tokens,
            waiting_tokens=load.waiting_tokens,
            decode_batch_size=load.running,
            max_running_requests=self.config.max_batch,
            max_queued_requests=self.config.max_queue,
        )

    def entry(self) -> cluster_pb2.NodeEntry:
        return cluster_pb2.NodeEntry(
            node_id=self.node_id,
            address=self.config.resolved_advertise_address(),
            rank=max(self.rank, 0),
            state=self.state(),
            load=self.load(),
            model=self.card_summary,
        )

    # ---------------------------------------------------------------- coordinator

    async def coordinator_loop(self) -> None:
        """Registers with every coordinator (one, or the shards of a comma-separated address), then heartbeats."""
        await asyncio.gather(*(self._coordinator_loop(address) for address in self.config.coordinators()))

    def wake_coordinators(self) -> None:
        """Heartbeat every coordinator now, not at the next interval."""
        for wake in self.wakes.values():
            wake.set()

    async def _coordinator_loop(self, address: str) -> None:
        """Registers, then heartbeats state and load on one stream (`common/heartbeat_stream.py : PeerHeartbeats`);
        registers again whenever the coordinator forgot us."""
        wake = self.wakes.setdefault(address, asyncio.Event())
        drain_told = self.drain_told.setdefault(address, asyncio.Event())

        def drain_acknowledged(heartbeat: cluster_pb2.NodeHeartbeatRequest, reply: cluster_pb2.HeartbeatReply):
            if reply.known and heartbeat.state == cluster_pb2.NODE_STATE_DRAINING:
                drain_told.set()

        def registration_failed(exc: grpc.aio.AioRpcError) -> None:
            log_event(
                logger,
                "coordinator call failed",
                logging.WARNING,
                code=exc.code().name,
                detail=exc.details(),
                coordinator=address,
            )

        def heartbeat_failed(exc: HeartbeatFailed) -> None:
            log_event(
                logger,
                "coordinator heartbeat failed",
                logging.WARNING,
                code=exc.code.name,
                detail=exc.detail,
                coordinator=address,
                failures=heartbeats.failures,
            )

        async with internal_channel(address, self.config) as channel:
            stub = cluster_pb2_grpc.CoordinatorStub(channel)
            heartbeats = HeartbeatStream(stub.NodeHeartbeats, self.config.rpc_timeout_s)
            await PeerHeartbeats(
                heartbeats,
                interval_s=1.0,
                register=lambda: self._register(stub, address),
                heartbeat=lambda: cluster_pb2.NodeHeartbeatRequest(
                    node_id=self.node_id, state=self.state(), load=self.load()
                ),
                # Quiet: no reply awaited, except the drain's (its acknowledgement) and the stream's checks.
                quiet=lambda heartbeat: heartbeat.state != cluster_pb2.NODE_STATE_DRAINING,
                on_reply=drain_acknowledged,
                on_register_failed=registration_failed,
                on_heartbeat_failed=heartbeat_failed,
                wake=wake,
            ).run()

    async def _register(self, stub: cluster_pb2_grpc.CoordinatorStub, address: str) -> float:
        """Registers; returns the heartbeat interval asked for. Without a rank yet, the first coordinator that
        answers assigns it, one registration at a time: the others are then asked for that same rank, so the
        node has one rank on every coordinator."""
        async with contextlib.AsyncExitStack() as stack:
            if self.rank < 0:
                await stack.enter_async_context(self.rank_assignment)
            request = cluster_pb2.RegisterNodeRequest(node=self.entry(), auto_rank=self.rank < 0)
            reply = await stub.RegisterNode(request, timeout=self.config.rpc_timeout_s)
            self.rank = self.kv_events.rank = reply.assigned_rank
        log_event(logger, "registered with coordinator", node_id=self.node_id, rank=self.rank, coordinator=address)
        return reply.heartbeat_interval_s

    async def health_loop(self) -> None:
        """Readiness follows the engine worker: NOT_SERVING while it is (re)spawning, and from the drain on."""
        while True:
            self.readiness_changed.clear()
            await self.health.set_ready(self.link.ready and not self.draining)
            metrics.WORKER_RESTARTS.set(self.link.restarts)
            await self.readiness_changed.wait()

    async def flush_lanes(self, timeout: float) -> None:
        """Waits until every result lane handed its queued messages to gRPC, or `timeout`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(lane.idle.wait() for lane in self.lanes.values())), timeout)

    async def drain(self, timeout: float) -> None:
        self.draining = True
        self.readiness_changed.set()
        await self.health.start_drain()
        self.wake_coordinators()  # tell the coordinators now, not at the next heartbeat
        if not await self.link.wait_idle(timeout):
            log_event(
                logger,
                "drain deadline reached",
                logging.WARNING,
                open_requests=len(self.link.outstanding),
                open_sequences=self.link.open_sequences,
            )
            self.link.fail_all("node is shutting down (drain deadline reached)", retryable=True)
        # An idle node gets here at once: wait (bounded) until every coordinator heard of the drain, so that
        # none keeps routing new requests to this node after it stopped.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.rpc_timeout_s):
                await asyncio.gather(*(told.wait() for told in self.drain_told.values()))


async def serve(config: NodeConfig, stop: asyncio.Event) -> int:
    node_id = config.node_id or f"node-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    card = load_card(config)  # before anything binds: a missing model stops the node with what to do
    service = NodeService(config, node_id, card)
    server = create_internal_server(role_checks(config))
    cluster_pb2_grpc.add_NodeServicer_to_server(service, server)
    service.health.register(server)
    add_internal_port(server, bind_address(config.host, config.port), config)
    await server.start()
    await service.health.start()
    start_metrics(config.metrics_port, host=config.metrics_bind_host())
    log_event(
        logger,
        "node listening",
        node_id=node_id,
        port=config.port,
        advertise=config.resolved_advertise_address(),
        grpc_server="grpcio",
    )
    await service.link.start()
    log_event(
        logger,
        "engine worker ready",
        launcher_pid=service.link.launcher_pid,
        pids=list(service.link.worker_pids),
        engine=card.engine,
        model=card.name,
        context_length=card.context_length,
        max_batch=config.max_batch,
    )
    tasks = [asyncio.create_task(service.health_loop()), asyncio.create_task(service.coordinator_loop())]
    await stop.wait()
    log_event(logger, "draining", timeout_s=config.drain_timeout_s)
    await service.drain(config.drain_timeout_s)
    await service.flush_lanes(config.stop_grace_s)  # the drain's last results reach their frontends
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.stop(grace=config.stop_grace_s)
    await service.link.stop(timeout=config.engine_stop_timeout_s)
    log_event(logger, "node stopped", node_id=node_id)
    return 0
