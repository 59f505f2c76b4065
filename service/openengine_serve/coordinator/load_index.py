"""The least loaded node in O(log nodes): a heap of load scores, updated whenever a node's score changes.

A scan over every node per reservation would make each request cost the
coordinator O(nodes). Here each change pushes the node's new entry (stale entries are
skipped when they reach the top and compacted away when they pile up), and
the pick looks at the top. Ties go to the node picked longest ago, so equally
idle nodes take turns. Pure data structure: the caller says which nodes are
eligible (READY with room) and what their scores are.
"""

from __future__ import annotations

import heapq
import itertools


class LeastLoadedIndex:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, str]] = []  # (score, last picked, version, node id)
        self._current: dict[str, tuple[float, int, int]] = {}  # node id -> its live entry's (score, picked, version)
        self._last_picked: dict[str, int] = {}
        self._versions = itertools.count(1)

    def __len__(self) -> int:
        return len(self._current)

    def update(self, node_id: str, score: float | None) -> None:
        """The node's score now; None takes it out (not READY, or full) until its next update."""
        if score is None:
            self._current.pop(node_id, None)
            return
        picked = self._last_picked.get(node_id, 0)
        current = self._current.get(node_id)
        if current is not None and current[0] == score and current[1] == picked:
            return  # its live entry already says so: nothing to push
        entry = (score, picked, next(self._versions))
        self._current[node_id] = entry
        heapq.heappush(self._heap, (*entry, node_id))
        if len(self._heap) > 2 * len(self._current) + 64:
            self._compact()

    def forget(self, node_id: str) -> None:
        self._current.pop(node_id, None)
        self._last_picked.pop(node_id, None)

    def least_loaded(self) -> str | None:
        """The eligible node with the lowest score (ties: picked longest ago), or None when there is none."""
        heap = self._heap
        while heap:
            score, picked, version, node_id = heap[0]
            if self._current.get(node_id) == (score, picked, version):
                return node_id
            heapq.heappop(heap)
        return None

    def picked(self, node_id: str) -> None:
        """Records the pick; the caller then updates the node's score (which carries the new turn)."""
        self._last_picked[node_id] = next(self._versions)

    def _compact(self) -> None:
        self._heap = [(*entry, node_id) for node_id, entry in self._current.items()]
        heapq.heapify(self._heap)
