"""Where a request goes while the coordinator cannot be reached: the frontend routes from its last known
node table by the same rules the coordinator applies (target rank, the shared routing-key rule, else the
node this frontend sends the fewest requests to). Duplicate ids are then caught on this frontend only."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from ..api.openengine_internal.v1 import cluster_pb2
from ..common.routing import rendezvous_pick
from .refusal import NotServed, Unavailable


class FallbackRouter:
    def __init__(self) -> None:
        self._round_robin = itertools.count()

    def choose(
        self,
        ready: list[cluster_pb2.NodeEntry],
        routing_key: str,
        target_rank: int | None,
        in_flight: Callable[[str], int],
    ) -> cluster_pb2.NodeEntry:
        """The node for a request among the READY ones; `in_flight(node_id)` is this frontend's open requests
        on that node. Raises NotServed (no ready node has target_rank) or Unavailable (no ready node)."""
        if target_rank is not None:
            ready = [n for n in ready if n.rank == target_rank]
            if not ready:
                raise NotServed(f"openengine-target-dp-rank {target_rank} names no ready node")
        if not ready:
            raise Unavailable("no ready node is known and the coordinator is unreachable")
        if routing_key:
            return rendezvous_pick(routing_key, ready, _node_id)
        ready = sorted(ready, key=lambda n: n.rank)
        load = {n.node_id: in_flight(n.node_id) for n in ready}
        least = min(load.values())
        candidates = [n for n in ready if load[n.node_id] == least]
        return candidates[next(self._round_robin) % len(candidates)]


def _node_id(entry: cluster_pb2.NodeEntry) -> str:
    return entry.node_id
