"""Which node's prefix cache holds which KV block, from the nodes' KV events (node/kv_events.py), and the node
holding the longest run of a request's first blocks (common/kv_blocks.py hashes chain each block to all before
it, so a run from the first block is a cached prefix). No I/O: `coordinator/kv_follow.py` feeds it.

A node's cache keeps a request's blocks only once the request has ended, so the blocks of a request just routed
count as on its node (`predict`) until its events say so, for at most PREDICTED_TTL_S: the next requests with
that prefix follow it there instead of spreading while the first one still runs, and a prompt that shares only
its first blocks with another (one preamble, then a document of its own) is told apart from it at once.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from ..api.openengine.v1 import kv_pb2
from ..common.kv_blocks import block_changes

PREDICTED_TTL_S = 60.0  # a routed request's blocks count as on its node this long, unless its events tell first
PREDICTED_KEPT = 1 << 16  # (node, block) predictions kept at most, the oldest dropped first


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}  # block hash -> node ids whose cache holds it
        self._blocks: dict[str, set[bytes]] = {}  # node id -> its blocks
        # (node id, block hash) -> when the prediction lapses, the oldest first; and block hash -> those node ids
        self._predicted: collections.OrderedDict[tuple[str, bytes], float] = collections.OrderedDict()
        self._predicted_holders: dict[bytes, set[str]] = {}
        self._predicted_on: collections.Counter[str] = collections.Counter()  # node id -> its predictions

    def blocks(self, node_id: str) -> int:
        """The blocks the node's events say its cache holds (predictions not counted)."""
        return len(self._blocks.get(node_id, ()))

    def held(self, node_id: str, now: float) -> int:
        """The distinct blocks the node holds or is predicted to hold: blocks that several prompts share count
        once, so this grows with the distinct prefixes the node's cache keeps."""
        self._lapse(now)
        return len(self._blocks.get(node_id, ())) + self._predicted_on[node_id]

    def apply(self, node_id: str, kv_batch: kv_pb2.KvEventBatch) -> None:
        held = self._blocks.setdefault(node_id, set())
        for change in block_changes(kv_batch.events):
            if not change.block:
                self._remove(node_id, held, list(held))
            elif change.stored:
                held.add(change.block)
                self._holders.setdefault(change.block, set()).add(node_id)
                self._unpredict(node_id, change.block)
            else:
                self._remove(node_id, held, (change.block,))

    def predict(self, node_id: str, hashes: Sequence[bytes], now: float) -> None:
        """A request with these first blocks was routed to the node: count them as there until `now` +
        PREDICTED_TTL_S (or until the node's events store them)."""
        held = self._blocks.get(node_id, set())
        for value in hashes:
            if value in held:
                continue
            key = (node_id, value)
            if key not in self._predicted:
                self._predicted_on[node_id] += 1
            self._predicted[key] = now + PREDICTED_TTL_S
            self._predicted.move_to_end(key)
            self._predicted_holders.setdefault(value, set()).add(node_id)
        while len(self._predicted) > PREDICTED_KEPT:
            self._unpredict(*next(iter(self._predicted)))

    def forget(self, node_id: str) -> None:
        """The node's events stopped (gone, or its stream broke): nothing of it is known any more."""
        held = self._blocks.pop(node_id, set())
        self._remove(node_id, held, list(held))
        for key in [key for key in self._predicted if key[0] == node_id]:
            self._unpredict(*key)

    def longest_runs(self, hashes: Sequence[bytes], now: float) -> tuple[set[str], int]:
        """The nodes holding (or predicted to hold) the longest run of `hashes` from the first, and its length
        (0: none holds the first)."""
        self._lapse(now)
        nodes: set[str] = set()
        for length, value in enumerate(hashes):
            holders = self._holders.get(value, set()) | self._predicted_holders.get(value, set())
            narrowed = holders if not length else nodes & holders
            if not narrowed:
                return nodes, length
            nodes = narrowed
        return nodes, len(hashes)

    def _lapse(self, now: float) -> None:
        while self._predicted:
            key, until = next(iter(self._predicted.items()))
            if until > now:
                return
            self._unpredict(*key)

    def _unpredict(self, node_id: str, value: bytes) -> None:
        if self._predicted.pop((node_id, value), None) is None:
            return
        self._predicted_on[node_id] -= 1
        if not self._predicted_on[node_id]:
            del self._predicted_on[node_id]
        holders = self._predicted_holders[value]
        holders.discard(node_id)
        if not holders:
            del self._predicted_holders[value]

    def _remove(self, node_id: str, held: set[bytes], values: Iterable[bytes]) -> None:
        for value in values:
            held.discard(value)
            holders = self._holders.get(value)
            if holders is not None:
                holders.discard(node_id)
                if not holders:
                    del self._holders[value]
