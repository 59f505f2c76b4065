"""openengine.v1 Inference: Generate, the protocol mapping of a request's stream.

The request's life in the deployment (reserve, submit, release) belongs to
`requests.Requests`; this module validates, maps refusals to gRPC status codes
(REFUSAL_CODES, the server edge) and turns engine events into responses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc

from ..api.openengine.v1 import error_pb2, generation_pb2, lora_pb2, openengine_pb2_grpc
from ..api.openengine_internal.v1 import cluster_pb2
from ..api.openengine_internal.v1.cluster_pb2 import ENGINE_FINISH_ERROR, ENGINE_FINISH_NONE
from ..common import guides
from ..common.config import FrontendConfig
from ..common.grpc_server import stream_writer
from ..common.health_service import Health
from ..common.logging_setup import log_event
from . import auth, metrics
from .nodes import LaneFailure
from .refusal import (
    DuplicateRequest,
    InvalidRequest,
    KeyAtLimit,
    NotPermitted,
    NotServed,
    Overloaded,
    Refusal,
    Unavailable,
    Unsupported,
)
from .request_trace import RequestTrace
from .requests import OpenRequest, Requests, prefix_blocks, prefix_key
from .served_model import LoadedModel, ServedModel
from .stream import OutputStream, engine_error, prompt_output, serialize_response
from .validation import GenerationPlan, RequestMetadata, parse_metadata, validate_generate

logger = logging.getLogger("openengine_serve.frontend")

REFUSAL_CODES: dict[type[Refusal], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    NotServed: grpc.StatusCode.NOT_FOUND,
    Unsupported: grpc.StatusCode.UNIMPLEMENTED,
    DuplicateRequest: grpc.StatusCode.ALREADY_EXISTS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    KeyAtLimit: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotPermitted: grpc.StatusCode.PERMISSION_DENIED,
}

RETRYABLE_REFUSALS = (Overloaded, KeyAtLimit)  # limits that free up as streams end: answered with a retry hint
RETRY_AFTER_KEY = "openengine-retry-after-ms"  # on RESOURCE_EXHAUSTED: when trying again may succeed
RETRY_AFTER_MS = 1000
OFF_LOOP_PROMPT_CHARS = 4096  # longer text prompts are tokenized in a thread (tokenizing: ~0.4 ms per KiB)
OFF_LOOP_TOKEN_IDS = 16384  # longer token-id prompts are copied and checked in a thread (~0.1 ms per 1k ids)
STALLED_CLIENT_LAST_WRITE_S = 1.0  # how long the terminal error of a stalled client may take to go out

OUTPUT_EVENT = cluster_pb2.OutputEvent
Write = Callable[[bytes | generation_pb2.GenerateResponse], Awaitable[None]]


class Inference(openengine_pb2_grpc.InferenceServicer):
    def __init__(
        self,
        config: FrontendConfig,
        model: ServedModel,
        requests: Requests,
        health: Health,
        server_implementation: str,
        lora_for: Callable[[str, str], lora_pb2.LoraAdapter],
    ) -> None:
        self.model = model
        self.lora_for = lora_for  # the deployment's LoRA adapter of a name, for a model (CoordinatorClient)
        self.server_implementation = server_implementation  # for the request span
        self.requests = requests
        self.health = health
        self.max_in_flight = config.max_in_flight
        self.key_max_in_flight = config.api_key_max_in_flight
        self.client_stall_timeout_s = config.client_stall_timeout_s
        self.guide_compile_timeout_s = config.guide_compile_timeout_s
        self.guides = guides.CompiledGuides()  # by content, in a pool of their own

    def loaded(self, name: str = "") -> LoadedModel:
        """The model served under `name` (the default model for "" or a name not served: validation refuses the
        latter); Unavailable while no node has told this frontend its model yet."""
        loaded = (self.model.for_name(name) if name else None) or self.model.loaded
        if loaded is None:
            raise Unavailable("this frontend has not loaded the model's tokenizer yet (no ready node); retry")
        return loaded

    def plan(self, request: generation_pb2.GenerateRequest, metadata: RequestMetadata) -> GenerationPlan:
        """The validated request; raises a Refusal naming what is wrong."""
        loaded = self.loaded(request.model)
        plan = validate_generate(request, metadata, loaded.limits, loaded.tokenizer.encode, self.model.names())
        plan.model_card = loaded.card.name
        if plan.lora_name:
            plan.lora_path = self.lora_for(plan.lora_name, loaded.card.name).source_path
        if loaded.limits.prefix_cache:
            # The caller's key scopes the cache (auth.cache_namespace); routing by prefix follows the same salt.
            plan.cache_salt = auth.scoped_cache_salt(auth.cache_namespace(auth.caller()), plan.cache_salt)
            plan.prefix_key = prefix_key(plan)
            plan.block_hashes = prefix_blocks(plan)
        return plan

    async def Generate(self, request: generation_pb2.GenerateRequest, context) -> None:
        # A coroutine writing with context.write, not an async generator: when the client cancels, the
        # cancellation lands in `stream` and the request owner's cleanup (free the engine slot, release the id)
        # runs at once, not whenever the garbage collector finalizes an abandoned generator.
        write, send_now = stream_writer(context)

        async def end_stalled(plan: GenerationPlan) -> None:
            await self._end_stalled(plan, context, write)

        try:
            await self.run(request, context.invocation_metadata() or (), write, send_now, end_stalled)
        except Refusal as exc:
            if isinstance(exc, RETRYABLE_REFUSALS):  # a limit that frees up as streams end: the retry hint
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(RETRY_AFTER_MS)),))
            # Ended with its status, not context.abort: grpc.aio keeps memory of every aborted call's request
            # (about 2 MB per refused 1 MiB message, tests/integration/test_limits.py).
            context.set_code(REFUSAL_CODES[type(exc)])
            context.set_details(exc.message)

    async def run(
        self,
        request: generation_pb2.GenerateRequest,
        invocation_metadata: Sequence[tuple[str, str | bytes]],
        write: Write,
        send_now: Callable[[bytes], bool] | None = None,
        end_stalled: Callable[[GenerationPlan], Awaitable[None]] | None = None,
    ) -> None:
        """One openengine.v1 request, whichever API it came in by (the gRPC Generate, or lowered from the
        OpenAI HTTP API): admission, validation, the request owner, and its GenerateResponse records to `write`.
        Raises the Refusal (counted and traced) for the API's edge to answer; `end_stalled` answers a client
        that accepted no output for the stall timeout (None: the call just ends)."""
        started = time.perf_counter()
        trace = RequestTrace.start(invocation_metadata, self.server_implementation)
        if trace.span is not None:
            trace.set_attributes(**{"openengine.request_id": request.request_id, "gen_ai.request.model": request.model})
            trace.set_key_name(auth.owner())  # the caller's API key name; absent when keys are off
        key = auth.caller()
        owner = "" if key is None else key.name
        admitted = False
        try:
            if self.health.draining:
                raise Unavailable("this frontend is draining; retry on another frontend")
            if self.requests.open_count >= self.max_in_flight:
                metrics.IN_FLIGHT_REFUSALS.inc()
                raise Overloaded(
                    f"this frontend worker has its maximum of {self.max_in_flight} streams open "
                    f"(OPENENGINE_MAX_IN_FLIGHT); retry in {RETRY_AFTER_MS} ms or on another frontend"
                )
            key_refusal = self._key_at_limit(key)
            if key_refusal is not None:
                raise key_refusal
            # Counted before any await: what follows (tokenizing, the guide's compile) is the request's own time.
            self.requests.admit(owner)
            admitted = True
            metadata = parse_metadata(invocation_metadata)
            priority_refusal = auth.priority_refusal(metadata.priority)
            if priority_refusal is not None:
                raise NotPermitted(priority_refusal)
            if _large_input(request):
                plan = await asyncio.to_thread(self.plan, request, metadata)  # tokenizing: the loop serves others
            else:
                plan = self.plan(request, metadata)
            if plan.guide:
                await self.check_guide(plan)
            trace.set_attributes(**{"gen_ai.usage.input_tokens": len(plan.prompt_token_ids)})
            sink = None
            try:
                async with self.requests.open(
                    plan, owner=owner, share_weight=key.share_weight if key else 1, trace=trace, admitted=True
                ) as accepted:
                    sink = accepted.sink
                    sink.owner = asyncio.current_task()
                    await self.stream(plan, accepted, started, write, send_now)
            except asyncio.CancelledError:
                if sink is None or not sink.client_stalled or end_stalled is None:
                    raise
                task = asyncio.current_task()
                assert task is not None  # the call's own task runs this
                task.uncancel()
                metrics.CLIENT_STALLS.inc()
                await end_stalled(plan)
        except Refusal as exc:
            code = REFUSAL_CODES[type(exc)]
            metrics.requests_counter("rejected", code.name, auth.caller_label()).inc()
            metrics.REFUSALS.labels(reason=refusal_reason(type(exc))).inc()
            trace.end(status="rejected", code=code.name, error=exc.message)
            raise
        except BaseException as exc:
            # Before the stream took over (it ends the span itself): the client left during Reserve or Submit.
            cancelled = isinstance(exc, asyncio.CancelledError)
            trace.end(
                status="cancelled" if cancelled else "error",
                code="CANCELLED" if cancelled else "INTERNAL",
                error=None if cancelled else exc,
            )
            raise
        finally:
            if admitted:
                self.requests.release(owner)

    async def check_guide(self, plan: GenerationPlan) -> None:
        """Compiles the request's guide against the model's vocabulary (once per guide: guides.CompiledGuides), off
        the event loop and bounded in time, before anything is reserved, while the request already counts against
        its caps: an invalid guide is refused with the compiler's message."""
        tokenizer = self.loaded(plan.model).guide_tokenizer
        try:
            await self.guides.check(
                plan.guide_kind, plan.guide, tokenizer, guides.Limits(), self.guide_compile_timeout_s
            )
        except guides.GuideTimeout:
            raise InvalidRequest(
                f"guided.{plan.guide_kind} took longer than {self.guide_compile_timeout_s:g} s to "
                f"compile (OPENENGINE_GUIDE_COMPILE_TIMEOUT_S); simplify it"
            ) from None
        except guides.GuideError as exc:
            raise InvalidRequest(str(exc)) from None

    def _key_at_limit(self, key: auth.ApiKey | None) -> KeyAtLimit | None:
        """The refusal of a caller whose API key has its maximum of streams open in this worker, else None."""
        if key is None:
            return None
        limit, source = (
            (key.max_in_flight, "its max_in_flight in OPENENGINE_API_KEYS_FILE")
            if key.max_in_flight
            else (self.key_max_in_flight, "OPENENGINE_API_KEY_MAX_IN_FLIGHT")
        )
        if not limit or self.requests.open_count_of(key.name) < limit:
            return None
        return KeyAtLimit(
            f"API key {key.name!r} has its maximum of {limit} streams open on this frontend worker "
            f"({source}); retry in {RETRY_AFTER_MS} ms"
        )

    async def _end_stalled(self, plan: GenerationPlan, context, write: Write) -> None:
        """A client that accepted no output for the stall timeout; its engine slot is already freed. One
        terminal retryable EngineError if the connection still takes a message, else the call is cancelled."""
        message = f"the client accepted no output for {self.client_stall_timeout_s:g} s; the request was ended"
        try:
            async with asyncio.timeout(STALLED_CLIENT_LAST_WRITE_S):
                await write(engine_error(plan.request_id, error_pb2.ERROR_CODE_INTERNAL, message, True))
        except Exception:  # noqa: BLE001 - the write timed out or the call is broken: cancel it either way
            # The status follows the output the connection still holds (at most the client's flow-control
            # window): a client that reads again sees its end, one that left takes the call with it.
            await context.abort(grpc.StatusCode.CANCELLED, message)

    async def stream(
        self,
        plan: GenerationPlan,
        accepted: OpenRequest,
        started: float,
        write: Write,
        send_now: Callable[[bytes], bool] | None = None,
    ) -> None:
        """Streams the request's engine events to `write` until every output finished (or the stream failed).

        `send_now` (pygrpc-native, grpc_server.NativeStreamSender.try_send): once the first token is out, the
        lane reader sends a single output's one-token deltas itself while this task waits with nothing queued,
        so the task wakes only for what needs it (the last token, a held-back character, a client that reads
        slowly)."""
        request_id = plan.request_id
        sink = accepted.sink
        loaded = self.loaded(plan.model)
        strings = loaded.strings
        outputs = [OutputStream(i, plan, loaded.tokenizer, strings) for i in range(plan.num_sequences)]
        open_outputs = plan.num_sequences
        single_output = open_outputs == 1
        prompt_sent = not plan.prompt_logprobs
        cached_prompt_tokens: int | None = None
        status, code = "error", "INTERNAL"
        metrics.IN_FLIGHT.inc()
        metrics.PROMPT_TOKENS.inc(len(plan.prompt_token_ids))
        first_token_at: float | None = None
        last_token_at: float | None = None
        trace = accepted.trace
        finish_reasons: list[int] = []

        def send_directly(item):
            """RequestSink.direct: None when the item went out here, else what the task must handle. Runs per token
            in the lane reader, so _count_delta is inlined."""
            nonlocal last_token_at
            if last_token_at is None or type(item) is not OUTPUT_EVENT or item.finish != ENGINE_FINISH_NONE:
                return item
            delta = one_token_delta(item)
            if delta is None:
                return item
            if not send_delta(delta):
                return delta  # the client's buffer is full (or the call ended): the task writes it, and waits
            now = perf_counter()
            add_delta(1, now - last_token_at)
            last_token_at = now
            return None

        async def send_or_write(item) -> None:
            """pygrpc-native: the non-blocking send, once more after one loop iteration when the client's buffer
            was full (its I/O thread drains the message before, e.g. the token delta right before a `finished`),
            and only then `write`, whose full-buffer path waits in a thread pool."""
            assert send_now is not None  # the emitter only with send_now
            data = serialize_response(item)
            if send_now(data):
                return
            await asyncio.sleep(0)
            if not send_now(data):
                await write(data)

        emit = write if send_now is None else send_or_write
        if send_now is not None and single_output and outputs[0].plain:
            one_token_delta, add_delta, perf_counter = outputs[0].one_token_delta, metrics.DELTAS.add, time.perf_counter
            send_delta = send_now  # bound here, where it is not None
            sink.direct = send_directly
        try:
            while open_outputs:
                if sink.paused:
                    sink.resume()  # its client took everything written: the engine may go on
                sink.writing_since = 0.0
                items = await sink.take()
                sink.writing_since = time.monotonic()
                if type(items[0]) is bytes:  # a delta send_directly could not send; only ever first, and alone
                    await write(items.pop(0))
                    assert last_token_at is not None  # send_directly hands back deltas after the first token only
                    last_token_at = _count_delta(1, last_token_at)
                    if not items:
                        continue
                failure = _first_failure(items)
                if failure is not None:
                    status, code = "failed", "OK"
                    draining = isinstance(failure, LaneFailure) and failure.draining
                    log_event(
                        logger,
                        "request failed",
                        logging.WARNING,
                        request_id=accepted.request_id,
                        node_id=accepted.node.node_id,
                        error=failure.message,
                    )
                    await write(
                        engine_error(
                            request_id,
                            error_pb2.ERROR_CODE_DRAINING if draining else error_pb2.ERROR_CODE_INTERNAL,
                            public_message(failure.message, accepted.node),
                            failure.retryable,
                        )
                    )
                    return
                if not prompt_sent and items[0].prompt_tokens:
                    prompt_sent = True
                    await emit(prompt_output(plan, items[0], strings))
                if cached_prompt_tokens is None and items[0].first:  # the engine says it on the first token
                    cached_prompt_tokens = items[0].cached_prompt_tokens
                new_tokens = 0
                for index, events in ((0, items),) if single_output else _by_output(items):
                    output = outputs[index]
                    if output.finished:
                        continue  # the node may still report an output this frontend already ended (stop string)
                    delta, delta_tokens, finished, stop_output = output.on_events(events)
                    if stop_output:
                        accepted.cancel_output(index)
                    if delta is not None:
                        new_tokens += delta_tokens
                        await emit(delta)
                    if finished is not None:
                        open_outputs -= 1
                        finish_reasons.append(finished.finished.reason)
                        if not open_outputs:
                            finished.usage.CopyFrom(
                                _usage(plan, outputs, cached_prompt_tokens if loaded.limits.prefix_cache else None)
                            )
                        await emit(finished)
                if new_tokens:
                    if first_token_at is None:
                        first_token_at = time.perf_counter()
                        metrics.TTFT.observe(first_token_at - started)
                        trace.event("first_token")
                        last_token_at = first_token_at
                        metrics.DELTAS.add(new_tokens)
                        if logger.isEnabledFor(logging.DEBUG):
                            _log_first_token(accepted, first_token_at - started)
                    else:
                        assert last_token_at is not None  # set with first_token_at
                        last_token_at = _count_delta(new_tokens, last_token_at)
            status, code = "finished", "OK"
        except asyncio.CancelledError:
            status, code = "cancelled", "CANCELLED"
            raise
        finally:
            sink.direct = None
            sink.writing_since = 0.0
            accepted.ended = not open_outputs
            _record_end(plan, accepted, outputs, status, code, started, finish_reasons)


def public_message(message: str, node: cluster_pb2.NodeEntry) -> str:
    """A failure's message as the client reads it: the request's node by its role, never its id or address (the
    "request failed" log line keeps them)."""
    for internal in (f"node {node.node_id} at {node.address}", node.address, node.node_id):
        if internal:
            message = message.replace(internal, "the request's node")
    return message


def _count_delta(tokens: int, last_token_at: float) -> float:
    """Metrics of a token delta after the first; returns its time (the next delta's ITL is measured from it)."""
    now = time.perf_counter()
    metrics.DELTAS.add(tokens, now - last_token_at)
    return now


def _log_first_token(accepted: OpenRequest, ttft_s: float) -> None:
    """Debug: the frontend's hops of the first token (CLOCK_MONOTONIC, comparable with the node's "first event
    on lane" line on one machine): opened (validated), reserved, submitted, first lane event into the request's
    inbox, taken by the stream, written."""
    if not accepted.hops:  # opened without them (the benchmark's token path)
        return
    opened_at, reserved_at, submitted_at = accepted.hops
    sink = accepted.sink
    log_event(
        logger,
        "first token",
        logging.DEBUG,
        request_id=accepted.request_id,
        ttft_s=f"{ttft_s:.6f}",
        opened_at=f"{opened_at:.6f}",
        reserved_at=f"{reserved_at:.6f}",
        submitted_at=f"{submitted_at:.6f}",
        first_event_at=f"{sink.first_event_at:.6f}",
        taken_at=f"{sink.writing_since:.6f}",
        written_at=f"{time.monotonic():.6f}",
    )


def _record_end(
    plan: GenerationPlan,
    accepted: OpenRequest,
    outputs: list[OutputStream],
    status: str,
    code: str,
    started: float,
    finish_reasons: Sequence[int],
) -> None:
    duration = time.perf_counter() - started
    completion_tokens = sum(o.generated for o in outputs)
    metrics.IN_FLIGHT.dec()
    key = auth.key_label(accepted.owner)  # security hook: the key name, never the secret
    metrics.requests_counter(status, code, key).inc()
    metrics.E2E.observe(duration)
    accepted.trace.event("finished", status=status)
    accepted.trace.end(status=status, code=code, completion_tokens=completion_tokens, finish_reasons=finish_reasons)
    log_event(
        logger,
        "request ended",
        request_id=plan.request_id,
        key=key,
        trace_id=trace_id(plan.metadata),
        node_id=accepted.node.node_id,
        status=status,
        completion_tokens=completion_tokens,
        duration_s=f"{duration:.3f}",
    )


def _large_input(request: generation_pb2.GenerateRequest) -> bool:
    """Whether validating the request's prompt (tokenizing, or copying and scanning its ids) takes long enough
    to run off the event loop."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return len(request.prompt) > OFF_LOOP_PROMPT_CHARS
    return kind == "token_ids" and len(request.token_ids.ids) > OFF_LOOP_TOKEN_IDS


def refusal_reason(kind: type[Refusal]) -> str:
    """The refusal kind as a metric label: DuplicateRequest -> duplicate_request."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in kind.__name__).lstrip("_")


for _kind in REFUSAL_CODES:  # every reason is a series from the start (0), for rate() and the dashboard
    metrics.REFUSALS.labels(reason=refusal_reason(_kind))


def trace_id(metadata: RequestMetadata) -> str:
    """The trace id of a W3C traceparent (version-traceid-parentid-flags), or "-"."""
    parts = metadata.traceparent.split("-")
    return parts[1] if len(parts) == 4 else "-"


def _first_failure(items: list) -> LaneFailure | cluster_pb2.OutputEvent | None:
    """What ends the stream with an EngineError: a lost lane or an engine error event."""
    for item in items:
        if type(item) is LaneFailure or (type(item) is not bytes and item.finish == ENGINE_FINISH_ERROR):
            return item
    return None


def _by_output(items: list[cluster_pb2.OutputEvent]):
    """(output_index, its events) in arrival order, for requests with several outputs."""
    by_output: dict[int, list[cluster_pb2.OutputEvent]] = {}
    for event in items:
        by_output.setdefault(event.output_index, []).append(event)
    return by_output.items()


def _usage(plan: GenerationPlan, outputs: list[OutputStream], cached_prompt_tokens: int | None) -> generation_pb2.Usage:
    """`cached_prompt_tokens`: the prompt tokens whose KV the prefix cache gave (None: an engine without one)."""
    prompt = len(plan.prompt_token_ids)
    completion = sum(o.generated for o in outputs)
    usage = generation_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    if cached_prompt_tokens is not None:
        usage.cached_prompt_tokens = cached_prompt_tokens
    return usage
