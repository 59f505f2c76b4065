"""Which node's prefix cache holds which KV block, from the nodes' KV events (node/kv_events.py), and the node
holding the longest run of a request's first blocks (common/kv_blocks.py hashes chain each block to all before
it, so a run from the first block is a cached prefix). No I/O: `coordinator/kv_follow.py` feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..api.openengine.v1 import kv_pb2
from ..common.kv_blocks import block_changes


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}  # block hash -> node ids whose cache holds it
        self._blocks: dict[str, set[bytes]] = {}  # node id -> its blocks

    def blocks(self, node_id: str) -> int:
        return len(self._blocks.get(node_id, ()))

    def apply(self, node_id: str, kv_batch: kv_pb2.KvEventBatch) -> None:
        held = self._blocks.setdefault(node_id, set())
        for change in block_changes(kv_batch.events):
            if not change.block:
                self._remove(node_id, held, list(held))
            elif change.stored:
                held.add(change.block)
                self._holders.setdefault(change.block, set()).add(node_id)
            else:
                self._remove(node_id, held, (change.block,))

    def forget(self, node_id: str) -> None:
        """The node's events stopped (gone, or its stream broke): nothing of it is known any more."""
        held = self._blocks.pop(node_id, set())
        self._remove(node_id, held, list(held))

    def longest_runs(self, hashes: Sequence[bytes]) -> tuple[set[str], int]:
        """The nodes holding the longest run of `hashes` from the first, and its length (0: none holds the first)."""
        nodes: set[str] = set()
        for length, value in enumerate(hashes):
            holders = self._holders.get(value)
            if not holders:
                return nodes, length
            narrowed = holders if not length else nodes & holders
            if not narrowed:
                return nodes, length
            nodes = set(narrowed)
        return nodes, len(hashes)

    def _remove(self, node_id: str, held: set[bytes], values: Iterable[bytes]) -> None:
        for value in values:
            held.discard(value)
            holders = self._holders.get(value)
            if holders is not None:
                holders.discard(node_id)
                if not holders:
                    del self._holders[value]
