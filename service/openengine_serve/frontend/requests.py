"""One owner for every Generate request of this frontend, from reservation to release.

`Requests.open(plan)` reserves the id and a node (the coordinator's choice, or
the fallback routing's while the coordinator cannot be reached), opens the
request's sink, connects to the node and submits the internal EngineRequest.
It yields an `OpenRequest` whose sink the caller streams from, and on exit,
however the stream ended, it cancels what the engine may still run, closes
the sink and releases the id. Anything that stops the request before it is
accepted raises a `Refusal`. A drain waits on the owner's count of open requests.

Inside the deployment a request goes by its internal id (`auth.internal_request_id`: with API keys, scoped by
the key), while the client's responses carry the id it sent. Refusals tell the client what to do and never
name a node, a coordinator or their addresses; the log keeps those.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
from collections.abc import AsyncIterator

import grpc

from ..api.openengine_internal.v1 import cluster_pb2
from ..common.attempts import AttemptIds
from ..common.kv_blocks import BLOCK_SIZE as KV_BLOCK_SIZE
from ..common.kv_blocks import block_hashes, cache_namespace
from ..common.logging_setup import log_event
from ..common.tracing import RESERVE_SPAN, SUBMIT_SPAN
from . import auth, metrics
from .batched_stream import StreamBroken
from .coordinator_client import CoordinatorClient, CoordinatorUnreachable
from .fallback_routing import FallbackRouter
from .nodes import LaneFailure, NodeConnection, NodeConnections, RequestSink, SubmitRefused
from .refusal import DuplicateRequest, Overloaded, Refusal, Unavailable
from .request_trace import NO_TRACE, RequestTrace
from .validation import GenerationPlan, RequestMetadata

logger = logging.getLogger("openengine_serve.frontend")


class OpenRequest:
    """An accepted request: its node, its sink, its owner, its trace, and the call that stops one of its outputs
    on the node."""

    __slots__ = ("request_id", "attempt_id", "owner", "node", "sink", "ended", "trace", "hops", "_conn", "_nodes")

    def __init__(
        self,
        request_id: str,
        attempt_id: str,
        conn: NodeConnection,
        sink: RequestSink,
        nodes: NodeConnections,
        owner: str = "",
        trace: RequestTrace = NO_TRACE,
        hops: tuple[float, float, float] | tuple[()] = (),
    ) -> None:
        self.request_id = request_id  # the internal id (auth.internal_request_id)
        self.attempt_id = attempt_id  # what the node knows this submission by (common/attempts.py)
        self.owner = owner  # the API key name that started it ("" when keys are off)
        self.trace = trace
        self.node = conn.entry
        self.sink = sink
        self.ended = False  # set by the stream once every output finished: nothing left to cancel
        self.hops = hops  # monotonic times the request was opened, reserved and submitted (for its debug log)
        self._conn = conn
        self._nodes = nodes

    def cancel_output(self, output_index: int) -> None:
        self._nodes.cancel(self._conn, self.attempt_id, output_index)


class Requests:
    def __init__(
        self, frontend_id: str, coordinator: CoordinatorClient, nodes: NodeConnections, router: FallbackRouter
    ) -> None:
        self.frontend_id = frontend_id
        self.coordinator = coordinator
        self.nodes = nodes
        self.router = router
        self._attempt_ids = AttemptIds()
        self._open_ids: set[str] = set()  # internal ids open here: duplicates while the coordinator is away
        self._open = 0
        self._open_by_owner: dict[str, int] = {}  # per API key name, for its concurrency limit
        self._open_gauge = metrics.WORKER_IN_FLIGHT.labels(worker=frontend_id)
        self._open_gauge.set(0)
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def open_count(self) -> int:
        return self._open

    def open_count_of(self, owner: str) -> int:
        """Requests of one owner (API key name) open in this worker."""
        return self._open_by_owner.get(owner, 0)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is open, False when timeout_s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def fail_all(self, failure: LaneFailure) -> None:
        """Ends every open stream with `failure` (the drain deadline)."""
        self.nodes.fail_all(failure)

    def admit(self, owner: str) -> None:
        """Counts a request of `owner` against this worker's and its key's caps; the caller checks them first and
        calls `release` once, however the request ends. Generate admits as soon as the call is read, before any
        await (tokenizing, the guide's compile), so a burst cannot pass the caps while earlier ones compile."""
        self._open += 1
        self._open_by_owner[owner] = self._open_by_owner.get(owner, 0) + 1
        self._open_gauge.set(self._open)
        self._idle.clear()

    def release(self, owner: str) -> None:
        self._open -= 1
        if self._open_by_owner[owner] == 1:
            del self._open_by_owner[owner]
        else:
            self._open_by_owner[owner] -= 1
        self._open_gauge.set(self._open)
        if not self._open:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def open(
        self,
        plan: GenerationPlan,
        owner: str = "",
        share_weight: int = 1,
        trace: RequestTrace = NO_TRACE,
        admitted: bool = False,
    ) -> AsyncIterator[OpenRequest]:
        """`owner`: the API key name starting the request ("" when keys are off); the coordinator keeps it so that
        a user aborts only its own requests, and the engine shares its batch between owners by `share_weight`.
        `trace`: the call's span (request_trace.py). `admitted`: the caller already counted the request (`admit`)
        and releases it; else it is counted here, until the exit."""
        request_id = auth.internal_request_id(owner, plan.request_id)
        forwarded = trace_metadata(plan.metadata)  # the client's trace context, passed on while tracing is off
        opened_at = time.monotonic()
        if not admitted:
            self.admit(owner)
        try:
            try:
                node = await self._reserve(plan, request_id, trace, forwarded, owner)
            except asyncio.CancelledError:
                self.coordinator.release(request_id)  # the client left during Reserve, which may have gone through
                raise
            reserved_at = time.monotonic()
            attempt_id = self._attempt_ids.next(request_id)
            self.nodes.open_sink(attempt_id)  # before Submit: the first step may come back at once
            self._open_ids.add(request_id)
            conn = request = None
            try:
                try:
                    conn = await self.nodes.connect(node)
                    with trace.call(SUBMIT_SPAN, forwarded, **{"openengine.node_id": node.node_id}) as metadata:
                        await self.nodes.submit(
                            conn, engine_request(plan, attempt_id, self.frontend_id, owner, share_weight), metadata
                        )
                except (grpc.aio.AioRpcError, SubmitRefused, StreamBroken, ConnectionError, TimeoutError) as exc:
                    conn = None  # the node did not take the request: nothing to cancel
                    raise submit_refusal(exc, node, request_id) from None
                trace.event("queued", **{"openengine.node_id": node.node_id})
                request = OpenRequest(
                    request_id,
                    attempt_id,
                    conn,
                    self.nodes.sinks[attempt_id],
                    self.nodes,
                    owner,
                    trace,
                    (opened_at, reserved_at, time.monotonic()),
                )
                yield request
            finally:
                if conn is not None and not (request is not None and request.ended):
                    self.nodes.cancel(conn, attempt_id)  # the client went away or the stream failed: free the slot
                self.nodes.close_sink(attempt_id, node.node_id)
                self._open_ids.discard(request_id)
                self.coordinator.release(request_id)
        finally:
            if not admitted:
                self.release(owner)

    async def _reserve(
        self,
        plan: GenerationPlan,
        request_id: str,
        trace: RequestTrace,
        forwarded: tuple[tuple[str, str], ...],
        owner: str,
    ) -> cluster_pb2.NodeEntry:
        """The node for the request (`request_id`: its internal id): the coordinator's reservation (one span), else
        the fallback routing's."""
        metadata = plan.metadata
        try:
            with trace.call(RESERVE_SPAN, forwarded) as call_metadata:
                return await self.coordinator.reserve(
                    request_id,
                    metadata.routing_key,
                    metadata.target_rank,
                    len(plan.prompt_token_ids),
                    plan.num_sequences,
                    call_metadata,
                    owner,
                    plan.prefix_key,
                    plan.block_hashes,
                    plan.model_card,
                )
        except DuplicateRequest as exc:  # the coordinator's message names the frontend that holds the id
            log_event(logger, "duplicate request id", request_id=request_id, detail=exc.message)
            raise duplicate(plan) from None
        except CoordinatorUnreachable:
            trace.event("fallback_routing")
            # Duplicates are caught on this frontend only until the coordinator is back.
            if request_id in self._open_ids:
                raise duplicate(plan) from None
            return self.router.choose(
                [n for n in self.coordinator.ready_nodes() if not plan.model_card or n.model.name == plan.model_card],
                metadata.routing_key or plan.prefix_key,
                metadata.target_rank,
                self.nodes.in_flight,
            )


def duplicate(plan: GenerationPlan) -> DuplicateRequest:
    return DuplicateRequest(f"request_id {plan.request_id!r} is already in flight; use an id that is not in flight")


def submit_refusal(exc: Exception, node: cluster_pb2.NodeEntry, request_id: str) -> Refusal:
    """A node that did not take the request: full (retry later) or unreachable (retry). The node's own words
    name it and this frontend: they go to the log, the client is told the kind."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code, detail = exc.code(), exc.details()
    elif isinstance(exc, SubmitRefused):
        code, detail = exc.code, exc.message
    else:
        code, detail = None, repr(exc)
    log_event(
        logger,
        "node did not take the request",
        logging.WARNING,
        request_id=request_id,
        node_id=node.node_id,
        address=node.address,
        code=code.name if code else "-",
        detail=detail,
    )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded("the node chosen for the request is full; retry later")
    reason = code.name if code else type(exc).__name__
    return Unavailable(f"the node chosen for the request did not take it ({reason}); retry")


def engine_request(
    plan: GenerationPlan, request_id: str, frontend_id: str, owner: str = "", share_weight: int = 1
) -> cluster_pb2.EngineRequest:
    """The internal request a node runs (`request_id`: its attempt id), from the validated public one; `owner`: the
    API key name, `share_weight` its weight (the engine shares its batch fairly between owners)."""
    req = cluster_pb2.EngineRequest(
        request_id=request_id,
        frontend_id=frontend_id,
        owner=owner,
        share_weight=share_weight,
        prompt_token_ids=plan.prompt_token_ids,
        num_sequences=plan.num_sequences,
        max_tokens=plan.max_tokens,
        min_tokens=plan.min_tokens,
        stop_token_ids=plan.stop_token_ids,
        ignore_eos=plan.ignore_eos,
        priority=plan.metadata.priority,
        temperature=plan.temperature,
        top_p=plan.top_p,
        top_k=plan.top_k,
        min_p=plan.min_p,
        frequency_penalty=plan.frequency_penalty,
        presence_penalty=plan.presence_penalty,
        repetition_penalty=plan.repetition_penalty,
        seed=plan.seed or 0,
        has_seed=plan.seed is not None,
        output_logprobs=plan.output_logprobs,
        prompt_logprobs=plan.prompt_logprobs,
        prompt_logprob_start=plan.prompt_logprob_start,
        guide=plan.guide,
        bypass_prefix_cache=plan.bypass_prefix_cache,
        cache_salt=plan.cache_salt,
        lora_name=plan.lora_name,
        lora_path=plan.lora_path,
    )
    for target, selection in (
        (req.output_candidates, plan.output_candidates),
        (req.prompt_candidates, plan.prompt_candidates),
    ):
        if selection is None:
            continue
        if selection[0] == "top_n":
            target.top_n = selection[1]
        else:
            target.token_ids.extend(selection[1])
    return req


PREFIX_ROUTING_TOKENS = 64  # the prompt's first tokens that name its prefix for routing


def prefix_key(plan: GenerationPlan) -> str:
    """A name for the prompt's first tokens and cache salt: requests sharing them are routed to one node, where
    the prefix cache likely holds their KV. "" (no preference) with a routing key, when the request bypasses the
    cache, or for a prompt not longer than those tokens."""
    tokens = plan.prompt_token_ids
    if plan.metadata.routing_key or plan.bypass_prefix_cache or len(tokens) <= PREFIX_ROUTING_TOKENS:
        return ""
    head = struct.pack(f"<{PREFIX_ROUTING_TOKENS}I", *tokens[:PREFIX_ROUTING_TOKENS])
    return hashlib.blake2b(head + cache_namespace(plan.cache_salt, plan.lora_name).encode(), digest_size=8).hexdigest()


def trace_metadata(metadata: RequestMetadata) -> tuple[tuple[str, str], ...]:
    """W3C trace context passed on to the internal calls of the request."""
    if not metadata.traceparent:
        return ()
    pairs = (("traceparent", metadata.traceparent),)
    return pairs + ((("tracestate", metadata.tracestate),) if metadata.tracestate else ())


ROUTING_BLOCKS = 64  # the prompt's first KV blocks (1,024 tokens) whose hashes the coordinator routes by


def prefix_blocks(plan: GenerationPlan) -> list[bytes]:
    """The hashes of the prompt's first KV blocks (common/kv_blocks.py): the coordinator sends the request to the
    node whose prefix cache holds the longest run of them. None with a routing key or when the request bypasses
    the cache."""
    if plan.metadata.routing_key or plan.bypass_prefix_cache:
        return []
    namespace = cache_namespace(plan.cache_salt, plan.lora_name)
    return block_hashes(namespace, plan.prompt_token_ids[: ROUTING_BLOCKS * KV_BLOCK_SIZE])
