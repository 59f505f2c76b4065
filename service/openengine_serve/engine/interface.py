"""The one interface every engine implements, and the step message the worker sends for all of them.

The worker loop (engine/worker.py) owns the sockets and the pacing; an engine
owns its queue, its batch and its model:

- created from the WorkerConfig (engine/worker.py `create_engine`): loads the model;
- `enqueue`: a new request waits for admission;
- `step`: admits what fits (batch slots, KV cache), runs one step (prompt
  chunks and one token for every running output) and appends the step's
  OutputEvents; finished outputs free their slot and KV cache;
- `cancel`, `pause`: a request (or one output) ends CANCELLED, or is paused
  (it keeps its slot and KV cache but gets no tokens) and resumed;
- `load`: the running and queued sequences and tokens the node reports;
- `take_kv_events`: what its prefix cache stored and removed since the last call (common/kv_blocks.py).

Events are appended already serialized as EngineStep's `events` field
(`event_field`), so an engine may hand-encode the common shapes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.wire.protobuf import field_tag, length_delimited

_EVENTS_TAG = field_tag(cluster_pb2.EngineStep, "events")


class EngineLoad(NamedTuple):
    """An engine's load after a step: what it reports in EngineStep, and what the node keeps of the last one."""

    running: int = 0  # sequences admitted (paused ones included)
    queued: int = 0  # sequences waiting for admission
    running_tokens: int = 0  # tokens the admitted sequences hold (prompt and output)
    waiting_tokens: int = 0  # prompt tokens of the queued sequences
    prefilled_tokens: int = 0  # prompt tokens read in the last step
    cached_prompt_tokens: int = 0  # prompt tokens admitted in the last step with their KV from the prefix cache
    cached_blocks: int = 0  # KV blocks the prefix cache holds
    running_loras: Sequence[str] = ()  # LoRA adapters of the admitted requests
    waiting_loras: Sequence[str] = ()  # LoRA adapters of the queued requests


class Engine(ABC):
    # The least time between two steps (the simulated engine's step); 0: step as fast as the model runs.
    step_period_s: float = 0.0

    @property
    @abstractmethod
    def idle(self) -> bool:
        """Nothing to step: no request queued, and every admitted one (if any) paused."""

    @abstractmethod
    def enqueue(self, request: cluster_pb2.EngineRequest) -> None:
        """A new request; it is admitted by a later `step` when it fits."""

    @abstractmethod
    def cancel(self, cancel: cluster_pb2.CancelRequest, events: list[bytes]) -> None:
        """Finishes the request (or one output) CANCELLED, appending the events; unknown ids are ignored."""

    @abstractmethod
    def pause(self, pause: cluster_pb2.PauseRequest) -> None:
        """Pauses or resumes an admitted request; others are left as they are."""

    @abstractmethod
    def step(self, events: list[bytes]) -> bool:
        """Admits what fits and runs one step, appending its events; False when there was nothing to run."""

    @abstractmethod
    def load(self) -> EngineLoad:
        """The figures of the last step."""

    def set_lora(self, command: cluster_pb2.LoraCommand) -> cluster_pb2.LoraOutcome:
        """Loads or unloads a LoRA adapter (the node checked its path)."""
        return cluster_pb2.LoraOutcome(
            adapter=command.adapter,
            error="this engine has no LoRA adapters",
            refusal_code=9,  # FAILED_PRECONDITION
        )

    def take_kv_events(self) -> list[kv_pb2.KvEvent]:
        """The prefix cache's KV events since the last call (none without a prefix cache)."""
        return []

    def close(self) -> None:  # noqa: B027 (optional: engines holding nothing native leave it empty)
        """Frees the model (the process is about to exit)."""


def event_field(event_payload: bytes) -> bytes:
    """A serialized OutputEvent as EngineStep's `events` field."""
    return length_delimited(_EVENTS_TAG, event_payload)


def step_message(
    step: int,
    events: list[bytes],
    load: EngineLoad,
    step_seconds: float,
    worker_pids: list[int],
    kv_events: Sequence[kv_pb2.KvEvent] = (),
    lora_outcomes: Sequence[cluster_pb2.LoraOutcome] = (),
) -> bytes:
    """The serialized EngineStep: `step` (field 1), the events (2), then the load fields (4..12), the KV events
    (13) and the LoRA fields (14..16), in field order, so the bytes equal protobuf's own serialization of the same
    message."""
    figures = cluster_pb2.EngineStep(
        running=load.running,
        queued=load.queued,
        running_tokens=load.running_tokens,
        waiting_tokens=load.waiting_tokens,
        step_seconds=step_seconds,
        worker_pids=worker_pids,
        prefilled_tokens=load.prefilled_tokens,
        cached_prompt_tokens=load.cached_prompt_tokens,
        cached_blocks=load.cached_blocks,
        kv_events=kv_events,
        lora_outcomes=lora_outcomes,
        running_loras=load.running_loras,
        waiting_loras=load.waiting_loras,
    ).SerializeToString()
    return cluster_pb2.EngineStep(step=step).SerializeToString() + b"".join(events) + figures
