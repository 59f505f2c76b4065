"""`GetKvEventSources` and `SubscribeKvEvents`: the KV events of the deployment's nodes, relayed by a frontend.

Each ready node is one source, named by its rank (`data_parallel_rank`); its batches are numbered by the node
(node/kv_events.py) and carry its rank. A subscription reads the nodes ready when it starts (or the ranks it
names) and relays their batches as they come, interleaved; one that names no ranks also reads each node that
becomes ready later, from its snapshot (its first batch clears and lists every block it holds). When one node's
stream ends (the node left or restarted, or it no longer holds the `start_sequence_number` asked for), the call
ends with one EngineError naming it, and the subscriber subscribes again (with `include_snapshot` to rebuild its
view). The block hashes are common/kv_blocks.py's: a router computes a request's own and looks for them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc

from ..api.openengine.v1 import error_pb2, kv_pb2
from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from ..common.kv_blocks import HASH_ENCODING, KEPT_BATCHES
from .refusal import InvalidRequest

SCHEMA_VERSION = 1
RELAY_QUEUE = 64  # batches read from the nodes and not yet sent; a slow subscriber slows its node streams
NEW_NODES_S = 1.0  # a subscription without ranks looks for nodes that became ready this often


class KvEventRelay:
    def __init__(
        self,
        ready_nodes: Callable[[], list[cluster_pb2.NodeEntry]],
        open_channel: Callable[[str], grpc.aio.Channel],
        public_host: str,
        public_port: int,
    ) -> None:
        self._ready_nodes = ready_nodes
        self._open_channel = open_channel
        self._endpoint = kv_pb2.KvEndpoint(host=public_host, port=public_port, protocol="grpc")

    def sources(self, ranks: Sequence[int]) -> list[kv_pb2.KvEventSource]:
        return [
            kv_pb2.KvEventSource(
                transport="grpc",
                endpoint_addr=self._endpoint,
                topic="openengine.v1.Control/SubscribeKvEvents",
                data_parallel_rank=node.rank,
                encoding=HASH_ENCODING,
                schema_version=SCHEMA_VERSION,
                buffer_steps=KEPT_BATCHES,
            )
            for node in self._nodes(ranks, strict=False)
        ]

    def check(self, request: kv_pb2.SubscribeKvEventsRequest) -> list[cluster_pb2.NodeEntry]:
        """The nodes a subscription reads; raises InvalidRequest for a rank no ready node has."""
        return self._nodes(request.data_parallel_ranks, strict=True)

    async def subscribe(
        self, request: kv_pb2.SubscribeKvEventsRequest, nodes: list[cluster_pb2.NodeEntry]
    ) -> AsyncGenerator[kv_pb2.SubscribeKvEventsResponse, None]:
        relayed: asyncio.Queue[kv_pb2.SubscribeKvEventsResponse] = asyncio.Queue(RELAY_QUEUE)
        node_request = cluster_pb2.KvEventsRequest(
            include_snapshot=request.include_snapshot, start_sequence_number=request.start_sequence_number
        )
        readers = [asyncio.create_task(self._read(node, node_request, relayed)) for node in nodes]
        if not request.data_parallel_ranks:
            readers.append(asyncio.create_task(self._read_new_nodes({n.node_id for n in nodes}, readers, relayed)))
        try:
            while True:
                response = await relayed.get()
                yield response
                if response.HasField("error"):
                    return
        finally:
            for reader in readers:
                reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*readers, return_exceptions=True)

    async def _read_new_nodes(
        self,
        read: set[str],
        readers: list[asyncio.Task],
        relayed: asyncio.Queue[kv_pb2.SubscribeKvEventsResponse],
    ) -> None:
        """Adds a reader, from its snapshot, for each node that becomes ready after the subscription started."""
        snapshot = cluster_pb2.KvEventsRequest(include_snapshot=True)
        while True:
            await asyncio.sleep(NEW_NODES_S)
            for node in self._ready_nodes():
                if node.node_id not in read:
                    read.add(node.node_id)
                    readers.append(asyncio.create_task(self._read(node, snapshot, relayed)))

    async def _read(
        self,
        node: cluster_pb2.NodeEntry,
        node_request: cluster_pb2.KvEventsRequest,
        relayed: asyncio.Queue[kv_pb2.SubscribeKvEventsResponse],
    ) -> None:
        channel = self._open_channel(node.address)
        try:
            async for kv_batch in cluster_pb2_grpc.NodeStub(channel).KvEvents(node_request):
                await relayed.put(kv_pb2.SubscribeKvEventsResponse(batch=kv_batch))
            code: error_pb2.ErrorCode = error_pb2.ERROR_CODE_INTERNAL
            detail, retryable = "ended its KV event stream", True
        except grpc.aio.AioRpcError as exc:
            code, retryable = _error_code(exc.code())
            detail = f"ended its KV event stream: {exc.code().name}: {exc.details()}"
        finally:
            await channel.close()
        message = f"node rank {node.rank} ({node.node_id}) {detail}; subscribe again"
        await relayed.put(
            kv_pb2.SubscribeKvEventsResponse(
                error=error_pb2.EngineError(code=code, message=message, retryable=retryable)
            )
        )

    def _nodes(self, ranks: Sequence[int], strict: bool) -> list[cluster_pb2.NodeEntry]:
        nodes = sorted(self._ready_nodes(), key=lambda node: node.rank)
        if not ranks:
            return nodes
        unknown = sorted(set(ranks) - {node.rank for node in nodes})
        if unknown and strict:
            ready = ", ".join(str(node.rank) for node in nodes) or "none"
            raise InvalidRequest(
                f"data_parallel_ranks {unknown} name no ready node (ready ranks: {ready}; see GetKvEventSources)"
            )
        return [node for node in nodes if node.rank in set(ranks)]


def _error_code(code: grpc.StatusCode) -> tuple[error_pb2.ErrorCode, bool]:
    """A node's status as the subscriber's EngineError code, and whether subscribing again may succeed."""
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return error_pb2.ERROR_CODE_INVALID_ARGUMENT, False
    return error_pb2.ERROR_CODE_INTERNAL, True
