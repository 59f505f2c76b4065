"""The llama.cpp engine: continuous batching of a real GGUF model in one llama.cpp context (kv_layout.py runs two:
per-sequence KV streams and a shared KV cache).

It works as llama.cpp's own server does with parallel slots, from Python, with
Python's work per step and per sequence rather than per token of a prompt:

- Every admitted output is a llama.cpp sequence (a `seq_id`), in a KV cache
  shared by all of them or in a stream of its own (runtime.py). In streams,
  running outputs keep contiguous ids (`_compact`) and prefix cache entries
  take the ids above them.
- Each step is one decode batch: one token for every running output, then
  chunks of the admitted prompts up to `prefill_chunk` tokens (chunked
  prefill: running streams keep getting a token every step while a long
  prompt is read; a prompt read for its logprobs gets at most
  PROMPT_LOGPROB_ROWS_PER_STEP rows a step). Logits are computed only where a token is sampled, or, when
  prompt logprobs were asked, for the prompt's tokens.
- A request with several outputs reads its prompt once: when the prompt is in,
  the other outputs share its KV cells and each samples its first token from
  the same logits row.
- Requests are admitted by priority, then each API key's fair share of the batch
  (engine/fair_share.py: a request of a key above its share may be preempted
  for one within its share), then in arrival order, while their outputs
  fit in `max_batch` and their prompt fits in the free KV cells. When the
  running outputs would outgrow the KV cache, the request admitted last is
  preempted: its KV is freed and it goes back to the head of the queue, to
  read its prompt and its output so far again (vLLM's recompute preemption);
  nothing it already streamed is sent again.
- A finished, cancelled or failed output frees its sequence's KV cells at once;
  a paused request (its client reads nothing) keeps them and gets no tokens
  until resumed. Paused past `PAUSED_SLOT_GRACE_S` while another request waits
  for room in the batch, it is parked: it leaves the batch (a one-output
  request's cells go to the prefix cache, kept while the KV budget allows) and
  rejoins the queue in its place when resumed, reading again only what the
  cache no longer holds.
- Prefix cache (prefix_cache.py): an ended request's KV cells are kept, least
  recently used first within `prefix_cache_tokens`; a new prompt starting with
  the same tokens (under the same `cache_salt`) shares them and reads only the
  rest of its prompt. A running request's cells are shared the same way, as far
  as it has read them: requests sent together with one system prompt read it once.
- Guided decoding (llguidance): a request's guide is compiled off the step
  loop, in a thread, once per grammar (common/guides.py GuideMatchers: kept
  by content; the request waits queued meanwhile, and a compile whose requests
  all left is dropped before it starts); each step its outputs'
  logits are masked to what the grammar allows, at most
  `max_guided_sequences` guided outputs at once.
- LoRA adapters (lora.py): llama.cpp applies adapters to the whole context, so a step decodes the running
  outputs of each adapter (and of the base model) in a batch of their own, one after the other, and samples each
  batch before the next decode overwrites the logits; the prompt chunk budget is shared. The prefix cache and the
  KV block hashes keep each adapter's KV apart (common/kv_blocks.py `cache_namespace`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.api.openengine_internal.v1.cluster_pb2 import (
    ENGINE_FINISH_CANCELLED,
    ENGINE_FINISH_EOS,
    ENGINE_FINISH_ERROR,
    ENGINE_FINISH_LENGTH,
    ENGINE_FINISH_NONE,
    ENGINE_FINISH_STOP_TOKEN,
)
from openengine_serve.common import guides
from openengine_serve.common.kv_blocks import BlockLedger, cache_namespace
from openengine_serve.common.logging_setup import log_event
from openengine_serve.engine.config import WorkerConfig
from openengine_serve.engine.fair_share import PAUSED_SLOT_GRACE_S, FairQueue
from openengine_serve.engine.interface import Engine, EngineLoad, event_field
from openengine_serve.engine.llamacpp.lora import Adapters, LoraError
from openengine_serve.engine.llamacpp.prefix_cache import MIN_REUSE_TOKENS, PrefixCache, common_prefix
from openengine_serve.engine.llamacpp.runtime import LlamaError, LlamaModel, TokenBatch
from openengine_serve.engine.llamacpp.sampling import OutputSampler, log_softmax, token_record

logger = logging.getLogger("openengine_serve.engine")

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
MAX_CACHED_PREFIXES = 64  # sequences the prefix cache may hold (within LLAMA_MAX_SEQ with the running ones)
# Prompt logprob rows read per step, all requests together: each costs the step about 0.6 ms of Python and numpy
# (SmolLM2's 49k vocabulary), so a long prompt's rows take many steps rather than stall one for every stream.
PROMPT_LOGPROB_ROWS_PER_STEP = 32


class _Output:
    """One output of a request: its tokens (prompt, then output) and how many of them are in the KV cache."""

    __slots__ = ("index", "seq_id", "tokens", "cached", "shares_prompt", "generated", "sampler")

    def __init__(self, index: int, prompt: list[int], sampler: OutputSampler) -> None:
        self.index = index
        self.seq_id = -1  # while admitted
        self.tokens = list(prompt)
        self.cached = 0
        self.shares_prompt = False  # its first len(prompt) cells are the request's shared prompt cells
        self.generated = 0
        self.sampler = sampler


class _Request:
    """A request in the engine, queued or admitted."""

    __slots__ = (
        "request",
        "request_id",
        "lane",
        "prompt",
        "outputs",
        "order",
        "paused",
        "paused_at",
        "forked",
        "prompt_cells",
        "prompt_records",
        "prompt_records_sent",
        "guide",
        "cached_prompt_tokens",
        "shared_cells",
        "cache_reported",
        "shared_from",
        "carried",
    )

    def __init__(
        self, request: cluster_pb2.EngineRequest, order: tuple[int, int], vocab_size: int, end_of_generation: np.ndarray
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.lane = request.frontend_id
        self.prompt = list(request.prompt_token_ids)
        self.outputs = {
            index: _Output(index, self.prompt, OutputSampler(request, index, vocab_size, end_of_generation))
            for index in range(max(1, request.num_sequences))
        }
        self.order = order  # (-priority, arrival): the queue's order, kept when preempted
        self.paused = False
        self.paused_at = 0.0  # time.monotonic() when paused
        self.forked = False  # the outputs beyond the first have taken the prompt's KV cells
        self.prompt_cells = 0  # KV cells of the prompt shared by the forked outputs
        self.prompt_records: list[cluster_pb2.TokenRecord] | None = [] if request.prompt_logprobs else None
        self.prompt_records_sent = False
        self.guide: Future | None = None  # the guide's compilation, while it runs
        self.cached_prompt_tokens = 0  # prompt tokens whose KV came from the prefix cache (when first admitted)
        self.shared_cells = 0  # cells its leader shares with the sequence `shared_from`
        self.cache_reported = False  # the first event told the frontend how many
        self.shared_from = -1  # the sequence (a prefix cache entry or a running output) whose cells it shares
        # output index -> its KV cells exported by the engine it outgrew, and the tokens they hold (release_outgrown)
        self.carried: dict[int, tuple[bytes, int]] = {}

    @property
    def guided(self) -> bool:
        return bool(self.request.guide)

    @property
    def salt(self) -> str:
        """The prefix cache's namespace of its KV: its cache salt and its adapter."""
        return cache_namespace(self.request.cache_salt, self.request.lora_name)

    @property
    def lora(self) -> str:
        return self.request.lora_name

    @property
    def leader(self) -> _Output:
        """Before the fork, the output that reads the prompt."""
        return self.outputs[min(self.outputs)]

    def reusable_tokens(self) -> int:
        """Tokens the prefix cache may supply: those before the first whose logits are needed (the last one's for
        the next token, and, while prompt logprobs are owed, the rows they are read from)."""
        reusable = (len(self.leader.tokens) if self.forked else len(self.prompt)) - 1
        if self.prompt_records is not None and not self.prompt_records_sent:
            reusable = min(reusable, max(self.request.prompt_logprob_start, 1) - 1)
        return reusable

    def cells(self) -> int:
        """KV cells it holds: the shared prompt once, then each output's own."""
        return self.prompt_cells + sum(
            o.cached - (self.prompt_cells if o.shares_prompt else 0) for o in self.outputs.values()
        )

    def close(self) -> None:
        for output in self.outputs.values():
            output.sampler.close()


class _Run:
    """A run of one output's tokens in the step's batch."""

    __slots__ = ("request", "output", "first_index", "start", "count", "samples", "logits_from")

    def __init__(
        self, request: _Request, output: _Output, start: int, count: int, samples: bool, logits_from: int | None
    ) -> None:
        self.request = request
        self.output = output
        self.first_index = -1  # batch index of the run's first token, once in the batch
        self.start = start  # position of the run's first token
        self.count = count
        self.samples = samples  # the run ends with the output's last token: a token is sampled after it
        self.logits_from = logits_from  # logits for the run's tokens from this index on (None: none)


class LlamaEngine(Engine):
    """One llama.cpp context and the requests it runs: in a shared KV cache (the default), or, given
    `stream_cells`, in a stream of that many cells per sequence (kv_layout.py places requests in one or the other).
    `matchers`, `ledger` and `arrivals` may be another engine's, so that two engines over one model compile each
    guide once, report one set of KV blocks and keep one arrival order."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        stream_cells: int = 0,
        matchers: guides.GuideMatchers | None = None,
        ledger: BlockLedger | None = None,
        arrivals: Iterator[int] | None = None,
    ) -> None:
        if config.max_batch > MAX_SEQUENCES:
            raise ValueError(
                f"the llama.cpp engine runs at most {MAX_SEQUENCES} sequences (OPENENGINE_MAX_BATCH), "
                f"got {config.max_batch}"
            )
        self.max_batch = config.max_batch
        self.prefill_chunk = config.prefill_chunk
        if not config.prefix_cache_tokens:
            cached_prefixes = 0
        elif stream_cells:  # each entry holds a stream: as many as prefix_cache_tokens cells make
            limit = min(MAX_CACHED_PREFIXES, MAX_SEQUENCES - config.max_batch)
            cached_prefixes = min(limit, max(1, config.prefix_cache_tokens // stream_cells))
        else:
            cached_prefixes = min(MAX_CACHED_PREFIXES, MAX_SEQUENCES - config.max_batch)
        sequences = config.max_batch + cached_prefixes
        self.model = LlamaModel(
            config.model_path,
            context_size=stream_cells * sequences if stream_cells else config.context_size,
            batch_tokens=config.max_batch + config.prefill_chunk,
            sequences=sequences,
            threads=config.threads,
            kv_streams=bool(stream_cells),
        )
        self.context_size = self.model.context_size
        self._eog = frozenset(self.model.end_of_generation.tolist())
        self._batch = TokenBatch(config.max_batch + config.prefill_chunk)
        # Free sequence ids, lowest first. In streams, running outputs take ids below max_batch (kept contiguous:
        # _compact) and the prefix cache's entries the ids above; in a shared cache, any id serves either.
        self._streams = bool(stream_cells)
        self._free_seq_ids = list(range(config.max_batch if self._streams else sequences))
        self._entry_ids_from = config.max_batch if self._streams else sequences
        self._free_entry_ids = list(range(self._entry_ids_from, sequences))
        self.prefix_cache = PrefixCache(self.model, config.prefix_cache_tokens, cached_prefixes, ledger)
        self.adapters = Adapters(self.model, config.max_loras)
        self.max_guided_sequences = config.max_guided_sequences
        self.guided_sequences = 0
        self.guided_elsewhere = 0  # guided outputs another engine runs under the same limit (kv_layout.py)
        self._owns_matchers = matchers is None
        if matchers is None and config.max_guided_sequences:
            matchers = guides.GuideMatchers(self.model.guide_tokenizer(), guides.Limits())
        self.matchers = matchers
        self._compiling: list[_Request] = []  # their guide compiles; they join the queue once it has
        self._guide_mask = np.zeros((self.model.vocab_size + 31) // 32, np.int32)
        self.prefilled_tokens = 0  # in the last step
        self.cached_prompt_tokens = 0  # in the last step's admissions
        self._queue: list[tuple[tuple[int, int], _Request]] = []  # heap; cancelled entries stay until popped
        self._queued: dict[str, _Request] = {}
        self._running: dict[str, _Request] = {}  # admitted, in admission order
        self._parked: dict[str, _Request] = {}  # paused and out of the batch until resumed
        self.paused_slot_grace_s = PAUSED_SLOT_GRACE_S
        self.arrivals = arrivals if arrivals is not None else itertools.count()
        self._fair = FairQueue(
            self.max_batch,
            state_of=lambda entry: entry[1],
            priority_of=lambda entry: entry[0][0],
            owner_of=lambda state: state.request.owner,
            sequences_of=lambda state: len(state.outputs),
            weight_of=lambda state: state.request.share_weight or 1,
        )
        self.running_sequences = 0
        self.queued_sequences = 0
        self.waiting_tokens = 0
        self.cells = 0  # KV cells held by the admitted requests (as of the last step)

    # ------------------------------------------------------------ the interface

    @property
    def idle(self) -> bool:
        return not self._queued and not self._compiling and all(r.paused for r in self._running.values())

    def enqueue(self, request: cluster_pb2.EngineRequest) -> None:
        state = _Request(
            request, (-request.priority, next(self.arrivals)), self.model.vocab_size, self.model.end_of_generation
        )
        if state.guided:  # compiled off the step loop: a slow grammar delays only its own request
            assert self.matchers is not None  # the node refuses guides when max_guided_sequences is 0
            state.guide = self.matchers.join(request.guide)
            self._compiling.append(state)
            self._queued[state.request_id] = state
            self.queued_sequences += len(state.outputs)
            self.waiting_tokens += len(state.prompt) * len(state.outputs)
            return
        self._push(state)

    def cancel(self, cancel: cluster_pb2.CancelRequest, events: list[bytes]) -> None:
        request_id = cancel.request_id
        state = self._running.get(request_id) or self._queued.get(request_id) or self._parked.get(request_id)
        if state is None:
            return
        indices = [cancel.output_index] if cancel.HasField("output_index") else sorted(state.outputs)
        for index in indices:
            if index in state.outputs:
                self._finish(state, state.outputs[index], ENGINE_FINISH_CANCELLED, events)

    def pause(self, pause: cluster_pb2.PauseRequest) -> None:
        request_id = pause.request_id
        parked = self._parked.pop(request_id, None) if pause.resume else None
        if parked is not None:
            parked.paused = False
            self._push(parked)
            return
        state = self._running.get(request_id)
        if state is not None:
            state.paused = not pause.resume
            state.paused_at = time.monotonic()

    def step(self, events: list[bytes]) -> bool:
        self.prefilled_tokens = self.cached_prompt_tokens = 0
        if self._compiling:
            self._take_compiled(events)
        self._admit(events)
        if self._streams:
            self._compact()
        if not self.adapters.users:
            stepped = self._decode(None, events)
        else:  # one decode per adapter: llama.cpp applies an adapter to the whole batch
            stepped = False
            for lora in sorted({state.lora for state in self._running.values()}):
                stepped = self._decode(lora, events) or stepped
        self.cells = self._running_cells()
        return stepped

    def _decode(self, lora: str | None, events: list[bytes]) -> bool:
        """Decodes the running outputs of one adapter (`lora`; "" the base model, None every output: no adapter
        runs) and samples their next tokens; False when none had anything to read."""
        budget = self.prefill_chunk - self.prefilled_tokens
        runs = self._plan(lora, budget)
        while runs and self._cells_after(runs) > self.context_size:
            if not self._preempt_one(events):
                break
            runs = self._plan(lora, budget)
        if not runs:
            return False
        try:
            self.adapters.apply(lora or "")  # None: no adapter runs (an earlier step's may still be applied)
            self.model.decode(self._batch)
        except LlamaError as exc:
            log_event(logger, "decode failed", logging.ERROR, error=exc)
            for state in list(self._running.values()):
                self._fail(state, f"the engine failed a step ({exc}); retry the request", events)
            return True
        for run in runs:
            run.output.cached += run.count
            if run.count > 1 or not run.output.generated:  # not the one token of a decoding output
                self.prefilled_tokens += run.count
            if run.request.prompt_records is not None and not run.request.prompt_records_sent:
                self._prompt_records(run)
        for run in runs:
            if run.samples and run.output.index in run.request.outputs:
                self._sample(run, events)
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(
            self.running_sequences,
            self.queued_sequences,
            self.cells,
            self.waiting_tokens,
            self.prefilled_tokens,
            self.cached_prompt_tokens,
            len(self.prefix_cache.blocks),
            self.adapters.running(),
            sorted({state.lora for state in self._queued.values() if state.lora}) if self.adapters.paths else (),
        )

    def set_lora(self, command: cluster_pb2.LoraCommand) -> cluster_pb2.LoraOutcome:
        outcome = cluster_pb2.LoraOutcome(adapter=command.adapter)
        name = command.adapter.lora_name
        if command.unload:
            self.adapters.unload(name)
            return outcome
        try:
            outcome.already_loaded = self.adapters.load(name, command.adapter.source_path)
        except LoraError as exc:
            outcome.error, outcome.refusal_code = str(exc), exc.code
        return outcome

    def set_max_batch(self, max_batch: int) -> None:
        """The most sequences it admits from now on (two engines sharing one batch: kv_layout.py)."""
        self.max_batch = self._fair.max_batch = max_batch

    def release_outgrown(self, cells: int) -> list[_Request]:
        """The running requests with an output whose next token needs more than `cells` KV cells leave this engine,
        their KV cells exported with them and freed here; the caller hands them to another (`adopt`), which
        imports the cells when admitting them (else they read their tokens again)."""
        outgrown = [s for s in self._running.values() if any(len(o.tokens) > cells for o in s.outputs.values())]
        for state in outgrown:
            state.carried = self._export(state)
            self._leave_batch(state, keep=False)
        return outgrown

    def adopt(self, state: _Request) -> None:
        """A request another engine released joins the queue in its place (parked while paused)."""
        if state.paused:
            self._parked[state.request_id] = state
        else:
            self._push(state)

    def take_kv_events(self) -> list[kv_pb2.KvEvent]:
        return self.prefix_cache.blocks.take_events()

    def close(self) -> None:
        if self.matchers is not None and self._owns_matchers:
            self.matchers.close()
        for state in [*self._running.values(), *self._queued.values(), *self._parked.values()]:
            state.close()
        self.model.close()

    # ------------------------------------------------------------ admission and preemption

    def _push(self, state: _Request) -> None:
        self._queued[state.request_id] = state
        heapq.heappush(self._queue, (state.order, state))
        self.queued_sequences += len(state.outputs)
        self.waiting_tokens += len(state.prompt) * len(state.outputs)

    def _admit(self, events: list[bytes]) -> None:
        queue = self._queue
        if not queue:
            return
        held = self._held_cells()
        running = self._fair.running_by_owner(self._running.values())
        weights = self._fair.weights([*self._running.values(), *self._queued.values()])
        while queue:
            item = self._fair.pick(queue, self._is_queued, running, weights)
            if item is None:
                return
            state = item[1]
            if state.lora and state.lora not in self.adapters.paths and not self._load_adapter(state, events):
                continue
            sequences = len(state.outputs)
            while self._running and self.running_sequences + sequences > self.max_batch:
                idle = self._paused_past_grace()
                if idle is not None:
                    self._park(idle)
                    running[idle.request.owner] -= len(idle.outputs)
                    held = self._held_cells()
                    continue
                victim = self._fair.victim(state, list(self._running.values()), running, weights)
                if victim is None:
                    heapq.heappush(queue, item)
                    return
                self._requeue(victim)
                running[victim.request.owner] -= len(victim.outputs)
                held = self._held_cells()
            guided = self.guided_sequences + self.guided_elsewhere
            if state.guided and guided and guided + sequences > self.max_guided_sequences:
                heapq.heappush(queue, item)
                return
            source, reused = -1, 0  # the sequence whose first `reused` cells it shares
            if not (state.request.bypass_prefix_cache or state.carried) and (
                not state.forked or len(state.outputs) == 1
            ):
                # a preempted or parked one-output request may find its own cells, output included
                tokens = state.leader.tokens if state.forked else state.prompt
                entry, reused = self.prefix_cache.lookup(state.salt, tokens, state.reusable_tokens())
                source = entry.seq_id if entry else -1
                running_source, running_reused = self._running_prefix(state, tokens)
                if running_reused > reused:
                    source, reused = running_source, running_reused
            # Room for what it reads first, next to one more cell per running output; the prefix cache gives up
            # its least recently used entries first (not the one this request shares).
            needed = max(len(o.tokens) for o in state.outputs.values()) - reused
            keep = source if self.prefix_cache.holds(source) else -1
            while (
                self._running
                and held + self.running_sequences + needed > self.context_size
                and self.prefix_cache.evictable(keep)
            ):
                held -= self._evict(keep)
            if self._running and held + self.running_sequences + needed > self.context_size:
                heapq.heappush(queue, item)
                return
            held += needed
            running[state.request.owner] += sequences
            del self._queued[state.request_id]
            self.queued_sequences -= sequences
            self.waiting_tokens -= len(state.prompt) * sequences
            for output in state.outputs.values():
                output.seq_id = heapq.heappop(self._free_seq_ids)
            self._running[state.request_id] = state
            self.running_sequences += sequences
            if state.lora:
                self.adapters.acquire(state.lora)
            if state.guided:
                self.guided_sequences += sequences
            if source >= 0:
                self._share_prefix(state, source, reused)
            if state.carried:
                self._import_carried(state)

    def _export(self, state: _Request) -> dict[int, tuple[bytes, int]]:
        """Each output's KV cells and how many tokens they hold, for another engine to import; none while prompt
        logprob rows are owed (read from the prompt again) or when the model's cells cannot be exported."""
        if state.prompt_records is not None and not state.prompt_records_sent:
            return {}
        carried = {}
        for output in state.outputs.values():
            cells = self.model.export_sequence(output.seq_id)
            if cells is None:
                return {}
            carried[output.index] = (cells, output.cached)
        return carried

    def _import_carried(self, state: _Request) -> None:
        """A request adopted from another engine takes the KV cells it carried: each output goes on from them, or
        reads its tokens again where llama.cpp refuses them (no room in one piece)."""
        for output in state.outputs.values():
            carried = state.carried.get(output.index)
            if carried is not None and self.model.import_sequence(output.seq_id, carried[0]):
                output.cached = carried[1]
        state.carried = {}

    def _load_adapter(self, state: _Request, events: list[bytes]) -> bool:
        """Loads the adapter a queued request names (a node started after its LoadLora); False, the request
        failed, when it cannot be."""
        try:
            self.adapters.load(state.lora, state.request.lora_path)
            return True
        except LoraError as exc:
            self._fail(state, f"the LoRA adapter {state.lora!r} could not be loaded: {exc}", events, retryable=False)
            return False

    def _running_prefix(self, state: _Request, tokens: list[int], beyond: int = 0) -> tuple[int, int]:
        """The other running output (its sequence id) whose cells read so far share the longest prefix with
        `tokens` (under the request's salt), longer than `beyond`, and how many `state` can reuse; (-1, 0) when
        none shares MIN_REUSE_TOKENS."""
        best, best_length = -1, beyond
        reusable = state.reusable_tokens()
        prompt = None  # `tokens` as an array, made for the first candidate
        for other in self._running.values():
            leader = other.leader
            if other is state or not self._may_share(state, other, tokens) or leader.cached <= best_length:
                continue
            if len(tokens) <= best_length or leader.tokens[best_length] != tokens[best_length]:
                continue  # their common prefix is not longer than the best one's
            prompt = np.asarray(tokens, np.int32) if prompt is None else prompt
            length = common_prefix(np.asarray(leader.tokens[: leader.cached], np.int32), prompt, reusable)
            if length > best_length and self.model.can_share_prefix(leader.seq_id, length):
                best, best_length = leader.seq_id, length
        return (best, best_length) if best >= 0 and best_length >= MIN_REUSE_TOKENS else (-1, 0)

    @staticmethod
    def _may_share(state: _Request, other: _Request, tokens: list[int]) -> bool:
        """Whether `state` (reading `tokens`) may take cells of `other`'s leader: same salt and adapter, neither
        bypassing the cache, the same first token."""
        return (
            other.salt == state.salt
            and not other.request.bypass_prefix_cache
            and not state.request.bypass_prefix_cache
            and bool(tokens)
            and bool(other.leader.tokens)
            and other.leader.tokens[0] == tokens[0]
        )

    def _catch_up(self, state: _Request, output: _Output, ahead: list[tuple[_Request, _Output]]) -> bool:
        """Before a reading leader gets prompt tokens: it takes the cells another running request has read of
        their common prefix beyond its own (when all it holds came from that one), and it waits (True) while a
        request reading ahead of it in the batch has yet to read more of their common prefix, rather than read
        the same tokens twice."""
        if state.forked or (output.cached and state.shared_from < 0):
            return False  # its own cells: another's cannot be added to them
        source, length = self._running_prefix(state, output.tokens, beyond=output.cached)
        if source >= 0 and (not output.cached or source == state.shared_from):
            self._share_prefix(state, source, length)
        if not ahead:
            return False
        reusable = state.reusable_tokens()
        prompt = np.asarray(output.tokens, np.int32)
        for other, other_output in ahead:
            if other.forked or not self._may_share(state, other, output.tokens):
                continue
            common = common_prefix(np.asarray(other_output.tokens, np.int32), prompt, reusable)
            if common >= output.cached + MIN_REUSE_TOKENS and other_output.cached < common:
                if (not output.cached or other_output.seq_id == state.shared_from) and self.model.can_share_prefix(
                    other_output.seq_id, common
                ):
                    return True
        return False

    def _share_prefix(self, state: _Request, source_seq_id: int, length: int) -> None:
        """The request's leader shares the cells of a prefix cache entry or a running output from its own count
        (0 when admitted) up to `length`: all it holds then came from that sequence."""
        leader = state.leader
        start = leader.cached
        self.model.share_prefix(source_seq_id, leader.seq_id, start, length)
        leader.cached = length
        state.shared_cells = length
        state.shared_from = source_seq_id
        if not state.forked:  # not its own cells, kept when it was preempted or parked
            state.cached_prompt_tokens += length - start
            self.cached_prompt_tokens += length - start

    def _held_cells(self) -> int:
        """KV cells in use: the admitted requests' and the prefix cache's, the cells they share counted once."""
        shared = sum(state.shared_cells for state in self._running.values() if state.shared_from >= 0)
        return sum(state.cells() for state in self._running.values()) + self.prefix_cache.tokens - shared

    def _running_cells(self) -> int:
        """KV cells the admitted requests hold, those two of them share counted once (cells shared with the
        prefix cache count: a request holds them too)."""
        running = self._running.values()
        seq_ids = {output.seq_id for state in running for output in state.outputs.values()}
        shared = sum(state.shared_cells for state in running if state.shared_from in seq_ids)
        return sum(state.cells() for state in running) - shared

    def _evict(self, keep: int = -1) -> int:
        """Drops the prefix cache's least recently used entry (not `keep`); returns the cells that frees."""
        before = self._held_cells()
        self._free_sequences([self.prefix_cache.evict_one(keep)])
        return before - self._held_cells()

    def _free_sequences(self, seq_ids: list[int]) -> None:
        """The sequences' cells are gone (but for those another shares): a request sharing them holds them alone
        now, and the ids are free for new outputs."""
        for state in self._running.values():
            if state.shared_from in seq_ids:
                state.shared_from, state.shared_cells = -1, 0
        for seq_id in seq_ids:
            heapq.heappush(self._free_entry_ids if seq_id >= self._entry_ids_from else self._free_seq_ids, seq_id)

    def _take_compiled(self, events: list[bytes]) -> None:
        """Requests whose guide compiled join the queue (each output gets its own matcher); a failed one ends."""
        still = []
        assert self.matchers is not None  # guided requests come only with matchers
        for state in self._compiling:
            assert state.guide is not None  # set while the guide compiles
            if state.request_id not in self._queued:  # cancelled meanwhile: its compile ends unless another waits
                self.matchers.leave(state.request.guide, state.guide)
                continue
            if not state.guide.done():
                still.append(state)
                continue
            self.matchers.leave(state.request.guide, state.guide)
            try:
                compiled = state.guide.result()
            except guides.GuideError as exc:
                self._fail(state, str(exc), events, retryable=False)
                continue
            for output in state.outputs.values():
                output.sampler.guide = compiled.deep_copy()
            state.guide = None
            del self._queued[state.request_id]
            self.queued_sequences -= len(state.outputs)
            self.waiting_tokens -= len(state.prompt) * len(state.outputs)
            self._push(state)
        self._compiling = still

    def _cells_after(self, runs: list[_Run]) -> int:
        return self._held_cells() + sum(run.count for run in runs)

    def _preempt_one(self, events: list[bytes]) -> bool:
        """Frees KV cells for the running requests: the prefix cache's least recently used entry, else the request
        admitted last goes back to the queue, its KV freed; False when only one is running (then it cannot grow:
        its outputs ask more KV than the cache has, and it fails)."""
        if self.prefix_cache.evictable():
            self._evict()
            return True
        if len(self._running) < 2:
            state = next(iter(self._running.values()), None)
            if state is not None:
                self._fail(
                    state,
                    f"the request's outputs need more KV cache than this node has "
                    f"({self.context_size} cells, OPENENGINE_CONTEXT_SIZE); ask fewer num_sequences or "
                    f"max_tokens",
                    events,
                    retryable=False,
                )
            return False
        request_id = next(reversed(self._running))
        self._requeue(self._running[request_id])
        log_event(logger, "preempted: KV cache full", request_id=request_id, cells=self.context_size)
        return True

    def _compact(self) -> None:
        """In streams: running outputs move down into the free ids below theirs, highest first, so that their ids
        stay contiguous (runtime.py: a decode evaluates one graph per run of consecutive ids)."""
        free = self._free_seq_ids
        if not free:
            return
        outputs = [output for state in self._running.values() for output in state.outputs.values()]
        for output in sorted(outputs, key=lambda output: output.seq_id, reverse=True):
            if free[0] > output.seq_id:  # (a move takes one free id and frees another)
                return
            source, output.seq_id = output.seq_id, heapq.heappop(free)
            self.model.move(source, output.seq_id)
            heapq.heappush(free, source)
            for state in self._running.values():
                if state.shared_from == source:
                    state.shared_from = output.seq_id

    def _is_queued(self, state: _Request) -> bool:
        return self._queued.get(state.request_id) is state  # else cancelled while queued

    def _paused_past_grace(self) -> _Request | None:
        """The running request paused longest, if that is longer than the grace."""
        now = time.monotonic()
        paused = [s for s in self._running.values() if s.paused and now - s.paused_at >= self.paused_slot_grace_s]
        return min(paused, key=lambda s: s.paused_at) if paused else None

    def _park(self, state: _Request) -> None:
        """A paused request leaves the batch until resumed (then it is queued in its place)."""
        self._leave_batch(state)
        self._parked[state.request_id] = state
        log_event(logger, "parked: paused, its batch slot needed", request_id=state.request_id)

    def _requeue(self, state: _Request) -> None:
        """A running request goes back to the queue in its place: admitted again, it reads its prompt and its output
        so far again, but for what the prefix cache kept of a one-output request; nothing it already streamed is
        sent again."""
        self._leave_batch(state)
        self.adopt(state)

    def _leave_batch(self, state: _Request, keep: bool = True) -> None:
        """A running request leaves the batch: a one-output request's cells go to the prefix cache (unless not
        `keep`), others' are freed."""
        del self._running[state.request_id]
        if state.lora:
            self.adapters.release(state.lora)
        keep = keep and len(state.outputs) == 1 and not state.request.bypass_prefix_cache
        for output in state.outputs.values():
            if keep and output.cached:
                self._keep_prefix(state, output)
            self._release_sequence(output)
            output.cached = 0
            output.shares_prompt = False
        state.prompt_cells = 0
        state.shared_from = -1
        state.shared_cells = 0
        state.forked = True  # each output reads its own tokens again
        if state.guided:
            self.guided_sequences -= len(state.outputs)
        if not state.prompt_records_sent and state.prompt_records is not None:
            state.prompt_records = []
        self.running_sequences -= len(state.outputs)

    def _keep_prefix(self, state: _Request, output: _Output) -> None:
        """The ended output's KV cells go to the prefix cache (the sequence is the cache's now; in streams, they
        move to a stream of the cache's, its least recently used entry evicted when none is free)."""
        if not self.prefix_cache.enabled:
            return
        seq_id = output.seq_id
        if self._streams:
            if not self._free_entry_ids:
                self._free_sequences([self.prefix_cache.evict_one()])
            entry_id = heapq.heappop(self._free_entry_ids)
            self.model.move(seq_id, entry_id)
            self._free_sequences([seq_id])
            seq_id = entry_id
        output.seq_id = -1
        self._free_sequences(self.prefix_cache.keep(seq_id, state.salt, output.tokens[: output.cached], state.lora))

    def _release_sequence(self, output: _Output) -> None:
        if output.seq_id >= 0:
            self.model.forget(output.seq_id)
            self._free_sequences([output.seq_id])
            output.seq_id = -1

    # ------------------------------------------------------------ a step

    def _plan(self, lora: str | None, budget: int) -> list[_Run]:
        """The batch of one adapter's outputs (None: every output): one token for every decoding output, then
        prompt chunks within the budget of prompt tokens. The batch holds the runs in sequence id order (one graph
        per run of consecutive ids in streams: runtime.py)."""
        runs: list[_Run] = []
        reading: list[tuple[_Request, _Output]] = []
        for state in self._running.values():
            if state.paused or (lora is not None and state.lora != lora):
                continue
            for output in state.outputs.values() if state.forked else (state.leader,):
                pending = len(output.tokens) - output.cached
                if pending == 1:
                    runs.append(_Run(state, output, output.cached, 1, True, 0))
                else:
                    reading.append((state, output))
        rows = PROMPT_LOGPROB_ROWS_PER_STEP
        for position, (state, output) in enumerate(reading):
            if budget <= 0:
                break
            if self._catch_up(state, output, reading[:position]):
                continue
            pending = len(output.tokens) - output.cached
            count = min(pending, budget)
            logits_from = self._prompt_logits_from(state, output.cached, count)
            if logits_from is not None:  # the run stops where the step's prompt logprob rows run out
                count = min(count, logits_from + rows)
                if not count:
                    continue
                rows -= count - logits_from
            samples = count == pending
            if logits_from is None and samples:
                logits_from = count - 1
            runs.append(_Run(state, output, output.cached, count, samples, logits_from))
            budget -= count
        batch = self._batch
        batch.clear()
        for run in sorted(runs, key=lambda run: run.output.seq_id):
            tokens = run.output.tokens[run.start : run.start + run.count]
            run.first_index = batch.add(tokens, run.start, run.output.seq_id, run.logits_from)
        return runs

    @staticmethod
    def _prompt_logits_from(state: _Request, start: int, count: int) -> int | None:
        """Where logits are needed in a run reading the prompt for its logprobs (the row of position p predicts
        the token at p + 1), or None."""
        if state.prompt_records is None or state.prompt_records_sent:
            return None
        first_needed = max(state.request.prompt_logprob_start, 1) - 1
        end = min(start + count, len(state.prompt) - 1)  # the last prompt token's row predicts the output
        if end <= max(start, first_needed):
            return None
        return max(first_needed - start, 0)

    def _prompt_records(self, run: _Run) -> None:
        """Prompt logprob records from the rows of a run that read prompt tokens."""
        state = run.request
        records = state.prompt_records
        assert records is not None  # only for a request that asked for prompt logprobs
        start_index = state.request.prompt_logprob_start
        prompt = state.prompt
        if run.start == 0 and start_index == 0:
            records.append(cluster_pb2.TokenRecord(token_id=prompt[0]))  # nothing before it predicts it
        candidates = state.request.prompt_candidates
        for offset in range(run.count):
            position = run.start + offset
            predicted = position + 1
            if predicted >= len(prompt) or predicted < start_index or not self._batch.logits[run.first_index + offset]:
                continue
            logprobs = log_softmax(self.model.logits(run.first_index + offset))
            records.append(token_record(prompt[predicted], logprobs, candidates))

    def _sample(self, run: _Run, events: list[bytes]) -> None:
        state, output = run.request, run.output
        index = run.first_index + run.count - 1
        row = self.model.logits(index)
        if state.forked:
            self._next_token(state, output, index, row, events)
            return
        # The prompt is in: every output shares its cells and samples from this row.
        state.forked = True
        prompt_cells = len(state.prompt)
        state.prompt_cells = prompt_cells
        outputs = list(state.outputs.values())
        pristine = row.copy() if len(outputs) > 1 else None
        for other in outputs:
            if other is not output:
                self.model.share(output.seq_id, other.seq_id)
                other.cached = output.cached
            other.shares_prompt = True
        for number, other in enumerate(outputs):
            if number and pristine is not None:
                row[:] = pristine
            self._next_token(state, other, index, row, events)

    def _next_token(self, state: _Request, output: _Output, index: int, row: np.ndarray, events: list[bytes]) -> None:
        request = state.request
        logprobs = log_softmax(row) if request.output_logprobs else None
        token_id = output.sampler.choose(self.model, index, row, output.generated, self._guide_mask)
        guide_error = output.sampler.accept(token_id)
        if guide_error:
            self._finish(state, output, ENGINE_FINISH_ERROR, events, f"guided decoding failed: {guide_error}")
            return
        output.tokens.append(token_id)
        output.generated += 1
        generated = output.generated
        record = token_record(token_id, logprobs, request.output_candidates)
        stops_allowed = generated >= request.min_tokens
        guided_end = state.guided and token_id in self._eog  # the grammar allowed the end: it is complete
        if guided_end or (stops_allowed and not request.ignore_eos and token_id in self._eog):
            finish = ENGINE_FINISH_EOS
        elif stops_allowed and token_id in request.stop_token_ids:
            finish = ENGINE_FINISH_STOP_TOKEN
        elif generated >= max(1, request.max_tokens) or len(output.tokens) >= self.context_size:
            finish = ENGINE_FINISH_LENGTH
        else:
            finish = ENGINE_FINISH_NONE
        event = cluster_pb2.OutputEvent(
            request_id=state.request_id,
            output_index=output.index,
            lane=state.lane,
            tokens=[record],
            first=generated == 1,
        )
        if output.index == min(state.outputs):
            if not state.prompt_records_sent and state.prompt_records is not None:
                event.prompt_tokens.extend(state.prompt_records)
                state.prompt_records_sent = True
            if not state.cache_reported:
                event.cached_prompt_tokens = state.cached_prompt_tokens
                state.cache_reported = True
        if finish == ENGINE_FINISH_NONE:
            events.append(event_field(event.SerializeToString()))
            return
        event.finish = finish
        if finish in (ENGINE_FINISH_EOS, ENGINE_FINISH_STOP_TOKEN):
            event.finish_token_id = token_id
        self._end_output(state, output, event, events)

    # ------------------------------------------------------------ ends

    def _finish(
        self,
        state: _Request,
        output: _Output,
        finish: cluster_pb2.EngineFinish,
        events: list[bytes],
        message: str = "",
        retryable: bool = False,
    ) -> None:
        event = cluster_pb2.OutputEvent(
            request_id=state.request_id,
            output_index=output.index,
            lane=state.lane,
            finish=finish,
            message=message,
            retryable=retryable,
        )
        self._end_output(state, output, event, events)

    def _fail(self, state: _Request, message: str, events: list[bytes], retryable: bool = True) -> None:
        for output in list(state.outputs.values()):
            self._finish(state, output, ENGINE_FINISH_ERROR, events, message, retryable)

    def _end_output(
        self, state: _Request, output: _Output, event: cluster_pb2.OutputEvent, events: list[bytes]
    ) -> None:
        """Closes the output: its event, its sequence's KV cells, its sampler; the request when it was its last."""
        events.append(event_field(event.SerializeToString()))
        del state.outputs[output.index]
        output.sampler.close()
        admitted = state.request_id in self._running
        parked = state.request_id in self._parked
        if admitted:
            if state.guided:
                self.guided_sequences -= 1
            if event.finish != ENGINE_FINISH_ERROR and not state.request.bypass_prefix_cache and output.cached:
                self._keep_prefix(state, output)
            self._release_sequence(output)
            self.running_sequences -= 1
        elif not parked:
            self.queued_sequences -= 1
            self.waiting_tokens -= len(state.prompt)
        if not state.outputs:
            if admitted:
                del self._running[state.request_id]
                if state.lora:
                    self.adapters.release(state.lora)
            elif parked:
                del self._parked[state.request_id]
            else:
                del self._queued[state.request_id]
