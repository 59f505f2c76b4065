"""openengine.v1 Inference and Control, as SEMANTICS.md describes them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from .. import __version__
from ..api.openengine.v1 import (error_pb2, generation_pb2, kv_pb2, lifecycle_pb2, lora_pb2, model_pb2,
                                 openengine_pb2_grpc, server_pb2)
from ..api.openengine_internal.v1 import cluster_pb2
from ..common.config import FrontendConfig
from ..common.grpc_server import ServerImplementation
from ..common import health as component_health
from ..common.logging_setup import log_event
from . import auth, metrics
from .cluster import Cluster, LaneFailure, NodeConnection, RequestSink, RoutingRefused
from .stream import ENGINE_ERROR, OutputStream, TokenStrings, engine_error, prompt_output
from .text import encode_prompt
from .validation import GenerationPlan, ModelLimits, RequestRejected, parse_metadata, validate_generate

logger = logging.getLogger("openengine_serve.frontend")

SCHEMA_REVISION = 1
SCHEMA_RELEASE = "openengine@4def7c50b05e0674a0c3b26917399155535966e4"
ENGINE_NAME = "openengine-serve"
MAX_TOP_N = 20
PROBE_REQUEST_PREFIX = "inference-probe-"


def engine_request(plan: GenerationPlan, frontend_id: str) -> cluster_pb2.EngineRequest:
    req = cluster_pb2.EngineRequest(
        request_id=plan.request_id, frontend_id=frontend_id, prompt_token_ids=plan.prompt_token_ids,
        num_sequences=plan.num_sequences, max_tokens=plan.max_tokens, min_tokens=plan.min_tokens,
        stop_token_ids=plan.stop_token_ids, ignore_eos=plan.ignore_eos, priority=plan.metadata.priority,
        temperature=plan.temperature, top_p=plan.top_p, top_k=plan.top_k,
        seed=plan.seed or 0, has_seed=plan.seed is not None,
        output_logprobs=plan.output_logprobs, prompt_logprobs=plan.prompt_logprobs,
        prompt_logprob_start=plan.prompt_logprob_start)
    for target, selection in ((req.output_candidates, plan.output_candidates),
                              (req.prompt_candidates, plan.prompt_candidates)):
        if selection is not None:
            kind, value = selection
            if kind == "top_n":
                target.top_n = value
            else:
                target.token_ids.extend(value)
    return req


def trace_metadata(metadata) -> tuple[tuple[str, str], ...]:
    """W3C trace context passed on to the internal calls of the request."""
    if not metadata.traceparent:
        return ()
    pairs = (("traceparent", metadata.traceparent),)
    return pairs + ((("tracestate", metadata.tracestate),) if metadata.tracestate else ())


def trace_id(metadata) -> str:
    """The trace id of a W3C traceparent (version-traceid-parentid-flags), or "-"."""
    parts = metadata.traceparent.split("-")
    return parts[1] if len(parts) == 4 else "-"


class Frontend(openengine_pb2_grpc.InferenceServicer, openengine_pb2_grpc.ControlServicer):
    def __init__(self, config: FrontendConfig, frontend_id: str, implementation: ServerImplementation,
                 encoding, cluster: Cluster, health: component_health.Health) -> None:
        self.config = config
        self.frontend_id = frontend_id
        self.implementation = implementation
        self.encoding = encoding
        self.strings = TokenStrings(encoding)
        self.cluster = cluster
        self.health = health
        self.limits = ModelLimits(
            served_model_name=config.model, aliases=config.aliases(), max_context_length=config.max_context_length,
            max_output_tokens=config.max_output_tokens, max_num_sequences=config.max_num_sequences,
            max_top_n=MAX_TOP_N, max_stop_conditions=16, vocab_size=encoding.n_vocab)
        self._probe: asyncio.Future | None = None
        self._probe_count = 0

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.encoding, text)

    # ================================================================ Inference

    async def Generate(self, request: generation_pb2.GenerateRequest, context) -> None:
        # A coroutine writing with context.write, not an async generator: when the client cancels, the
        # cancellation lands in `_stream`, whose cleanup (free the engine slot, release the id) runs at once,
        # not whenever the garbage collector finalizes an abandoned generator.
        started = time.perf_counter()
        try:
            if self.health.draining:
                raise RequestRejected(grpc.StatusCode.UNAVAILABLE,
                                      "this frontend is draining; retry on another frontend")
            plan = validate_generate(request, parse_metadata(context.invocation_metadata() or ()),
                                     self.limits, self.encode)
            conn, sink = await self._accept(plan)
        except (RequestRejected, RoutingRefused) as exc:
            metrics.REQUESTS.labels(status="rejected", code=exc.code.name, key=auth.caller_label()).inc()
            await context.abort(exc.code, exc.message)
        await self._stream(plan, conn, sink, started, context.write)

    async def _accept(self, plan: GenerationPlan) -> tuple[NodeConnection, RequestSink]:
        """Reserves the id, picks the node and submits; any failure here is a gRPC status, not a stream event."""
        cluster = self.cluster
        trace = trace_metadata(plan.metadata)
        node = await cluster.reserve(plan.request_id, plan.metadata.routing_key, plan.metadata.target_rank,
                                     len(plan.prompt_token_ids), plan.num_sequences, trace, owner=auth.owner())
        sink = cluster.open_sink(plan.request_id)  # before Submit: the first step may come back at once
        try:
            conn = await cluster.connect(node)
            await cluster.submit(conn, engine_request(plan, self.frontend_id), trace)
        except (grpc.aio.AioRpcError, ConnectionError, asyncio.TimeoutError) as exc:
            cluster.close_sink(plan.request_id, cluster.connections.get(node.node_id))
            cluster.release(plan.request_id)
            raise RoutingRefused(*_submit_failure(exc, node)) from None
        return conn, sink

    async def _stream(self, plan: GenerationPlan, conn: NodeConnection, sink: RequestSink, started: float,
                      write: Callable[[bytes | generation_pb2.GenerateResponse], Awaitable[None]]) -> None:
        """Streams the request's engine events to `write` until every output finished (or the stream failed)."""
        cluster = self.cluster
        request_id = plan.request_id
        outputs = [OutputStream(i, plan, self.encoding, self.strings) for i in range(plan.num_sequences)]
        open_outputs = plan.num_sequences
        single_output = open_outputs == 1
        prompt_sent = not plan.prompt_logprobs
        status, code = "error", "INTERNAL"
        metrics.IN_FLIGHT.inc()
        metrics.PROMPT_TOKENS.inc(len(plan.prompt_token_ids))
        first_token_at = last_token_at = None
        try:
            while open_outputs:
                items = await sink.take()
                failure = _first_failure(items)
                if failure is not None:
                    status, code = "failed", "OK"
                    draining = isinstance(failure, LaneFailure) and failure.draining
                    await write(engine_error(request_id, error_pb2.ERROR_CODE_DRAINING if draining
                                             else error_pb2.ERROR_CODE_INTERNAL, failure.message, failure.retryable))
                    return
                if not prompt_sent and items[0].prompt_tokens:
                    prompt_sent = True
                    await write(prompt_output(plan, items[0], self.strings))
                new_tokens = 0
                for index, events in ((0, items),) if single_output else _by_output(items):
                    output = outputs[index]
                    if output.finished:
                        continue  # the node may still report an output this frontend already ended (stop string)
                    delta, delta_tokens, finished, stop_output = output.on_events(events)
                    if stop_output:
                        cluster.cancel(conn, request_id, index)
                    if delta is not None:
                        new_tokens += delta_tokens
                        await write(delta)
                    if finished is not None:
                        open_outputs -= 1
                        if not open_outputs:
                            finished.usage.CopyFrom(_usage(plan, outputs))
                        await write(finished)
                if new_tokens:
                    now = time.perf_counter()
                    if first_token_at is None:
                        first_token_at = now
                        metrics.TTFT.observe(now - started)
                    else:
                        metrics.ITL.observe(now - last_token_at)
                    last_token_at = now
                    metrics.GENERATED_TOKENS.inc(new_tokens)
            status, code = "finished", "OK"
        except asyncio.CancelledError:
            status, code = "cancelled", "CANCELLED"
            raise
        finally:
            if open_outputs:
                cluster.cancel(conn, request_id)  # client went away or the stream failed: free the engine slot
            cluster.close_sink(request_id, conn)
            cluster.release(request_id)
            duration = time.perf_counter() - started
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(status=status, code=code, key=auth.caller_label()).inc()
            metrics.E2E.observe(duration)
            log_event(logger, "request ended", request_id=request_id, key=auth.caller_label(),
                      trace_id=trace_id(plan.metadata),
                      node_id=conn.entry.node_id, status=status, completion_tokens=sum(o.generated for o in outputs),
                      duration_s=f"{duration:.3f}")

    # ================================================================ Control

    async def GetServerInfo(self, request, context) -> server_pb2.ServerInfo:
        nodes = self.cluster.ready_nodes() or list(self.cluster.nodes.values())
        max_running = sum(n.load.max_running_requests for n in nodes)
        info = server_pb2.ServerInfo(
            engine_name=ENGINE_NAME, engine_version=__version__,
            engine_role=server_pb2.ENGINE_ROLE_AGGREGATED, instance_id=self.frontend_id,
            supported_models=[self.config.model, *self.config.aliases()],
            schema_revision=SCHEMA_REVISION, minimum_client_revision=SCHEMA_REVISION, schema_release=SCHEMA_RELEASE,
            parallelism=server_pb2.ParallelismInfo(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                   data_parallel_size=len(nodes)),
            kv_connector=kv_pb2.KvConnectorInfo(enabled=False))
        if nodes:
            info.capacity.max_running_requests = max_running
        info.extra.update({"grpc_server": self.implementation.name,
                           "grpc_server_version": self.implementation.version,
                           "frontend_id": self.frontend_id})
        return info

    async def GetModelInfo(self, request, context) -> model_pb2.ModelInfo:
        names = (self.config.model, *self.config.aliases())
        if not request.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model is required; served: {', '.join(names)}")
        if request.model not in names:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {request.model!r} is not served; served: {', '.join(names)}")
        logprobs = model_pb2.LogprobCapabilities(
            supported=True, max_top_n=MAX_TOP_N,
            candidate_selection_modes=[model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N,
                                       model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS])
        return model_pb2.ModelInfo(
            model_id=self.config.model, served_model_name=self.config.model,
            served_model_aliases=list(self.config.aliases()),
            max_context_length=self.config.max_context_length, max_output_tokens=self.config.max_output_tokens,
            tokenizer_modes=["qwen3-bpe"], supports_text_input=True, supports_token_ids_input=True,
            generation=model_pb2.GenerationCapabilities(
                prompt_logprobs=logprobs, output_logprobs=logprobs,
                guided_decoding=model_pb2.GuidedDecodingCapabilities(supported=False),
                max_num_sequences=self.config.max_num_sequences, supports_priority=True,
                supports_stop_in_output=True, supports_cache_salt=False, supports_prefix_cache_bypass=False),
            supports_lora=False, supports_multimodal=False)

    async def GetLoad(self, request, context) -> server_pb2.LoadInfo:
        load = await self.cluster.cluster_load()
        live = [n for n in load.nodes if n.state in (cluster_pb2.NODE_STATE_READY, cluster_pb2.NODE_STATE_DRAINING)]
        info = server_pb2.LoadInfo(
            instance_id=self.frontend_id, timestamp_unix_nanos=time.time_ns(),
            running_requests=sum(n.load.running_requests for n in live),
            queued_requests=sum(n.load.queued_requests for n in live),
            running_tokens=sum(n.load.running_tokens for n in live),
            waiting_tokens=sum(n.load.waiting_tokens for n in live),
            decode_batch_size=sum(n.load.decode_batch_size for n in live))
        if request.include_per_rank:
            for n in sorted(live, key=lambda n: n.rank):
                info.ranks.add(data_parallel_rank=n.rank, running_requests=n.load.running_requests,
                               queued_requests=n.load.queued_requests, decode_batch_size=n.load.decode_batch_size)
        return info

    async def Health(self, request, context) -> lifecycle_pb2.HealthResponse:
        checks = self.health_checks()
        if request.include_inference_probe and not self.health.draining:
            checks.append(await self.inference_probe())
        state = next((c.state for c in checks if c.state != lifecycle_pb2.HEALTH_STATE_READY), lifecycle_pb2.HEALTH_STATE_READY)
        return lifecycle_pb2.HealthResponse(state=state, checks=checks)

    def health_checks(self) -> list[lifecycle_pb2.HealthCheck]:
        """grpc, coordinator, scheduler, model — in that order; the first non-READY one is the overall state."""
        draining = self.health.draining
        checks = [lifecycle_pb2.HealthCheck(
            name="grpc", state=lifecycle_pb2.HEALTH_STATE_DRAINING if draining else lifecycle_pb2.HEALTH_STATE_READY,
            message="draining: new requests are refused" if draining else f"serving on {self.implementation.name}")]
        ready_nodes = self.cluster.ready_nodes()
        if self.cluster.coordinator_reachable:
            checks.append(lifecycle_pb2.HealthCheck(name="coordinator", state=lifecycle_pb2.HEALTH_STATE_READY,
                                                    message=self.cluster.coordinator_address))
        else:
            checks.append(lifecycle_pb2.HealthCheck(
                name="coordinator", state=lifecycle_pb2.HEALTH_STATE_DEGRADED if ready_nodes else lifecycle_pb2.HEALTH_STATE_NOT_READY,
                message=f"coordinator {self.cluster.coordinator_address} unreachable; "
                        f"serving from the last known node table ({len(ready_nodes)} ready nodes)"))
        checks.append(lifecycle_pb2.HealthCheck(
            name="scheduler", state=lifecycle_pb2.HEALTH_STATE_READY if ready_nodes else lifecycle_pb2.HEALTH_STATE_NOT_READY,
            message=f"{len(ready_nodes)} ready nodes of {len(self.cluster.nodes)} known"))
        checks.append(lifecycle_pb2.HealthCheck(name="model", state=lifecycle_pb2.HEALTH_STATE_READY,
                                                message=f"{self.config.model}: tokenizer loaded"))
        return checks

    async def inference_probe(self) -> lifecycle_pb2.HealthCheck:
        """One real token through the whole path; concurrent callers share one probe."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._run_probe())
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> lifecycle_pb2.HealthCheck:
        self._probe_count += 1
        request_id = f"{PROBE_REQUEST_PREFIX}{self.frontend_id}-{self._probe_count}"
        plan = validate_generate(
            generation_pb2.GenerateRequest(request_id=request_id, model=self.config.model,
                                           token_ids=generation_pb2.TokenIds(ids=[9707]),
                                           stopping=generation_pb2.StoppingOptions(max_tokens=1, ignore_eos=True)),
            parse_metadata(()), self.limits, self.encode)
        try:
            async with asyncio.timeout(5.0):
                conn, sink = await self._accept(plan)
                errors: list[str] = []

                async def keep_errors(response) -> None:
                    if type(response) is not bytes and response.HasField("error"):
                        errors.append(response.error.message)

                await self._stream(plan, conn, sink, time.perf_counter(), keep_errors)
                if errors:
                    raise RuntimeError(errors[0])
            return lifecycle_pb2.HealthCheck(name="inference_probe", state=lifecycle_pb2.HEALTH_STATE_READY,
                                             message=f"one token generated on node {conn.entry.node_id}")
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - any failure is the probe's answer
            return lifecycle_pb2.HealthCheck(name="inference_probe", state=lifecycle_pb2.HEALTH_STATE_DEGRADED,
                                             message=f"probe failed: {getattr(exc, 'message', None) or exc!r}")

    async def Abort(self, request: lifecycle_pb2.AbortRequest, context) -> lifecycle_pb2.AbortResponse:
        target = request.WhichOneof("target")
        if target is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "exactly one target is required: request_id, kv_session or all_requests")
        if target == "kv_session":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no KV sessions exist in an aggregated deployment")
        if target == "request_id" and not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        owner, refusal = auth.abort_scope(target == "all_requests")  # security hook: a user aborts only its own
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        cluster_request = (cluster_pb2.ClusterAbortRequest(all_requests=True) if target == "all_requests"
                           else cluster_pb2.ClusterAbortRequest(request_id=request.request_id, owner=owner))
        try:
            reply = await self.cluster.abort(cluster_request)
        except grpc.aio.AioRpcError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"abort needs the coordinator, which is unreachable ({exc.code().name})")
        if reply.outcome == cluster_pb2.ABORT_OUTCOME_NOT_FOUND:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id {request.request_id!r} is not known")
        if reply.outcome == cluster_pb2.ABORT_OUTCOME_ALREADY_FINISHED:
            return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED,
                                               message=f"request_id {request.request_id!r} already finished")
        log_event(logger, "abort", target=target, request_id=request.request_id, key=auth.caller_label(),
                  aborted=reply.aborted)
        return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ABORTED,
                                           message=f"aborted {reply.aborted} request(s)")

    async def LoadLora(self, request, context) -> lora_pb2.LoadLoraResponse:
        await _lora_disabled(context)

    async def UnloadLora(self, request, context) -> lora_pb2.UnloadLoraResponse:
        await _lora_disabled(context)

    async def ListLoras(self, request, context) -> lora_pb2.ListLorasResponse:
        await _lora_disabled(context)

    async def GetKvEventSources(self, request, context) -> kv_pb2.GetKvEventSourcesResponse:
        return kv_pb2.GetKvEventSourcesResponse()

    async def SubscribeKvEvents(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "KV events are not available: this engine has no KV connector (kv_connector.enabled=false)")
        yield  # pragma: no cover - makes this an async generator like the other streaming handler


async def _lora_disabled(context) -> None:
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoRA is not enabled on this deployment")


def _submit_failure(exc: Exception, node: cluster_pb2.NodeEntry) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"node {node.node_id} is full: {exc.details()}; retry later"
    detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
    return grpc.StatusCode.UNAVAILABLE, f"node {node.node_id} at {node.address} did not take the request: {detail}"


def _first_failure(items: list) -> LaneFailure | cluster_pb2.OutputEvent | None:
    """What ends the stream with an EngineError: a lost lane or an engine error event."""
    for item in items:
        if type(item) is LaneFailure or item.finish == ENGINE_ERROR:
            return item
    return None


def _by_output(items: list[cluster_pb2.OutputEvent]):
    """(output_index, its events) in arrival order, for requests with several outputs."""
    by_output: dict[int, list[cluster_pb2.OutputEvent]] = {}
    for event in items:
        by_output.setdefault(event.output_index, []).append(event)
    return by_output.items()


def _usage(plan: GenerationPlan, outputs: list[OutputStream]) -> generation_pb2.Usage:
    prompt = len(plan.prompt_token_ids)
    completion = sum(o.generated for o in outputs)
    return generation_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
