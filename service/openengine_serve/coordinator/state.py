"""The coordinator's soft state: node table, frontends, request-id ownership, routing.

Pure logic: no gRPC, no asyncio, no I/O. The gRPC service calls it from one
event loop, so nothing here locks. Time comes from an injectable monotonic clock.

Everything is rebuilt from re-registration after a coordinator restart: nodes
and frontends register again when a heartbeat answers `known=False`.
Limitation: the frontend heartbeat carries no request ids, so the reservations
of requests already in flight across a restart are lost. Until those requests
end, duplicate detection covers only ids reserved after the restart, an Abort
of an older id answers NOT_FOUND, and its Release is a no-op.

Reservations are dropped (and their ids remembered as finished) when:
- their node goes DOWN: the frontends see the node's result lane break and fail
  those requests themselves, so nothing on the coordinator would end them;
- their frontend expires or registers again (a restart): the client streams are
  gone and nobody is left to release them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.routing import rendezvous_pick

from .kv_index import KvIndex
from .load_index import LeastLoadedIndex

NodeState = cluster_pb2.NodeState
READY = cluster_pb2.NODE_STATE_READY
DOWN = cluster_pb2.NODE_STATE_DOWN
STARTING = cluster_pb2.NODE_STATE_STARTING

# Routing keys whose rendezvous node is remembered (until the READY set changes); beyond, the memory starts over.
# Each is kept as a digest of AFFINITY_DIGEST_BYTES, whatever the key's length (up to the metadata limit): the
# memory holds at most AFFINITY_MEMORY entries of about 200 bytes (digest object, dict slot, node reference),
# about 20 MB (docs/security.md).
AFFINITY_MEMORY = 100_000
AFFINITY_DIGEST_BYTES = 16

# A node's load figures alone (running, queued, tokens, batch size) reach a frontend's copy of the table at most this
# often; its state, limits and membership at its next heartbeat. The frontends use the figures only when no
# coordinator answers (GetLoad from the last known table), and with every node's load moving, sending them at each
# frontend heartbeat made every reply the whole table (ClusterState.node_table_since).
FRONTEND_LOAD_REFRESH_S = 10.0

# A DOWN node or an expired frontend is forgotten after this many expiry periods
# without a heartbeat; until then it keeps its rank / id and may come back.
FORGET_AFTER_EXPIRIES = 10

ROUTE_TARGET_RANK = "target_rank"
ROUTE_AFFINITY = "affinity"
ROUTE_PREFIX = "prefix"
ROUTE_KV_BLOCKS = "kv_blocks"
ROUTE_NEW_PREFIX = "new_prefix"
ROUTE_LEAST_LOADED = "least_loaded"

LookupResult = tuple[Literal["live", "finished", "unknown"], cluster_pb2.NodeEntry | None]


PREFIX_KEY_SPACE = "\0prefix:"  # prefix keys and routing keys share the affinity memory, never a key
PREFIX_LOAD_SLACK = 0.25  # a prefix's node may be this much busier (fraction of its batch) than the least loaded


class CoordinatorError(Exception):
    """A refusal; the message says what was wrong and what is allowed."""


class RankConflict(CoordinatorError):
    """A node asked for a rank that a different live node holds."""


class ModelMismatch(CoordinatorError):
    """A node serves a model under the name of a live node's model, with another tokenizer."""


class DuplicateRequest(CoordinatorError):
    """The request id is live somewhere in the deployment."""


class NoNodeAvailable(CoordinatorError):
    """No node is READY."""


class RankNotFound(CoordinatorError):
    """target_rank was given and no READY node has that rank."""


class DeploymentFull(CoordinatorError):
    """Every eligible READY node is at capacity."""


# The gRPC status code (grpc.StatusCode value) of each refusal, for the unary
# calls' abort and the batched outcomes alike; state.py imports no gRPC.
REFUSAL_STATUS: dict[type[CoordinatorError], int] = {
    DuplicateRequest: 6,  # ALREADY_EXISTS
    NoNodeAvailable: 14,  # UNAVAILABLE
    RankNotFound: 5,  # NOT_FOUND
    DeploymentFull: 8,  # RESOURCE_EXHAUSTED
    RankConflict: 6,  # ALREADY_EXISTS
    ModelMismatch: 9,  # FAILED_PRECONDITION
}


def state_label(state: int) -> str:
    """`NODE_STATE_READY` -> `ready` (metric labels, messages)."""
    return NodeState.Name(state).removeprefix("NODE_STATE_").lower()


@dataclasses.dataclass(slots=True)
class _Node:
    entry: cluster_pb2.NodeEntry
    last_heartbeat: float
    # Bumped on every load report; a reservation made in the current epoch is
    # not yet counted in entry.load, so it is counted in reserved_since_load.
    load_epoch: int = 0
    reserved_since_load: int = 0
    # The node table's version when this entry last changed, and when anything but its load figures last changed
    # (ClusterState.node_table_since).
    changed_at: int = 0
    structure_changed_at: int = 0
    request_ids: set[str] = dataclasses.field(default_factory=set)

    @property
    def is_live(self) -> bool:
        return self.entry.state != DOWN

    def in_flight(self) -> int:
        load = self.entry.load
        return load.running_requests + load.queued_requests + self.reserved_since_load

    def is_full(self) -> bool:
        load = self.entry.load
        capacity = load.max_running_requests + load.max_queued_requests
        # A node that never reported its limits (capacity 0) is not refused.
        return capacity > 0 and self.in_flight() >= capacity

    def serves(self, model: str) -> bool:
        """Serves the model card named `model` ("" any)."""
        return not model or self.entry.model.name == model

    def load_score(self) -> float:
        return self.in_flight() / max(1, self.entry.load.max_running_requests)


@dataclasses.dataclass(slots=True)
class _Frontend:
    address: str
    last_heartbeat: float
    # False for a frontend first seen through Reserve (after a coordinator
    # restart, before its heartbeat told it to register): heartbeats answer
    # known=False until it registers and tells its address.
    registered: bool
    expired: bool = False
    incarnation: str = ""  # the frontend process's, from its registration ("" unknown)
    reported_live_requests: int = 0
    request_ids: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(slots=True)
class TableCursor:
    """How far one frontend's copy of the node table is (one per heartbeat stream; ClusterState.node_table_since):
    every change up to `version` except load figures, which only up to `loads_version`, sent at `loads_at`."""

    version: int = -1  # -1: nothing yet
    loads_version: int = -1
    loads_at: float = float("-inf")


@dataclasses.dataclass(slots=True, frozen=True)
class _Reservation:
    frontend_id: str
    node_id: str
    reserved_at: float
    load_epoch: int
    owner: str = ""  # API key name that started it ("" when keys are off)


class ClusterState:
    """Node table, frontends, live request ids and the routing decision.

    Returned NodeEntry messages are copies: callers may keep or mutate them.
    """

    def __init__(
        self,
        *,
        now: Callable[[], float] = time.monotonic,
        node_expiry_s: float = 3.0,
        frontend_expiry_s: float = 3.0,
        finished_memory: int = 100_000,
        frontend_load_refresh_s: float = FRONTEND_LOAD_REFRESH_S,
        prefix_routing: str = "first-tokens",
    ) -> None:
        for name, value in (
            ("node_expiry_s", node_expiry_s),
            ("frontend_expiry_s", frontend_expiry_s),
            ("finished_memory", finished_memory),
            ("frontend_load_refresh_s", frontend_load_refresh_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self._now = now
        self._node_expiry_s = node_expiry_s
        self._frontend_expiry_s = frontend_expiry_s
        self._finished_memory = finished_memory
        self._frontend_load_refresh_s = frontend_load_refresh_s

        self._nodes: dict[str, _Node] = {}
        self._frontends: dict[str, _Frontend] = {}
        self._live: dict[str, _Reservation] = {}  # insertion order = reservation order
        # Ids in the order they finished; the oldest are forgotten first.
        self._finished: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> owner
        self._least_loaded = LeastLoadedIndex()
        self.kv_index = KvIndex()  # the nodes' cached KV blocks, fed by kv_follow.py
        self._prefix_routing = prefix_routing  # config.py: CoordinatorConfig.prefix_routing
        # The READY nodes, by rank, and the routing keys' rendezvous nodes: rebuilt when the READY set changes.
        self._ready_changes = 0
        self._ready_view_at = -1
        self._ready: list[_Node] = []
        self._ready_by_rank: dict[int, _Node] = {}
        self._several_models = False  # the READY nodes serve more than one model: requests go by their model
        self._affinity: dict[bytes, _Node] = {}  # by the routing key's digest
        # The node table's version: bumped at every change of an entry. Node ids by their last change (and by their
        # last change of anything but the load figures), oldest first, so the changes since a version are found
        # without a scan; removals only ask for the whole table.
        self._table_version = 0
        self._table_changed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._structure_changed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._table_removal_at = 0
        self._routing_decisions = dict.fromkeys(
            (ROUTE_TARGET_RANK, ROUTE_AFFINITY, ROUTE_KV_BLOCKS, ROUTE_NEW_PREFIX, ROUTE_PREFIX, ROUTE_LEAST_LOADED), 0
        )
        self._refusals = {"duplicate": 0, "no_node": 0, "rank_not_found": 0, "deployment_full": 0}

    # ------------------------------------------------------------------ nodes

    def register_node(self, entry: cluster_pb2.NodeEntry, rank_requested: int | None) -> cluster_pb2.NodeEntry:
        """Adds or replaces a node; returns its entry with the rank it got.

        `rank_requested=None` asks for the lowest rank no live node holds (a
        node registering again keeps its previous rank when still free);
        `entry.rank` is ignored. A node registering again while still in the
        table has restarted: its reservations are dropped.
        """
        node_id = entry.node_id
        if not node_id:
            raise ValueError("node_id must be non-empty")
        self._check_model(entry)
        holders = {n.entry.rank: nid for nid, n in self._nodes.items() if n.is_live and nid != node_id}
        if rank_requested is None:
            previous = self._nodes.get(node_id)
            if previous is not None and previous.entry.rank not in holders:
                rank = previous.entry.rank
            else:
                rank = next(r for r in range(len(holders) + 1) if r not in holders)
        else:
            rank = rank_requested
            if rank in holders:
                holder = self._nodes[holders[rank]]
                free = next(r for r in range(len(holders) + 1) if r not in holders)
                raise RankConflict(
                    f"rank {rank} is held by live node {holder.entry.node_id!r} "
                    f"({state_label(holder.entry.state)}); ask for a free rank "
                    f"(lowest free: {free}) or for automatic assignment"
                )
        # A DOWN node holding this rank is replaced: if it comes back, its
        # heartbeat answers known=False and it registers for a rank again.
        for stale_id in [nid for nid, n in self._nodes.items() if n.entry.rank == rank and nid != node_id]:
            self._forget_node(stale_id)
        if node_id in self._nodes:
            self._forget_node(node_id)

        stored = cluster_pb2.NodeEntry()
        stored.CopyFrom(entry)
        stored.rank = rank
        if stored.state == cluster_pb2.NODE_STATE_UNSPECIFIED:
            stored.state = STARTING
        node = self._nodes[node_id] = _Node(entry=stored, last_heartbeat=self._now())
        self._ready_changes += 1
        self._entry_changed(node)
        self._rescore(node)
        return _copy(stored)

    def _check_model(self, entry: cluster_pb2.NodeEntry) -> None:
        """Nodes may serve different models, told apart by name; frontends tokenize a model's requests with its
        nodes' tokenizer, so a node serving a model under a live node's model name with another tokenizer is
        refused until those are gone (a rollout of a new build under the same name replaces every node)."""
        model = entry.model
        for node_id, node in self._nodes.items():
            other = node.entry.model
            if (
                node.is_live
                and node_id != entry.node_id
                and other.name == model.name
                and other.tokenizer_digest != model.tokenizer_digest
            ):
                raise ModelMismatch(
                    f"node {entry.node_id!r} serves {model.name or 'no model'!r} ({model.engine or 'unknown'} "
                    f"engine, tokenizer {model.tokenizer_digest[:12] or 'none'}), but live node {node_id!r} serves "
                    f"a model of that name with another tokenizer ({other.engine} engine, tokenizer "
                    f"{other.tokenizer_digest[:12]}); give the new model a name of its own, or replace every node"
                )

    def node_heartbeat(self, node_id: str, state: NodeState, load: cluster_pb2.NodeLoad | None) -> bool:
        """Records a node's state and load; False for an unknown node (it must register).

        `state` UNSPECIFIED keeps the current state; `load=None` keeps the last load. The usual heartbeat
        changes nothing but the time (same state, same load, no reservation since the last one): it touches
        neither the node table's version nor the load index.
        """
        node = self._nodes.get(node_id)
        if node is None:
            return False
        node.last_heartbeat = self._now()
        rescore = False
        if load is not None:
            if node.entry.load != load:
                old = node.entry.load
                limits_changed = (
                    old.max_running_requests != load.max_running_requests
                    or old.max_queued_requests != load.max_queued_requests
                )
                old.CopyFrom(load)
                self._entry_changed(node, structural=limits_changed)
                rescore = True
            # The report counts the reservations made so far, whether or not the figures moved.
            node.load_epoch += 1
            if node.reserved_since_load:
                node.reserved_since_load = 0
                rescore = True
        if state != cluster_pb2.NODE_STATE_UNSPECIFIED and state != node.entry.state:
            self._set_node_state(node, state)  # rescores
        elif rescore:
            self._rescore(node)
        return True

    def node_entries(self) -> list[cluster_pb2.NodeEntry]:
        """The whole node table, DOWN nodes included, for the frontends' copy."""
        return [_copy(node.entry) for node in self._nodes.values()]

    def node_table_since(self, cursor: TableCursor) -> tuple[bool, list[cluster_pb2.NodeEntry]]:
        """What a frontend whose copy of the table is at `cursor` needs: (whole table?, entries), and moves the
        cursor to now. The whole table first and when a node left it since; else the entries that changed since,
        in O(changes): any change every `frontend_load_refresh_s`, in between all but load figures alone (an entry
        sent carries its current figures). The entries are the live ones, not copies: copy them (into a reply)
        at once.
        """
        now = self._now()
        if cursor.version < self._table_removal_at or cursor.version < 0:
            full, changed, with_loads = True, [node.entry for node in self._nodes.values()], True
        else:
            full, changed = False, []
            with_loads = now - cursor.loads_at >= self._frontend_load_refresh_s
            since = cursor.loads_version if with_loads else cursor.version
            for node_id in reversed(self._table_changed if with_loads else self._structure_changed):
                node = self._nodes[node_id]
                if (node.changed_at if with_loads else node.structure_changed_at) <= since:
                    break
                changed.append(node.entry)
            changed.reverse()
        if with_loads:
            cursor.loads_version, cursor.loads_at = self._table_version, now
        cursor.version = self._table_version
        return full, changed

    # -------------------------------------------------------------- frontends

    def register_frontend(self, frontend_id: str, address: str, incarnation: str = "") -> None:
        """Adds a frontend. One already registered has restarted, unless it names the same incarnation (it
        registers again after a failed heartbeat): a restarted one's reservations are dropped."""
        if not frontend_id:
            raise ValueError("frontend_id must be non-empty")
        frontend = self._frontends.get(frontend_id)
        if frontend is None:
            self._frontends[frontend_id] = _Frontend(
                address=address, last_heartbeat=self._now(), registered=True, incarnation=incarnation
            )
            return
        if frontend.registered and not (incarnation and incarnation == frontend.incarnation):
            self._drop_reservations(frontend.request_ids)
        # Adopted through Reserve (see _Frontend.registered): its reservations are its live requests.
        frontend.incarnation = incarnation
        frontend.address = address
        frontend.registered = True
        frontend.expired = False
        frontend.last_heartbeat = self._now()

    def frontend_heartbeat(self, frontend_id: str, live_requests: int) -> bool:
        """Records a frontend heartbeat; False when it must register (again)."""
        frontend = self._frontends.get(frontend_id)
        if frontend is None:
            return False
        self._touch_frontend(frontend)
        frontend.reported_live_requests = live_requests
        return frontend.registered

    # ----------------------------------------------------------------- expiry

    def expire(self) -> None:
        """Marks silent nodes DOWN and silent frontends expired; forgets long-silent ones.

        Called periodically by the service; cost O(nodes + frontends).
        """
        now = self._now()
        for node_id, node in list(self._nodes.items()):
            silent_s = now - node.last_heartbeat
            if silent_s > FORGET_AFTER_EXPIRIES * self._node_expiry_s:
                self._forget_node(node_id)
            elif silent_s > self._node_expiry_s:
                self._set_node_state(node, DOWN)
        for frontend_id, frontend in list(self._frontends.items()):
            silent_s = now - frontend.last_heartbeat
            if silent_s > self._frontend_expiry_s and not frontend.expired:
                frontend.expired = True
                self._drop_reservations(frontend.request_ids)
            if silent_s > FORGET_AFTER_EXPIRIES * self._frontend_expiry_s:
                del self._frontends[frontend_id]

    # ------------------------------------------------------- request ownership

    def reserve(self, request: cluster_pb2.ReserveRequest) -> cluster_pb2.NodeEntry:
        """Picks a node for the request and makes its id live deployment-wide.

        Raises DuplicateRequest, NoNodeAvailable, RankNotFound or DeploymentFull.
        Cost O(nodes).
        """
        request_id = request.request_id
        owner = self._live.get(request_id)
        if owner is not None:
            self._refusals["duplicate"] += 1
            raise DuplicateRequest(
                f"request id {request_id!r} is already in flight (owned by frontend "
                f"{owner.frontend_id!r}); use an id that is not in flight"
            )
        ready = self._ready_nodes()
        model = request.model
        if model and (self._several_models or (ready and ready[0].entry.model.name != model)):
            ready = [node for node in ready if node.serves(model)]
        else:
            model = ""  # the ready nodes serve one model, the request's: every rule's one-model path
        if not ready:
            self._refusals["no_node"] += 1
            wanted = f" serving {model!r}" if model else ""
            raise NoNodeAvailable(f"no node{wanted} is ready to take requests: {self._describe_nodes()}")

        now = self._now()
        node: _Node | None
        if request.HasField("target_rank"):
            node = self._pick_target_rank(ready, request.target_rank, model)
            reason = ROUTE_TARGET_RANK
        else:
            node = self._pick_by_affinity(ready, request.routing_key, model)
            reason = ROUTE_AFFINITY
            if node is None and self._prefix_routing == "kv-events":
                node = self._pick_by_blocks(request.block_hashes, now, model)
                reason = ROUTE_KV_BLOCKS
                if node is None and request.block_hashes:
                    node = self._pick_for_new_prefix(now, model)
                    reason = ROUTE_NEW_PREFIX
            if node is None and self._prefix_routing == "first-tokens":
                node = self._pick_by_prefix(ready, request.prefix_key, model)
                reason = ROUTE_PREFIX
            if node is None:
                node = self._pick_least_loaded(ready, model)
                reason = ROUTE_LEAST_LOADED

        frontend = self._frontends.get(request.frontend_id)
        if frontend is None:
            # Reserve before registration: the coordinator restarted and the
            # frontend has not heard known=False yet. Adopt it rather than fail.
            frontend = _Frontend(address="", last_heartbeat=now, registered=False)
            self._frontends[request.frontend_id] = frontend
        else:
            self._touch_frontend(frontend)

        node_id = node.entry.node_id
        if self._prefix_routing == "kv-events":
            self.kv_index.predict(node_id, request.block_hashes, now)
        self._live[request_id] = _Reservation(request.frontend_id, node_id, now, node.load_epoch, request.owner)
        self._finished.pop(request_id, None)  # an id may be reused once finished
        node.request_ids.add(request_id)
        node.reserved_since_load += 1
        self._rescore(node)
        frontend.request_ids.add(request_id)
        self._routing_decisions[reason] += 1
        return _copy(node.entry)

    def apply_batch(self, batch: cluster_pb2.ReservationBatch) -> list[cluster_pb2.ReservationOutcome]:
        """One frontend's batch: its releases first, then each reservation as `reserve` would take it.

        Returns one outcome per reservation, in order: the node, or the refusal's
        gRPC status code (REFUSAL_STATUS) and message.
        """
        self.apply_releases(batch)
        return [self.reservation_outcome(request, batch.frontend_id) for request in batch.reserve]

    def apply_releases(self, batch: cluster_pb2.ReservationBatch) -> None:
        for request_id in batch.release:
            self.release(request_id, batch.frontend_id)

    def reservation_outcome(
        self, request: cluster_pb2.ReserveRequest, frontend_id: str
    ) -> cluster_pb2.ReservationOutcome:
        """One reservation of a batch (whose entries leave frontend_id empty) as its outcome."""
        request.frontend_id = frontend_id
        try:
            return cluster_pb2.ReservationOutcome(node=self.reserve(request))
        except CoordinatorError as exc:
            return cluster_pb2.ReservationOutcome(refusal_code=REFUSAL_STATUS[type(exc)], refusal=str(exc))

    def release(self, request_id: str, frontend_id: str) -> bool:
        """Ends a reservation (finished, failed or cancelled) and remembers the id as finished.

        An unknown id, or one owned by another frontend, is left alone (False).
        """
        reservation = self._live.get(request_id)
        if reservation is None or reservation.frontend_id != frontend_id:
            return False
        self._end_reservation(request_id)
        return True

    def lookup(self, request_id: str, owner: str = "") -> LookupResult:
        """For Abort: ("live", node entry), ("finished", None) or ("unknown", None).

        With `owner` set, another owner's request is "unknown", so ids do not leak across API keys.
        """
        reservation = self._live.get(request_id)
        if reservation is not None and (not owner or reservation.owner == owner):
            return "live", _copy(self._nodes[reservation.node_id].entry)
        if request_id in self._finished and (not owner or self._finished[request_id] == owner):
            return "finished", None
        return "unknown", None

    def live_requests(self) -> list[tuple[str, cluster_pb2.NodeEntry]]:
        """Every live request id with its node entry, for abort-all."""
        entries = {node_id: _copy(node.entry) for node_id, node in self._nodes.items() if node.request_ids}
        return [(request_id, entries[r.node_id]) for request_id, r in self._live.items()]

    # ---------------------------------------------------------------- reports

    def cluster_load(self) -> cluster_pb2.ClusterLoad:
        return cluster_pb2.ClusterLoad(
            nodes=[node.entry for node in self._nodes.values()],  # the constructor copies
            live_reservations=len(self._live),
        )

    def snapshot(self) -> dict[str, Any]:
        """Plain counters and gauges for metrics."""
        nodes_by_state = {state_label(s): 0 for s in NodeState.values() if s != cluster_pb2.NODE_STATE_UNSPECIFIED}
        for node in self._nodes.values():
            nodes_by_state[state_label(node.entry.state)] += 1
        frontends_by_state = {"live": 0, "expired": 0}
        for frontend in self._frontends.values():
            frontends_by_state["expired" if frontend.expired else "live"] += 1
        oldest = next(iter(self._live.values()), None)
        return {
            "routing_decisions": dict(self._routing_decisions),
            "refusals": dict(self._refusals),
            "live_reservations": len(self._live),
            # Grows without bound when a frontend leaks reservations (never releases).
            "oldest_reservation_age_s": self._now() - oldest.reserved_at if oldest else 0.0,
            "nodes_by_state": nodes_by_state,
            "frontends_by_state": frontends_by_state,
            "frontend_reported_live_requests": sum(f.reported_live_requests for f in self._frontends.values()),
            "finished_remembered": len(self._finished),
        }

    # ---------------------------------------------------------------- routing

    def _ready_nodes(self) -> list[_Node]:
        if self._ready_view_at != self._ready_changes:
            self._ready = [node for node in self._nodes.values() if node.entry.state == READY]
            self._ready_by_rank = {node.entry.rank: node for node in self._ready}
            self._several_models = len({node.entry.model.name for node in self._ready}) > 1
            self._affinity.clear()
            self._ready_view_at = self._ready_changes
        return self._ready

    def _pick_target_rank(self, ready: list[_Node], rank: int, model: str = "") -> _Node:
        node = self._ready_by_rank.get(rank)
        if node is not None and model and node.entry.model.name != model:
            self._refusals["rank_not_found"] += 1
            raise RankNotFound(
                f"rank {rank} serves model {node.entry.model.name!r}; ready ranks of this model: "
                f"{sorted(n.entry.rank for n in ready)}"
            )
        if node is None:
            self._refusals["rank_not_found"] += 1
            not_ready = next((n for n in self._nodes.values() if n.entry.rank == rank), None)
            detail = f" (rank {rank} is {state_label(not_ready.entry.state)})" if not_ready else ""
            raise RankNotFound(
                f"no ready node has rank {rank}{detail}; ready ranks: {sorted(n.entry.rank for n in ready)}"
            )
        if node.is_full():
            self._refusals["deployment_full"] += 1
            raise DeploymentFull(f"node rank {rank} is at capacity ({self._describe_capacity(node)}); retry later")
        return node

    def _pick_by_affinity(self, ready: list[_Node], routing_key: str, model: str = "") -> _Node | None:
        """The key's node by the shared routing rule (rendezvous hashing over the READY nodes,
        common/routing.py), or None without a key or when that node is full.

        A full node keeps the key: this request overflows to the least loaded
        node and the key's next requests return once it has room. A node that is
        no longer READY drops out of the hash, so its keys spread over the
        others and come back when it is READY again.
        """
        if not routing_key:
            return None
        scoped = f"{model}\0{routing_key}" if model else routing_key  # `ready` holds that model's nodes only
        digest = hashlib.blake2b(scoped.encode(), digest_size=AFFINITY_DIGEST_BYTES).digest()
        node = self._affinity.get(digest)
        if node is None:  # O(ready nodes) hashes: remembered until the READY set changes
            if len(self._affinity) >= AFFINITY_MEMORY:
                self._affinity.clear()
            node = self._affinity[digest] = rendezvous_pick(routing_key, ready, _node_id)
        return None if node.is_full() else node

    def _pick_by_blocks(self, hashes: Sequence[bytes], now: float, model: str = "") -> _Node | None:
        """Of the READY nodes with room whose prefix cache holds the longest run of the prompt's first KV blocks
        (by their KV events and the requests just routed, kv_index.py), the one the run's last block names by
        rendezvous hashing, unless it is too busy (`_within_slack`): then the least loaded of them, if it is not.
        None then, or when that run is not more than half the blocks looked at (a run of the chat template's
        first block alone, which every node soon holds, must not pull every new prompt to one node).

        The hash keeps a prefix that two nodes hold (one took an overflow) on one of them, so the other's copy
        ages out of its cache instead of both caches spending room on it."""
        if not hashes:
            return None
        node_ids, length = self.kv_index.longest_runs(hashes, now)
        if length * 2 <= len(hashes):
            return None
        nodes = [node for node_id in node_ids if (node := self._available(node_id)) is not None and node.serves(model)]
        if not nodes:
            return None
        named = rendezvous_pick(hashes[length - 1].hex(), nodes, _node_id)
        return self._within_slack(named, model) or self._within_slack(min(nodes, key=_Node.load_score), model)

    def _pick_for_new_prefix(self, now: float, model: str = "") -> _Node | None:
        """For a prompt whose prefix no node holds: the READY node with room whose cache holds the fewest distinct
        blocks (so the fewest distinct prefixes: each node keeps an even share of them, which its cache can hold,
        instead of the share that the instantaneous load happens to give), the least loaded among equals, unless
        it is too busy (`_within_slack`); None then."""
        nodes = self._with_room(model)
        if not nodes:
            return None
        return self._within_slack(
            min(nodes, key=lambda node: (self.kv_index.held(_node_id(node), now), node.load_score())), model
        )

    def _pick_by_prefix(self, ready: list[_Node], prefix_key: str, model: str = "") -> _Node | None:
        """The node the routing rule names for the prompt's first tokens (consistent hashing: where its KV is
        likely cached, or soon will be), unless it is too busy (`_within_slack`); None then, or without a key."""
        node = self._pick_by_affinity(ready, PREFIX_KEY_SPACE + prefix_key, model) if prefix_key else None
        return None if node is None else self._within_slack(node, model)

    def _available(self, node_id: str) -> _Node | None:
        """The node if it is READY and has room for another request."""
        node = self._nodes.get(node_id)
        return node if node is not None and node.entry.state == READY and not node.is_full() else None

    def _within_slack(self, node: _Node, model: str = "") -> _Node | None:
        """`node`, unless its load score is more than PREFIX_LOAD_SLACK above the least loaded node's of its model
        (bounded loads: a popular prefix does not pile onto one node)."""
        least = self._least_loaded_of(model)
        if least is None or node.load_score() > least.load_score() + PREFIX_LOAD_SLACK:
            return None
        return node

    def _least_loaded_of(self, model: str) -> _Node | None:
        """The READY node with room with the lowest load score (of `model`'s nodes; "" any)."""
        if not model:  # the load index (load_index.py) holds exactly the READY nodes with room, by score
            node_id = self._least_loaded.least_loaded()
            return None if node_id is None else self._nodes[node_id]
        nodes = self._with_room(model)
        return min(nodes, key=_Node.load_score) if nodes else None

    def _with_room(self, model: str) -> list[_Node]:
        """The READY nodes with room for another request (of `model`'s nodes; "" any)."""
        return [node for node in self._ready_nodes() if not node.is_full() and node.serves(model)]

    def _pick_least_loaded(self, ready: list[_Node], model: str = "") -> _Node:
        # One model: the load index, whose ties take turns. Several: the least loaded of the model's nodes.
        least = self._least_loaded_of(model)
        node_id = None if least is None else least.entry.node_id
        if node_id is None:
            self._refusals["deployment_full"] += 1
            raise DeploymentFull(
                "every ready node is at capacity: "
                + ", ".join(f"rank {n.entry.rank} {self._describe_capacity(n)}" for n in ready)
                + "; retry later"
            )
        self._least_loaded.picked(node_id)
        return self._nodes[node_id]

    # -------------------------------------------------------------- internals

    def _set_node_state(self, node: _Node, state: NodeState) -> None:
        if state == node.entry.state:
            return
        if state == DOWN:
            self._drop_reservations(node.request_ids)
        if (state == READY) != (node.entry.state == READY):
            self._ready_changes += 1
        node.entry.state = state
        self._entry_changed(node)
        self._rescore(node)

    def _entry_changed(self, node: _Node, structural: bool = True) -> None:
        """`structural`: more than the load figures changed (see FRONTEND_LOAD_REFRESH_S)."""
        self._table_version += 1
        node.changed_at = self._table_version
        self._table_changed[node.entry.node_id] = None
        self._table_changed.move_to_end(node.entry.node_id)
        if structural:
            node.structure_changed_at = self._table_version
            self._structure_changed[node.entry.node_id] = None
            self._structure_changed.move_to_end(node.entry.node_id)

    def _rescore(self, node: _Node) -> None:
        """Tells the load index the node's score (or that it cannot take a request): after any change of its
        state, load, limits or reservations."""
        eligible = node.entry.state == READY and not node.is_full()
        self._least_loaded.update(node.entry.node_id, node.load_score() if eligible else None)

    def _forget_node(self, node_id: str) -> None:
        node = self._nodes.pop(node_id)
        self._ready_changes += 1
        self._table_changed.pop(node_id, None)
        self._structure_changed.pop(node_id, None)
        self._table_version += 1
        self._table_removal_at = self._table_version
        self._least_loaded.forget(node_id)
        self._drop_reservations(node.request_ids)

    def _touch_frontend(self, frontend: _Frontend) -> None:
        frontend.last_heartbeat = self._now()
        frontend.expired = False

    def _drop_reservations(self, request_ids: set[str]) -> None:
        # Copy: _end_reservation removes each id from the very set being iterated.
        for request_id in list(request_ids):
            self._end_reservation(request_id)

    def _end_reservation(self, request_id: str) -> None:
        reservation = self._live.pop(request_id)
        node = self._nodes.get(reservation.node_id)
        if node is not None:
            node.request_ids.discard(request_id)
            if reservation.load_epoch == node.load_epoch:
                node.reserved_since_load -= 1
                self._rescore(node)
        frontend = self._frontends.get(reservation.frontend_id)
        if frontend is not None:
            frontend.request_ids.discard(request_id)
        self._finished[request_id] = reservation.owner
        if len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)

    def _describe_nodes(self) -> str:
        if not self._nodes:
            return "no node is registered"
        counts = collections.Counter(state_label(n.entry.state) for n in self._nodes.values())
        return f"{len(self._nodes)} known (" + ", ".join(f"{c} {s}" for s, c in sorted(counts.items())) + ")"

    @staticmethod
    def _describe_capacity(node: _Node) -> str:
        load = node.entry.load
        return f"{node.in_flight()}/{load.max_running_requests + load.max_queued_requests} in flight"


def _node_id(node: _Node) -> str:
    return node.entry.node_id


def _copy(entry: cluster_pb2.NodeEntry) -> cluster_pb2.NodeEntry:
    copy = cluster_pb2.NodeEntry()
    copy.CopyFrom(entry)
    return copy
