"""The routing rule for requests that carry a routing key, shared by the coordinator and the frontend.

Rendezvous (highest-random-weight) hashing: every node gets a weight from a
hash of (node id, routing key) and the key goes to the ready node with the
highest weight. The coordinator and a frontend routing on its own during a
coordinator outage pick the same node from the same node table, nothing needs
to be remembered per key, and a node joining or leaving moves only the keys
whose highest weight it holds (a key comes back when its node does).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

Node = TypeVar("Node")


def rendezvous_weight(routing_key: str, node_id: str) -> int:
    """A stable 64-bit weight (the same in every process, unlike `hash`)."""
    digest = hashlib.blake2b(f"{node_id}\0{routing_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_pick(routing_key: str, nodes: Sequence[Node], node_id: Callable[[Node], str]) -> Node:
    """The node with the highest weight for the key; ties (never seen in practice) go to the larger id."""
    if not nodes:
        raise ValueError("rendezvous_pick needs at least one node")
    return max(nodes, key=lambda node: (rendezvous_weight(routing_key, node_id(node)), node_id(node)))


def owning_coordinator(request_id: str, coordinators: Sequence[str]) -> str:
    """The coordinator (address, as configured) that owns a request id when several share the deployment: the
    same rendezvous rule over the addresses, so every frontend listing the same addresses (in any order) agrees,
    and adding or removing one coordinator moves only the ids it gains or loses."""
    if len(coordinators) == 1:
        return coordinators[0]
    return rendezvous_pick(request_id, coordinators, str)
