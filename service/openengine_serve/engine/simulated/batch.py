"""The simulated engine: its queue and running batch (admission, cancellation, pausing, one token per output
per step) behind the engine interface (engine/interface.py).

No sockets and no MPI (the worker, engine/worker.py, owns those), so the
batching arithmetic is tested on its own. `running` and `queued` count
sequences (outputs), the unit `max_batch` limits; requests are admitted whole,
by priority (higher first), then each API key's fair share of the batch (engine/fair_share.py), then FIFO; a
request of a key above its share may be preempted for one within its share. A paused request (its client takes no
output) keeps its slot but gets no token until it is resumed: the steps skip it. Paused past PAUSED_SLOT_GRACE_S while
a request waits for room, it is parked (out of the batch); resumed, it rejoins the queue in its place.

EngineStep messages are assembled from pre-encoded pieces: building a protobuf
object per token costs several microseconds, which at hundreds of running
sequences would eat the 2 ms step. The pieces are laid out in field-number
order, so the bytes equal protobuf's own serialization of the same message
(tests/unit/test_engine_batch.py checks it).
"""

from __future__ import annotations

import heapq
import itertools
import time

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.api.openengine_internal.v1.cluster_pb2 import (
    ENGINE_FINISH_CANCELLED,
    ENGINE_FINISH_EOS,
    ENGINE_FINISH_STOP_TOKEN,
)
from openengine_serve.common.vocab import VOCAB_SIZE
from openengine_serve.common.wire.protobuf import field_tag, length_delimited, varint
from openengine_serve.engine.config import WorkerConfig
from openengine_serve.engine.fair_share import PAUSED_SLOT_GRACE_S, FairQueue
from openengine_serve.engine.interface import Engine, EngineLoad, event_field
from openengine_serve.engine.simulated import model

_FINISH_WITH_TOKEN = (ENGINE_FINISH_EOS, ENGINE_FINISH_STOP_TOKEN)

_TOKENS_TAG = field_tag(cluster_pb2.OutputEvent, "tokens")
_TOKEN_ID_TAG = field_tag(cluster_pb2.TokenRecord, "token_id")


def encode_token_fields() -> tuple[bytes, ...]:
    """token id -> the encoded `OutputEvent.tokens` entry holding just that token."""
    return tuple(length_delimited(_TOKENS_TAG, _TOKEN_ID_TAG + varint(token_id)) for token_id in range(VOCAB_SIZE))


class _RunningRequest:
    """A request in the batch with the encoded fields around the token of each output's events:
    request_id and output_index (fields 1, 2) before it, lane (field 9) after it."""

    __slots__ = ("state", "event_heads", "event_tail", "held_tokens", "paused_at")

    def __init__(self, state: model.RequestState) -> None:
        self.state = state
        self.held_tokens = 0  # while paused: its tokens in the batch (they do not change until it resumes)
        self.paused_at = 0.0  # time.monotonic() when paused
        self.event_heads = {
            index: cluster_pb2.OutputEvent(request_id=state.request_id, output_index=index).SerializeToString()
            for index in state.outputs
        }
        self.event_tail = cluster_pb2.OutputEvent(lane=state.lane).SerializeToString()


class Batch:
    """The queue and the batch of one engine; see the module docstring."""

    def __init__(self, max_batch: int, token_fields: tuple[bytes, ...] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self._token_fields = token_fields if token_fields is not None else encode_token_fields()
        self._queued: dict[str, model.RequestState] = {}
        # (-priority, arrival, state): entries of cancelled requests stay until popped.
        self._queue_order: list[tuple[int, int, model.RequestState]] = []
        self._arrivals = itertools.count()
        self.queued_sequences = 0
        self.waiting_tokens = 0
        self._running: dict[str, _RunningRequest] = {}
        self._paused: dict[str, _RunningRequest] = {}  # admitted, holding their slots, skipped by the steps
        self.paused_tokens = 0  # the running tokens of the paused requests
        self._parked: dict[str, model.RequestState] = {}  # paused and out of the batch until resumed
        self.paused_slot_grace_s = PAUSED_SLOT_GRACE_S
        self.running_sequences = 0  # paused ones included
        self._fair = FairQueue(
            max_batch,
            state_of=lambda entry: entry[2],
            priority_of=lambda entry: entry[0],
            owner_of=lambda state: state.request.owner,
            sequences_of=lambda state: len(state.outputs),
            weight_of=lambda state: state.request.share_weight or 1,
        )

    @property
    def idle(self) -> bool:
        """Nothing to step: no request queued, and every admitted one (if any) paused."""
        return not self._running and not self._queued

    @property
    def running_request_ids(self) -> list[str]:
        return list(self._running) + list(self._paused)

    @property
    def paused_request_ids(self) -> list[str]:
        return list(self._paused)

    @property
    def queued_request_ids(self) -> list[str]:
        return list(self._queued)

    # ------------------------------------------------------------ commands

    def enqueue(self, request: cluster_pb2.EngineRequest) -> None:
        state = model.RequestState(request)
        state.order = (-request.priority, next(self._arrivals))
        self._queue(state)

    def _queue(self, state: model.RequestState) -> None:
        self._queued[state.request_id] = state
        heapq.heappush(self._queue_order, (*state.order, state))
        self.queued_sequences += len(state.outputs)
        self.waiting_tokens += state.prompt_length * len(state.outputs)

    def pause(self, pause: cluster_pb2.PauseRequest) -> None:
        """Pauses or resumes an admitted request; a queued, unknown or finished one is left as it is (a request
        is paused once its client stopped taking output, so it has run)."""
        request_id = pause.request_id
        if pause.resume and request_id in self._parked:
            self._queue(self._parked.pop(request_id))
            return
        if pause.resume:
            running = self._paused.pop(request_id, None)
            if running is not None:
                self.paused_tokens -= running.held_tokens
                self._running[request_id] = running
            return
        running = self._running.pop(request_id, None)
        if running is not None:
            running.held_tokens = _tokens_of(running.state)
            running.paused_at = time.monotonic()
            self.paused_tokens += running.held_tokens
            self._paused[request_id] = running

    def cancel(self, cancel: cluster_pb2.CancelRequest, events: list[bytes]) -> None:
        """Finishes the request (or one output) CANCELLED, appending the events; unknown ids are ignored."""
        request_id = cancel.request_id
        running = self._running.get(request_id) or self._paused.get(request_id)
        parked = self._parked.get(request_id)
        state = running.state if running else (self._queued.get(request_id) or parked)
        if state is None:
            return  # already finished, or never arrived
        indices = [cancel.output_index] if cancel.HasField("output_index") else list(state.outputs)
        for index in indices:
            if state.outputs.pop(index, None) is None:
                continue
            events.append(self._event(state, index, ENGINE_FINISH_CANCELLED))
            if running:
                self.running_sequences -= 1
            elif not parked:
                self.queued_sequences -= 1
                self.waiting_tokens -= state.prompt_length
        if running is not None and request_id in self._paused:  # what it holds shrank (to 0 once every output ended)
            self.paused_tokens -= running.held_tokens
            running.held_tokens = _tokens_of(state)
            self.paused_tokens += running.held_tokens
        if not state.outputs:
            if running:
                self._running.pop(request_id, None)
                self._paused.pop(request_id, None)
            elif parked:
                del self._parked[request_id]
            else:
                del self._queued[request_id]

    # ------------------------------------------------------------ steps

    def admit(self) -> None:
        """Moves queued requests into the batch (priority, then fair share, then arrival) while their sequences
        fit, preempting requests of a key above its share for one within its share."""
        order = self._queue_order
        if not order:
            return
        admitted = [r.state for r in self._running.values()] + [r.state for r in self._paused.values()]
        running = self._fair.running_by_owner(admitted)
        weights = self._fair.weights([*admitted, *self._queued.values()])
        while order:
            entry = self._fair.pick(order, self._is_queued, running, weights)
            if entry is None:
                return
            state = entry[2]
            sequences = len(state.outputs)
            # Whole requests only; one larger than the batch runs alone rather than never.
            while self.running_sequences and self.running_sequences + sequences > self.max_batch:
                idle = self._paused_past_grace()
                if idle is not None:
                    self._park(idle)
                    running[idle.state.request.owner] -= len(idle.state.outputs)
                    continue
                victim = self._fair.victim(state, [r.state for r in self._running.values()], running, weights)
                if victim is None:
                    heapq.heappush(order, entry)
                    return
                self._preempt(victim)
                running[victim.request.owner] -= len(victim.outputs)
            del self._queued[state.request_id]
            self.queued_sequences -= sequences
            self.waiting_tokens -= state.prompt_length * sequences
            self._running[state.request_id] = _RunningRequest(state)
            self.running_sequences += sequences
            running[state.request.owner] += sequences

    def _is_queued(self, state: model.RequestState) -> bool:
        return self._queued.get(state.request_id) is state  # else cancelled while queued

    def _paused_past_grace(self) -> _RunningRequest | None:
        """The request paused longest, if that is longer than the grace."""
        now = time.monotonic()
        paused = [r for r in self._paused.values() if now - r.paused_at >= self.paused_slot_grace_s]
        return min(paused, key=lambda r: r.paused_at) if paused else None

    def _park(self, running: _RunningRequest) -> None:
        """A paused request leaves the batch until resumed (then it is queued in its place)."""
        del self._paused[running.state.request_id]
        self.paused_tokens -= running.held_tokens
        self.running_sequences -= len(running.state.outputs)
        self._parked[running.state.request_id] = running.state

    def _preempt(self, state: model.RequestState) -> None:
        """Back to the queue in its place; it continues where it stopped when admitted again."""
        del self._running[state.request_id]
        self.running_sequences -= len(state.outputs)
        self._queue(state)

    def generate(self, events: list[bytes]) -> int:
        """One token for every running output not paused, appending the events; returns the running tokens after
        the step (paused requests' included)."""
        token_fields = self._token_fields
        append = events.append
        finished_requests = []
        running_tokens = self.paused_tokens
        for running in self._running.values():
            state = running.state
            next_token = state.next_token
            heads = running.event_heads
            tail = running.event_tail
            for sequence in tuple(state.outputs.values()):
                token_id, finish, record = next_token(sequence)
                if finish or record is not None or sequence.position == 1:
                    # Rare shapes (finish, logprobs, a first event) take the protobuf path.
                    append(
                        self._event(
                            state, sequence.output_index, finish, token_id, record, first=sequence.position == 1
                        )
                    )
                    if finish:
                        self.running_sequences -= 1
                        continue
                else:
                    append(event_field(heads[sequence.output_index] + token_fields[token_id] + tail))
                running_tokens += sequence.position
            running_tokens += state.prompt_length * len(state.outputs)
            if not state.outputs:
                finished_requests.append(state.request_id)
        for request_id in finished_requests:
            del self._running[request_id]
        return running_tokens

    def load(self, running_tokens: int) -> EngineLoad:
        """The load figures after a step that left `running_tokens` (Batch.generate's result)."""
        return EngineLoad(self.running_sequences, self.queued_sequences, running_tokens, self.waiting_tokens)

    @staticmethod
    def _event(
        state: model.RequestState,
        output_index: int,
        finish: cluster_pb2.EngineFinish,
        token_id: int | None = None,
        record: cluster_pb2.TokenRecord | None = None,
        first: bool = False,
    ) -> bytes:
        event = cluster_pb2.OutputEvent(
            request_id=state.request_id, output_index=output_index, lane=state.lane, finish=finish, first=first
        )
        if token_id is not None:
            event.tokens.append(record if record is not None else cluster_pb2.TokenRecord(token_id=token_id))
            if finish in _FINISH_WITH_TOKEN:
                event.finish_token_id = token_id
        prompt_records = state.take_prompt_records(output_index)
        if prompt_records:
            event.prompt_tokens.extend(prompt_records)
        return event_field(event.SerializeToString())


def _tokens_of(state: model.RequestState) -> int:
    """The tokens a request holds in the batch: its prompt and what it generated, per open output."""
    return sum(state.prompt_length + sequence.position for sequence in state.outputs.values())


class SimulatedEngine(Engine):
    """The engine interface over one Batch: a step every `step_ms`, one token per running output."""

    def __init__(self, config: WorkerConfig) -> None:
        model.warm_up()
        self.step_period_s = config.step_ms / 1000.0
        self._batch = Batch(config.max_batch)
        self._running_tokens = 0

    @property
    def idle(self) -> bool:
        return self._batch.idle

    def enqueue(self, request: cluster_pb2.EngineRequest) -> None:
        self._batch.enqueue(request)

    def cancel(self, cancel: cluster_pb2.CancelRequest, events: list[bytes]) -> None:
        self._batch.cancel(cancel, events)

    def pause(self, pause: cluster_pb2.PauseRequest) -> None:
        self._batch.pause(pause)

    def step(self, events: list[bytes]) -> bool:
        self._batch.admit()
        self._running_tokens = self._batch.generate(events)
        return True

    def load(self) -> EngineLoad:
        # While idle the batch holds only paused requests: their tokens.
        return self._batch.load(self._batch.paused_tokens if self._batch.idle else self._running_tokens)
