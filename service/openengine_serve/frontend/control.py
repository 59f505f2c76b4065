"""openengine.v1 Control: server and model info, load, health, Abort, KV events (frontend/kv_events.py); LoRA is not
offered."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import NoReturn, Protocol

import grpc

from .. import __version__
from ..api.openengine.v1 import kv_pb2, lifecycle_pb2, lora_pb2, model_pb2, openengine_pb2_grpc, server_pb2
from ..api.openengine_internal.v1 import cluster_pb2
from ..common.config import FrontendConfig
from ..common.grpc_server import ServerImplementation
from ..common.health_service import Health
from ..common.kv_blocks import BLOCK_SIZE as KV_BLOCK_SIZE
from ..common.logging_setup import log_event
from . import auth
from .coordinator_client import AbortIncomplete, CoordinatorClient
from .inference_probe import InferenceProbe
from .kv_events import KvEventRelay
from .refusal import InvalidRequest
from .served_model import ServedModel
from .validation import check_request_id, lora_name_problem, shown

logger = logging.getLogger("openengine_serve.frontend")

SCHEMA_REVISION = 1
SCHEMA_RELEASE = "openengine@4def7c50b05e0674a0c3b26917399155535966e4"
ENGINE_NAME = "openengine-serve"

# every guide kind of the protocol: common/guides.py compiles each to an llguidance grammar
GUIDED_MODES = [
    model_pb2.GUIDED_DECODING_MODE_JSON_SCHEMA,
    model_pb2.GUIDED_DECODING_MODE_REGEX,
    model_pb2.GUIDED_DECODING_MODE_EBNF_GRAMMAR,
    model_pb2.GUIDED_DECODING_MODE_STRUCTURAL_TAG,
    model_pb2.GUIDED_DECODING_MODE_CHOICE,
    model_pb2.GUIDED_DECODING_MODE_JSON_OBJECT,
]
READY = lifecycle_pb2.HEALTH_STATE_READY
DEGRADED = lifecycle_pb2.HEALTH_STATE_DEGRADED
NOT_READY = lifecycle_pb2.HEALTH_STATE_NOT_READY


class AbortingContext(Protocol):
    """What the handlers that refuse use of a servicer context (grpcio's or pygrpc-native's)."""

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn: ...  # raises: ends the call


class Control(openengine_pb2_grpc.ControlServicer):
    def __init__(
        self,
        config: FrontendConfig,
        frontend_id: str,
        implementation: ServerImplementation,
        coordinator: CoordinatorClient,
        health: Health,
        probe: InferenceProbe,
        model: ServedModel,
        kv_events: KvEventRelay,
    ) -> None:
        self.config = config
        self.kv_events = kv_events
        self.model = model
        self.frontend_id = frontend_id
        self.implementation = implementation
        self.coordinator = coordinator
        self.health = health
        self.probe = probe

    async def GetServerInfo(self, request, context) -> server_pb2.ServerInfo:
        nodes = self.coordinator.ready_nodes() or list(self.coordinator.nodes.values())
        loaded = self.model.loaded
        info = server_pb2.ServerInfo(
            engine_name=ENGINE_NAME,
            engine_version=__version__,
            engine_role=server_pb2.ENGINE_ROLE_AGGREGATED,
            instance_id=self.frontend_id,
            supported_models=self.model.names(),
            schema_revision=SCHEMA_REVISION,
            minimum_client_revision=SCHEMA_REVISION,
            schema_release=SCHEMA_RELEASE,
            parallelism=server_pb2.ParallelismInfo(
                tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=len(nodes)
            ),
            kv_connector=kv_pb2.KvConnectorInfo(enabled=False),
        )
        if nodes:
            info.capacity.max_running_requests = sum(n.load.max_running_requests for n in nodes)
        if self._kv_events_served():
            info.capacity.kv_block_size = KV_BLOCK_SIZE  # the KV events' blocks
        max_loras = max((m.limits.max_loras for m in self.model.models.values()), default=0)
        if max_loras:
            info.capacity.max_loras = max_loras
        info.extra.update({**self.implementation.describe(), "frontend_id": self.frontend_id})
        if loaded:
            info.extra.update({"engine": loaded.card.engine, "model": loaded.card.name})
        return info

    async def GetModelInfo(self, request, context: AbortingContext) -> model_pb2.ModelInfo:
        if self.model.loaded is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is not loaded yet (no ready node); retry")
            return
        names = self.model.names()
        if not request.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model is required; served: {', '.join(names)}")
            return
        loaded = self.model.for_name(request.model)
        if loaded is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"model {shown(request.model)} is not served; served: {', '.join(names)}"
            )
            return
        limits = loaded.limits
        logprobs = model_pb2.LogprobCapabilities(
            supported=True,
            max_top_n=limits.max_top_n,
            candidate_selection_modes=[
                model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N,
                model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOKEN_IDS,
            ],
        )
        tokenizer = loaded.tokenizer
        info = model_pb2.ModelInfo(
            model_id=loaded.card.name,
            served_model_name=limits.served_model_name,
            served_model_aliases=list(limits.aliases),
            max_context_length=limits.max_context_length,
            max_output_tokens=limits.max_output_tokens,
            tokenizer_modes=[tokenizer.mode],
            supports_text_input=True,
            supports_token_ids_input=True,
            generation=model_pb2.GenerationCapabilities(
                prompt_logprobs=logprobs,
                output_logprobs=logprobs,
                guided_decoding=model_pb2.GuidedDecodingCapabilities(
                    supported=limits.guided_decoding, modes=GUIDED_MODES if limits.guided_decoding else []
                ),
                max_num_sequences=limits.max_num_sequences,
                supports_priority=True,
                supports_stop_in_output=True,
                supports_cache_salt=limits.prefix_cache,
                supports_prefix_cache_bypass=limits.prefix_cache,
            ),
            supports_lora=limits.max_loras > 0,
            supports_multimodal=False,
        )
        info.extra.update(
            {
                "engine": loaded.card.engine,
                "vocab_size": tokenizer.n_vocab,
                "end_of_generation_token_ids": list(tokenizer.end_of_generation),
                "max_candidate_token_ids": limits.max_candidate_token_ids,
                "chat_template": tokenizer.chat_template,
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "tokenizer_digest": loaded.card.tokenizer_digest,
            }
        )
        return info

    async def GetLoad(self, request, context) -> server_pb2.LoadInfo:
        load = await self.coordinator.cluster_load()
        live = [n for n in load.nodes if n.state in (cluster_pb2.NODE_STATE_READY, cluster_pb2.NODE_STATE_DRAINING)]
        info = server_pb2.LoadInfo(instance_id=self.frontend_id, timestamp_unix_nanos=time.time_ns())
        for figure, value in load_sums(live).items():
            setattr(info, figure, value)
        by_model: dict[str, list[cluster_pb2.NodeEntry]] = {}
        for n in live:
            by_model.setdefault(n.model.name, []).append(n)
        info.attributes.update({"models": {model: model_load(nodes) for model, nodes in sorted(by_model.items())}})
        if request.include_per_rank:
            for n in sorted(live, key=lambda n: n.rank):
                info.ranks.add(
                    data_parallel_rank=n.rank,
                    running_requests=n.load.running_requests,
                    queued_requests=n.load.queued_requests,
                    decode_batch_size=n.load.decode_batch_size,
                )
        return info

    async def Health(self, request, context) -> lifecycle_pb2.HealthResponse:
        checks = self.health_checks()
        if request.include_inference_probe and not self.health.draining:
            checks.append(await self.probe.check())
        state = next((c.state for c in checks if c.state != READY), READY)
        return lifecycle_pb2.HealthResponse(state=state, checks=checks)

    def health_checks(self) -> list[lifecycle_pb2.HealthCheck]:
        """grpc, coordinator, scheduler, model — in that order; the first non-READY one is the overall state."""
        draining = self.health.draining
        checks = [
            lifecycle_pb2.HealthCheck(
                name="grpc",
                state=lifecycle_pb2.HEALTH_STATE_DRAINING if draining else READY,
                message="draining: new requests are refused" if draining else f"serving on {self.implementation.name}",
            )
        ]
        coordinator = self.coordinator
        ready_nodes = coordinator.ready_nodes()
        # public answers name no internal address: the coordinators are counted, not named
        if coordinator.reachable:
            checks.append(lifecycle_pb2.HealthCheck(name="coordinator", state=READY, message="reachable"))
        else:
            checks.append(
                lifecycle_pb2.HealthCheck(
                    name="coordinator",
                    state=DEGRADED if ready_nodes else NOT_READY,
                    message=f"{len(coordinator.unreachable_addresses())} of {len(coordinator.shards)} coordinators "
                    f"unreachable; serving from the last known node table ({len(ready_nodes)} ready nodes)",
                )
            )
        checks.append(
            lifecycle_pb2.HealthCheck(
                name="scheduler",
                state=READY if ready_nodes else NOT_READY,
                message=f"{len(ready_nodes)} ready nodes of {len(coordinator.nodes)} known",
            )
        )
        models = list(self.model.models.values())
        if not models:
            checks.append(
                lifecycle_pb2.HealthCheck(
                    name="model", state=lifecycle_pb2.HEALTH_STATE_STARTING, message="waiting for a ready node's model"
                )
            )
        else:
            checks.append(
                lifecycle_pb2.HealthCheck(
                    name="model",
                    state=READY,
                    message="; ".join(
                        f"{m.name} ({m.card.engine}): tokenizer {m.tokenizer.mode} loaded" for m in models
                    ),
                )
            )
        return checks

    async def Abort(self, request: lifecycle_pb2.AbortRequest, context: AbortingContext) -> lifecycle_pb2.AbortResponse:
        target = request.WhichOneof("target")
        if target is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "exactly one target is required: request_id, kv_session or all_requests",
            )
            return
        if target == "kv_session":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no KV sessions exist in an aggregated deployment")
            return
        if target == "request_id":
            try:
                check_request_id(request.request_id)  # the rule of Generate: an id it refuses is never running
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
                return
        refusal = auth.abort_refusal() if target == "all_requests" else None  # security hook: a user aborts its own
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
            return
        try:
            if target == "all_requests":
                reply = await self.coordinator.abort(cluster_pb2.ClusterAbortRequest(all_requests=True))
            else:
                reply = await self._abort_by_id(request.request_id)
        except grpc.aio.AioRpcError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"abort needs the coordinator, which is unreachable ({exc.code().name})"
            )
            return
        except AbortIncomplete as exc:  # several coordinators, some unreachable: what the others aborted stays
            log_event(
                logger,
                "abort incomplete",
                logging.WARNING,
                target=target,
                key=auth.caller_label(),
                aborted=exc.aborted,
                unreachable=[address for address, _ in exc.unreachable],
            )
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"aborted {exc.aborted} request(s); {len(exc.unreachable)} coordinator(s) were unreachable; "
                "retry the Abort",
            )
            return
        if reply.outcome == cluster_pb2.ABORT_OUTCOME_NOT_FOUND:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id {shown(request.request_id)} is not known")
            return
        if reply.outcome == cluster_pb2.ABORT_OUTCOME_ALREADY_FINISHED:
            return lifecycle_pb2.AbortResponse(
                status=lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED,
                message=f"request_id {shown(request.request_id)} already finished",
            )
        log_event(
            logger,
            "abort",
            target=target,
            request_id=request.request_id,
            key=auth.caller_label(),
            aborted=reply.aborted,
        )
        return lifecycle_pb2.AbortResponse(
            status=lifecycle_pb2.ABORT_STATUS_ABORTED, message=f"aborted {reply.aborted} request(s)"
        )

    async def _abort_by_id(self, request_id: str) -> cluster_pb2.ClusterAbortReply:
        """Every request the caller may end by this id (auth.abort_targets), one coordinator call each, in one
        reply: aborted if any was, else already finished if any was, else not found."""
        replies = await asyncio.gather(
            *(
                self.coordinator.abort(cluster_pb2.ClusterAbortRequest(request_id=internal_id, owner=owner))
                for internal_id, owner in auth.abort_targets(request_id)
            )
        )
        outcomes = {reply.outcome for reply in replies}
        outcome = next(
            (
                o
                for o in (cluster_pb2.ABORT_OUTCOME_ABORTED, cluster_pb2.ABORT_OUTCOME_ALREADY_FINISHED)
                if o in outcomes
            ),
            cluster_pb2.ABORT_OUTCOME_NOT_FOUND,
        )
        return cluster_pb2.ClusterAbortReply(outcome=outcome, aborted=sum(reply.aborted for reply in replies))

    async def LoadLora(self, request: lora_pb2.LoadLoraRequest, context: AbortingContext) -> lora_pb2.LoadLoraResponse:
        await self._check_lora_served(context)
        adapter = request.adapter
        problem = lora_name_problem(adapter.lora_name)
        if problem is None and not adapter.source_path:
            problem = "adapter.source_path is required: the adapter's GGUF file in the nodes' OPENENGINE_LORA_DIR"
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # the coordinator's table keeps the name and file only (lora_id is its own)
        named = lora_pb2.LoraAdapter(lora_name=adapter.lora_name, source_path=adapter.source_path)
        outcome = await self._set_lora(cluster_pb2.LoraCommand(adapter=named), context)
        return lora_pb2.LoadLoraResponse(adapter=outcome.adapter, already_loaded=outcome.already_loaded)

    async def UnloadLora(
        self, request: lora_pb2.UnloadLoraRequest, context: AbortingContext
    ) -> lora_pb2.UnloadLoraResponse:
        await self._check_lora_served(context)
        if not request.lora_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name is required")
        named = lora_pb2.LoraAdapter(lora_name=request.lora_name)
        outcome = await self._set_lora(cluster_pb2.LoraCommand(adapter=named, unload=True), context)
        return lora_pb2.UnloadLoraResponse(adapter=outcome.adapter)

    async def ListLoras(self, request, context: AbortingContext) -> lora_pb2.ListLorasResponse:
        await self._check_lora_served(context)
        adapters = list(self.coordinator.loras.values())
        adapters.sort(key=lambda adapter: adapter.lora_id)
        return lora_pb2.ListLorasResponse(adapters=adapters)

    async def _check_lora_served(self, context: AbortingContext) -> None:
        loaded = self.model.loaded
        if loaded is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is not loaded yet (no ready node); retry")
        elif not any(m.limits.max_loras for m in self.model.models.values()):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"LoRA is not enabled on this deployment ({loaded.card.engine} engine; the llama.cpp nodes serve "
                f"adapters with OPENENGINE_LORA_DIR set)",
            )

    async def _set_lora(self, command: cluster_pb2.LoraCommand, context: AbortingContext) -> cluster_pb2.LoraOutcome:
        try:
            return await self.coordinator.set_lora(command)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                code = grpc.StatusCode.UNAVAILABLE
            await context.abort(code, exc.details() or code.name)
            raise  # context.abort raises

    def _kv_events_served(self) -> bool:
        return any(m.limits.prefix_cache for m in self.model.models.values())

    async def GetKvEventSources(self, request, context) -> kv_pb2.GetKvEventSourcesResponse:
        if not self._kv_events_served():
            return kv_pb2.GetKvEventSourcesResponse()
        return kv_pb2.GetKvEventSourcesResponse(sources=self.kv_events.sources(request.data_parallel_ranks))

    async def SubscribeKvEvents(self, request, context):
        if not self._kv_events_served():
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "KV events are not available: the engine here has no prefix cache (or no node is ready yet)",
            )
        try:
            nodes = self.kv_events.check(request)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not nodes:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no node is ready: no KV events to follow; retry")
        async with contextlib.aclosing(self.kv_events.subscribe(request, nodes)) as responses:
            async for response in responses:
                yield response


LOAD_SUMS = ("running_requests", "queued_requests", "running_tokens", "waiting_tokens", "decode_batch_size")


def load_sums(nodes: list[cluster_pb2.NodeEntry]) -> dict[str, int]:
    """GetLoad's figures, each summed over the nodes."""
    return {figure: sum(getattr(n.load, figure) for n in nodes) for figure in LOAD_SUMS}


def model_load(nodes: list[cluster_pb2.NodeEntry]) -> dict[str, object]:
    """GetLoad's figures over one model's nodes (LoadInfo.attributes["models"][name]), with the ranks serving it."""
    return {**load_sums(nodes), "data_parallel_ranks": sorted(n.rank for n in nodes)}
