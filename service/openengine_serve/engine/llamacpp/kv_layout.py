"""The llama.cpp engine's KV layout: per-sequence streams for the requests that fit one, a shared cache for the rest.

Attention over a KV cache shared by every sequence walks the cells of all of them: at 32 short streams on a
2-core CPU that costs about a fifth of the decode (docs/engines.md). llama-server's default gives each slot a
stream of its own (context / slots cells) instead, which caps a request at that stream. The engine keeps both:

- the **stream engine** (a LlamaEngine with `stream_cells`): each running output owns a stream of
  `stream_cells` = OPENENGINE_CONTEXT_SIZE / OPENENGINE_MAX_BATCH cells (rounded up to 256, as llama.cpp does);
- the **shared engine** (a LlamaEngine as before): one cache of OPENENGINE_CONTEXT_SIZE cells any sequence may
  fill, up to the model's trained context.

A request goes to the stream engine when its prompt and max_tokens fit a stream, or when its prompt fills at most
half of one (most answers end well before max_tokens); else to the shared engine. An output that outgrows its
stream moves to the shared engine before its next token, its KV cells copied with it (llama.cpp's per-sequence
state); where the shared cache has no room for them in one piece, it reads its prompt and output again there
(recompute, as a preemption does). Nothing it streamed is sent twice.

Both engines map the same GGUF file (the OS shares its pages), compile each guide once, report one set of KV
blocks, and share OPENENGINE_MAX_BATCH: the stream engine admits at most what the shared engine's running and
queued requests leave, the shared engine what the stream engine's running ones leave. A step decodes each
engine that has work: two graph evaluations when both do. Recurrent models (no per-token cells) and a batch of one
use the shared engine alone.
"""

from __future__ import annotations

import logging

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.logging_setup import log_event
from openengine_serve.engine.config import WorkerConfig
from openengine_serve.engine.interface import Engine, EngineLoad
from openengine_serve.engine.llamacpp.engine import LlamaEngine

logger = logging.getLogger("openengine_serve.engine")

LLAMA_CELL_PADDING = 256  # llama.cpp rounds a stream's cells up to a multiple of this


def stream_cells(context_size: int, max_batch: int) -> int:
    """Cells of each sequence's stream: the context split over the batch, as llama-server's -c / -np."""
    return -(-context_size // max_batch // LLAMA_CELL_PADDING) * LLAMA_CELL_PADDING


class KvLayoutEngine(Engine):
    def __init__(self, config: WorkerConfig) -> None:
        self.max_batch = config.max_batch
        self.shared = LlamaEngine(config)
        cells = stream_cells(config.context_size, config.max_batch)
        self.stream_cells = cells if config.max_batch > 1 and not self.shared.model.recurrent else 0
        self.streams: LlamaEngine | None = None
        if self.stream_cells:
            self.streams = LlamaEngine(
                config,
                stream_cells=self.stream_cells,
                matchers=self.shared.matchers,
                ledger=self.shared.prefix_cache.blocks,
                arrivals=self.shared.arrivals,
            )
        self.context_size = self.shared.context_size
        log_event(
            logger,
            "KV layout",
            streams=config.max_batch if self.stream_cells else 0,
            stream_cells=self.stream_cells,
            shared_cells=self.context_size,
        )

    @property
    def engines(self) -> tuple[LlamaEngine, ...]:
        return (self.streams, self.shared) if self.streams else (self.shared,)

    def fits_a_stream(self, request: cluster_pb2.EngineRequest) -> bool:
        prompt = len(request.prompt_token_ids)
        return prompt + request.max_tokens <= self.stream_cells or prompt <= self.stream_cells // 2

    # ------------------------------------------------------------ the interface

    @property
    def idle(self) -> bool:
        return all(engine.idle for engine in self.engines)

    def enqueue(self, request: cluster_pb2.EngineRequest) -> None:
        engine = self.streams if self.streams and self.fits_a_stream(request) else self.shared
        engine.enqueue(request)

    def cancel(self, cancel: cluster_pb2.CancelRequest, events: list[bytes]) -> None:
        for engine in self.engines:
            engine.cancel(cancel, events)

    def pause(self, pause: cluster_pb2.PauseRequest) -> None:
        for engine in self.engines:
            engine.pause(pause)

    def step(self, events: list[bytes]) -> bool:
        if self.streams is None:
            return self.shared.step(events)
        for state in self.streams.release_outgrown(self.stream_cells):
            log_event(logger, "outgrew its KV stream: goes on in the shared cache", request_id=state.request_id)
            self.shared.adopt(state)
        # The stream engine leaves room for the shared engine's queue too: else short requests arriving all the
        # time would keep a long one waiting.
        # Guided outputs share OPENENGINE_MAX_GUIDED_SEQUENCES the same way.
        shared, streams = self.shared, self.streams
        streams.set_max_batch(max(0, self.max_batch - shared.running_sequences - shared.queued_sequences))
        streams.guided_elsewhere = shared.guided_sequences
        stepped = streams.step(events)
        shared.set_max_batch(max(0, self.max_batch - streams.running_sequences))
        shared.guided_elsewhere = streams.guided_sequences
        return shared.step(events) or stepped

    def load(self) -> EngineLoad:
        loads = [engine.load() for engine in self.engines]
        return EngineLoad(
            running=sum(load.running for load in loads),
            queued=sum(load.queued for load in loads),
            running_tokens=sum(load.running_tokens for load in loads),
            waiting_tokens=sum(load.waiting_tokens for load in loads),
            prefilled_tokens=sum(load.prefilled_tokens for load in loads),
            cached_prompt_tokens=sum(load.cached_prompt_tokens for load in loads),
            cached_blocks=len(self.shared.prefix_cache.blocks),
            running_loras=sorted({lora for load in loads for lora in load.running_loras}),
            waiting_loras=sorted({lora for load in loads for lora in load.waiting_loras}),
        )

    def set_lora(self, command: cluster_pb2.LoraCommand) -> cluster_pb2.LoraOutcome:
        outcomes = [engine.set_lora(command) for engine in self.engines]
        return next((outcome for outcome in outcomes if outcome.error), outcomes[0])

    def take_kv_events(self) -> list[kv_pb2.KvEvent]:
        return self.shared.take_kv_events()  # the engines' one ledger

    def close(self) -> None:
        for engine in reversed(self.engines):  # the shared engine owns the guide matchers: closed last
            engine.close()
