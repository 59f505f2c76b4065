"""The coordinator follows every READY node's KV events (`Node.KvEvents`, from a snapshot) into its KvIndex, which
routes a request to the node whose prefix cache holds the longest run of its prompt's first blocks
(state.py : ClusterState._pick_by_blocks). Nodes whose engine has no prefix cache are not followed; a stream that
breaks is opened again (a new snapshot) while the node stays READY, and its blocks are forgotten meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from ..common.logging_setup import log_event
from .state import READY, ClusterState

logger = logging.getLogger("openengine_serve.coordinator")

RECONCILE_S = 1.0  # how often the followed nodes are matched to the READY ones
RETRY_S = 1.0  # after a broken stream


class KvFollower:
    def __init__(self, state: ClusterState, open_channel: Callable[[str], grpc.aio.Channel]) -> None:
        self._state = state
        self._open_channel = open_channel
        self._followed: dict[str, tuple[str, asyncio.Task]] = {}  # node id -> (address, its task)

    async def run(self) -> None:
        try:
            while True:
                self._reconcile()
                await asyncio.sleep(RECONCILE_S)
        finally:
            for node_id in list(self._followed):
                await self._stop(node_id)

    def _reconcile(self) -> None:
        wanted = {
            entry.node_id: entry.address
            for entry in self._state.node_entries()
            if entry.state == READY and entry.model.prefix_cache
        }
        for node_id, (address, task) in list(self._followed.items()):
            if wanted.get(node_id) != address:
                task.cancel()
                del self._followed[node_id]
                self._state.kv_index.forget(node_id)
        for node_id, address in wanted.items():
            if node_id not in self._followed:
                self._followed[node_id] = (address, asyncio.create_task(self._follow(node_id, address)))

    async def _stop(self, node_id: str) -> None:
        _, task = self._followed.pop(node_id)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _follow(self, node_id: str, address: str) -> None:
        index = self._state.kv_index
        channel = self._open_channel(address)
        request = cluster_pb2.KvEventsRequest(include_snapshot=True)
        try:
            while True:
                try:
                    async for kv_batch in cluster_pb2_grpc.NodeStub(channel).KvEvents(request):
                        index.apply(node_id, kv_batch)
                except grpc.aio.AioRpcError as exc:
                    log_event(
                        logger,
                        "node KV events broken",
                        logging.WARNING,
                        node_id=node_id,
                        code=exc.code().name,
                        detail=exc.details(),
                    )
                index.forget(node_id)
                await asyncio.sleep(RETRY_S)
        finally:
            index.forget(node_id)
            await channel.close()
