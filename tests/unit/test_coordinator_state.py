"""ClusterState: routing, request-id ownership, expiry; driven by a fake clock."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.routing import rendezvous_pick
from openengine_serve.coordinator.kv_index import PREDICTED_TTL_S
from openengine_serve.coordinator.state import (
    FRONTEND_LOAD_REFRESH_S,
    ClusterState,
    DeploymentFull,
    DuplicateRequest,
    ModelMismatch,
    NoNodeAvailable,
    RankConflict,
    RankNotFound,
    TableCursor,
)

READY = cluster_pb2.NODE_STATE_READY
DOWN = cluster_pb2.NODE_STATE_DOWN
DRAINING = cluster_pb2.NODE_STATE_DRAINING
STARTING = cluster_pb2.NODE_STATE_STARTING


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state(clock: FakeClock) -> ClusterState:
    return ClusterState(now=clock, node_expiry_s=3.0, frontend_expiry_s=3.0, finished_memory=4)


def load(running: int = 0, queued: int = 0, max_running: int = 8, max_queued: int = 8) -> cluster_pb2.NodeLoad:
    return cluster_pb2.NodeLoad(
        running_requests=running,
        queued_requests=queued,
        max_running_requests=max_running,
        max_queued_requests=max_queued,
    )


def add_node(state: ClusterState, node_id: str, rank: int | None = None, *, ready: bool = True, **limits) -> int:
    entry = cluster_pb2.NodeEntry(node_id=node_id, address=f"{node_id}:50051", load=load(**limits))
    rank = state.register_node(entry, rank).rank
    if ready:
        assert state.node_heartbeat(node_id, READY, None)
    return rank


def reserve(state: ClusterState, request_id: str, frontend: str = "fe-1", **fields) -> str:
    return state.reserve(cluster_pb2.ReserveRequest(request_id=request_id, frontend_id=frontend, **fields)).node_id


# ------------------------------------------------------------------ routing


def test_least_loaded_spreads_over_two_idle_nodes(state: ClusterState) -> None:
    add_node(state, "a")
    add_node(state, "b")
    placed = collections.Counter(reserve(state, f"r{i}") for i in range(10))
    assert placed == {"a": 5, "b": 5}
    assert state.snapshot()["routing_decisions"]["least_loaded"] == 10


def test_ties_after_a_load_report_are_broken_round_robin(state: ClusterState) -> None:
    add_node(state, "a")
    add_node(state, "b")
    placed = []
    for i in range(4):
        placed.append(reserve(state, f"r{i}"))
        state.release(f"r{i}", "fe-1")
        # Each heartbeat resets the pending counts: both nodes look idle again.
        state.node_heartbeat("a", READY, load())
        state.node_heartbeat("b", READY, load())
    assert set(placed) == {"a", "b"}


def test_least_loaded_prefers_lower_normalized_load(state: ClusterState) -> None:
    add_node(state, "small", running=2, max_running=4)  # 50% busy
    add_node(state, "big", running=6, max_running=16)  # 37.5% busy
    assert reserve(state, "r1") == "big"


# Worked out from the rule (common/routing.py): a key goes to the node whose big-endian BLAKE2b-64 digest of
# "<node id>\0<key>" is highest. Among a, b, c: user-5 and user-11 go to a, user-3 and user-10 to c, the others
# to b; key-0 goes to a, and to b once a is gone.
RENDEZVOUS_ABC = {f"user-{i}": "b" for i in range(12)} | {"user-5": "a", "user-11": "a", "user-3": "c", "user-10": "c"}


def test_a_routing_key_always_lands_on_its_rendezvous_node(state: ClusterState) -> None:
    for node_id in ("a", "b", "c"):
        add_node(state, node_id)
    for i, (key, node_id) in enumerate(RENDEZVOUS_ABC.items()):
        assert reserve(state, f"r{i}", routing_key=key) == node_id
        assert reserve(state, f"again{i}", routing_key=key) == node_id
    assert state.snapshot()["routing_decisions"] == {
        "target_rank": 0,
        "affinity": 24,
        "kv_blocks": 0,
        "new_prefix": 0,
        "prefix": 0,
        "least_loaded": 0,
    }


def test_a_key_leaves_a_node_that_is_not_ready_and_comes_back(state: ClusterState) -> None:
    for node_id in ("a", "b", "c"):
        add_node(state, node_id)
    assert reserve(state, "r0", routing_key="key-0") == "a"
    state.node_heartbeat("a", DRAINING, None)
    assert reserve(state, "r1", routing_key="key-0") == "b"
    assert reserve(state, "r1c", routing_key="user-3") == "c", "only the keys of the node that left move"
    state.node_heartbeat("a", READY, load())
    assert reserve(state, "r2", routing_key="key-0") == "a"


def test_a_key_overflows_from_its_full_node_and_returns(state: ClusterState) -> None:
    add_node(state, "a", max_running=1, max_queued=0)
    add_node(state, "b", running=1, max_running=10, max_queued=0)  # busier in score, has room
    key = "key-0"  # a's among a and b (see RENDEZVOUS_ABC)
    assert reserve(state, "r0", routing_key=key) == "a"
    assert reserve(state, "r1", routing_key=key) == "b"  # a is full: overflow to the least loaded
    assert state.snapshot()["routing_decisions"] == {
        "target_rank": 0,
        "affinity": 1,
        "kv_blocks": 0,
        "new_prefix": 0,
        "prefix": 0,
        "least_loaded": 1,
    }
    state.release("r0", "fe-1")
    assert reserve(state, "r2", routing_key=key) == "a"


@pytest.mark.parametrize(
    ("target_rank", "expected"),
    [(0, "n0"), (1, "n1"), (2, "n2")],
)
def test_target_rank_picks_that_node(state: ClusterState, target_rank: int, expected: str) -> None:
    for i in range(3):
        add_node(state, f"n{i}", i)
    # Load on the target does not matter, affinity neither.
    state.node_heartbeat(expected, READY, load(running=7))
    assert reserve(state, "r", target_rank=target_rank, routing_key="k") == expected
    assert state.snapshot()["routing_decisions"]["target_rank"] == 1


def test_target_rank_not_ready_lists_ready_ranks(state: ClusterState) -> None:
    add_node(state, "n0", 0)
    add_node(state, "n1", 1)
    add_node(state, "n5", 5, ready=False)
    with pytest.raises(RankNotFound, match=r"rank 5 is starting.*ready ranks: \[0, 1\]"):
        reserve(state, "r", target_rank=5)
    with pytest.raises(RankNotFound, match=r"no ready node has rank 9; ready ranks: \[0, 1\]"):
        reserve(state, "r", target_rank=9)


# -------------------------------------------------------------------- ranks


def test_rank_auto_assignment_takes_the_lowest_free_rank(state: ClusterState) -> None:
    assert add_node(state, "a") == 0
    assert add_node(state, "b", 2) == 2
    assert add_node(state, "c") == 1
    assert add_node(state, "d") == 3
    # A node registering again keeps its rank.
    assert add_node(state, "b") == 2


def test_rank_of_a_down_node_is_reused(state: ClusterState) -> None:
    add_node(state, "a")
    add_node(state, "b")
    state.node_heartbeat("a", DOWN, None)
    assert add_node(state, "c") == 0
    # The replaced node is forgotten: its next heartbeat asks it to register again.
    assert state.node_heartbeat("a", READY, load()) is False


def test_requested_rank_held_by_another_live_node_conflicts(state: ClusterState) -> None:
    add_node(state, "a", 0)
    add_node(state, "b", 1)
    with pytest.raises(RankConflict, match=r"rank 1 is held by live node 'b' \(ready\).*lowest free: 2"):
        add_node(state, "c", 1)
    # The same node asking for its own rank again is not a conflict.
    assert add_node(state, "b", 1) == 1


# ------------------------------------------------------- request ownership


@pytest.mark.parametrize("second_frontend", ["fe-1", "fe-2"])
def test_duplicate_live_id_is_refused(state: ClusterState, second_frontend: str) -> None:
    add_node(state, "a")
    reserve(state, "dup", frontend="fe-1")
    with pytest.raises(DuplicateRequest, match=r"'dup' is already in flight \(owned by frontend 'fe-1'\)"):
        reserve(state, "dup", frontend=second_frontend)
    assert state.snapshot()["refusals"]["duplicate"] == 1


def test_release_then_lookup_says_finished_and_the_id_may_be_reused(state: ClusterState) -> None:
    add_node(state, "a")
    reserve(state, "r1")
    status, entry = state.lookup("r1")
    assert (status, entry.node_id, entry.address) == ("live", "a", "a:50051")

    assert state.release("r1", "fe-1") is True
    assert state.lookup("r1") == ("finished", None)
    assert state.lookup("never") == ("unknown", None)
    assert state.release("never", "fe-1") is False

    reserve(state, "r1")
    assert state.lookup("r1")[0] == "live"


def test_lookup_with_an_owner_sees_only_that_owners_requests(state: ClusterState) -> None:
    add_node(state, "a")
    state.reserve(cluster_pb2.ReserveRequest(request_id="mine", frontend_id="fe-1", owner="alice"))
    state.reserve(cluster_pb2.ReserveRequest(request_id="theirs", frontend_id="fe-2", owner="bob"))
    assert state.lookup("mine", "alice")[0] == "live"
    assert state.lookup("theirs", "alice") == ("unknown", None)  # exactly as an id never seen
    assert state.lookup("theirs")[0] == "live"  # no owner filter: an admin
    state.release("theirs", "fe-2")
    state.release("mine", "fe-1")
    assert state.lookup("mine", "alice") == ("finished", None)
    assert state.lookup("theirs", "alice") == ("unknown", None)
    assert state.lookup("theirs") == ("finished", None)


def test_release_by_another_frontend_is_ignored(state: ClusterState) -> None:
    add_node(state, "a")
    reserve(state, "r1", frontend="fe-1")
    assert state.release("r1", "fe-2") is False
    assert state.lookup("r1")[0] == "live"


def test_finished_memory_is_bounded(state: ClusterState) -> None:
    add_node(state, "a")
    for i in range(6):
        reserve(state, f"r{i}")
        state.release(f"r{i}", "fe-1")
    assert [state.lookup(f"r{i}")[0] for i in range(6)] == ["unknown"] * 2 + ["finished"] * 4


def test_routing_keys_cost_the_affinity_memory_a_digest_whatever_their_length(state: ClusterState) -> None:
    """16 KiB routing keys (the metadata limit allows them): what the coordinator keeps of each is a digest."""
    import gc
    import tracemalloc

    add_node(state, "a", max_running=10_000, max_queued=10_000)
    keys = 2000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(keys):
            reserve(state, f"r{i}", routing_key=f"{i:05d}" + "k" * 16_379)
            state.release(f"r{i}", "fe-1")
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < keys * 1024, f"{kept / keys:.0f} bytes kept per 16 KiB routing key"


def test_live_requests_lists_every_reservation_with_its_node(state: ClusterState) -> None:
    add_node(state, "a", 0)
    add_node(state, "b", 1)
    reserve(state, "x", target_rank=0)
    reserve(state, "y", target_rank=1, frontend="fe-2")
    assert sorted((rid, e.node_id) for rid, e in state.live_requests()) == [("x", "a"), ("y", "b")]
    assert state.cluster_load().live_reservations == 2


# ---------------------------------------------------------- availability


def test_no_node_available_describes_the_table(state: ClusterState) -> None:
    with pytest.raises(NoNodeAvailable, match="no node is registered"):
        reserve(state, "r")
    add_node(state, "a", ready=False)
    add_node(state, "b")
    add_node(state, "c")
    state.node_heartbeat("b", DRAINING, None)
    state.node_heartbeat("c", DOWN, None)
    with pytest.raises(NoNodeAvailable, match=r"3 known \(1 down, 1 draining, 1 starting\)"):
        reserve(state, "r")


def test_deployment_full_counts_reservations_since_the_last_load_report(state: ClusterState) -> None:
    add_node(state, "a", running=1, max_running=2, max_queued=1)
    add_node(state, "b", running=2, max_running=2, max_queued=1)
    placed = [reserve(state, f"r{i}") for i in range(3)]
    assert sorted(placed) == ["a", "a", "b"]
    with pytest.raises(DeploymentFull, match=r"every ready node is at capacity: .*3/3 in flight"):
        reserve(state, "r3")
    with pytest.raises(DeploymentFull, match="node rank 0 is at capacity"):
        reserve(state, "r3", target_rank=0)

    # Releasing a reservation the node has not reported yet frees its slot.
    state.release("r2", "fe-1")
    assert reserve(state, "r3") in ("a", "b")
    # A load report replaces the pending count.
    state.node_heartbeat("a", READY, load(running=0, max_running=2, max_queued=1))
    assert reserve(state, "r4") == "a"


# --------------------------------------------------------------- liveness


def test_heartbeat_from_unknown_node_or_frontend_is_not_known(state: ClusterState) -> None:
    assert state.node_heartbeat("ghost", READY, load()) is False
    assert state.frontend_heartbeat("ghost", 0) is False


def test_expiry_marks_a_silent_node_down_and_drops_its_reservations(state: ClusterState, clock: FakeClock) -> None:
    add_node(state, "a")
    add_node(state, "b")
    reserve(state, "on-a", target_rank=0)
    reserve(state, "on-b", target_rank=1)
    clock.advance(2.0)
    state.node_heartbeat("b", READY, None)
    state.frontend_heartbeat("fe-1", 2)
    clock.advance(1.5)
    state.expire()
    entries = {e.node_id: e.state for e in state.node_entries()}
    assert entries == {"a": DOWN, "b": READY}
    assert state.lookup("on-a") == ("finished", None)
    assert state.lookup("on-b")[0] == "live"
    assert state.snapshot()["live_reservations"] == 1

    # Still in the table (keeps its rank) until ten expiry periods of silence.
    assert state.node_heartbeat("a", READY, None) is True
    clock.advance(31.0)
    state.node_heartbeat("b", READY, None)
    state.expire()
    assert [e.node_id for e in state.node_entries()] == ["b"]


def test_node_reporting_down_drops_its_reservations(state: ClusterState) -> None:
    add_node(state, "a")
    reserve(state, "r")
    state.node_heartbeat("a", DOWN, None)
    assert state.lookup("r") == ("finished", None)


def test_frontend_expiry_drops_its_reservations_and_forgets_it(state: ClusterState, clock: FakeClock) -> None:
    add_node(state, "a")
    state.register_frontend("fe-1", "fe-1:8000")
    state.register_frontend("fe-2", "fe-2:8000")
    reserve(state, "r1", frontend="fe-1")
    reserve(state, "r2", frontend="fe-2")
    clock.advance(2.0)
    assert state.frontend_heartbeat("fe-2", 1) is True
    state.node_heartbeat("a", READY, None)
    clock.advance(1.5)
    state.expire()
    assert state.snapshot()["frontends_by_state"] == {"live": 1, "expired": 1}
    assert state.lookup("r1") == ("finished", None)
    assert state.lookup("r2")[0] == "live"

    clock.advance(30.0)
    state.expire()
    assert state.frontend_heartbeat("fe-1", 0) is False


def test_reserve_before_registration_adopts_the_frontend(state: ClusterState) -> None:
    """After a coordinator restart a frontend may reserve before it learns to register."""
    add_node(state, "a")
    reserve(state, "r1", frontend="fe-1")
    assert state.frontend_heartbeat("fe-1", 1) is False  # asked to register ...
    state.register_frontend("fe-1", "fe-1:8000")
    assert state.lookup("r1")[0] == "live"  # ... which keeps its reservations
    assert state.frontend_heartbeat("fe-1", 1) is True


def test_frontend_registering_again_has_restarted(state: ClusterState) -> None:
    add_node(state, "a")
    state.register_frontend("fe-1", "fe-1:8000")
    reserve(state, "r1", frontend="fe-1")
    state.register_frontend("fe-1", "fe-1:8000")
    assert state.lookup("r1") == ("finished", None)


def test_frontend_registering_again_keeps_its_reservations_unless_its_incarnation_changed(state: ClusterState) -> None:
    """A frontend registers again after a failed heartbeat: the same process (incarnation) keeps its live
    requests' reservations; a restarted one under the same id (a new incarnation) has none left."""
    add_node(state, "a")
    state.register_frontend("fe-1", "fe-1:8000", "first")
    reserve(state, "r1", frontend="fe-1")
    state.register_frontend("fe-1", "fe-1:8000", "first")
    assert state.lookup("r1")[0] == "live"
    state.register_frontend("fe-1", "fe-1:8000", "second")
    assert state.lookup("r1") == ("finished", None)


def test_snapshot_and_cluster_load(state: ClusterState, clock: FakeClock) -> None:
    add_node(state, "a")
    add_node(state, "b", ready=False)
    state.register_frontend("fe-1", "fe-1:8000")
    state.frontend_heartbeat("fe-1", 1)
    reserve(state, "r1")
    clock.advance(2.0)
    snap = state.snapshot()
    assert snap["nodes_by_state"] == {"starting": 1, "ready": 1, "draining": 0, "down": 0}
    assert snap["frontends_by_state"] == {"live": 1, "expired": 0}
    assert snap["live_reservations"] == 1
    assert snap["oldest_reservation_age_s"] == 2.0
    assert snap["frontend_reported_live_requests"] == 1
    cluster_load = state.cluster_load()
    assert [(n.node_id, n.state) for n in cluster_load.nodes] == [("a", READY), ("b", STARTING)]
    assert cluster_load.live_reservations == 1


def test_returned_entries_are_copies(state: ClusterState) -> None:
    add_node(state, "a")
    state.node_entries()[0].state = DOWN
    state.cluster_load().nodes[0].state = DOWN
    assert reserve(state, "r") == "a"


def test_invalid_parameters_are_refused(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="finished_memory must be > 0"):
        ClusterState(now=clock, finished_memory=0)


def test_a_batch_applies_its_releases_first_then_answers_each_reservation_in_order(state: ClusterState):
    import grpc  # the status code numbers the outcomes carry are grpc.StatusCode values

    add_node(state, "n0", 0, max_running=1, max_queued=0)
    add_node(state, "n1", 1)
    state.register_frontend("fe-1", "fe-1:1")
    state.reserve(cluster_pb2.ReserveRequest(request_id="old", frontend_id="fe-1", target_rank=0))
    batch = cluster_pb2.ReservationBatch(
        frontend_id="fe-1",
        release=["old", "never-reserved"],
        reserve=[
            cluster_pb2.ReserveRequest(request_id="a", target_rank=0, owner="key-a"),  # rank 0 is free again
            cluster_pb2.ReserveRequest(request_id="a"),  # duplicate of the entry just before
            cluster_pb2.ReserveRequest(request_id="b", target_rank=7),
            cluster_pb2.ReserveRequest(request_id="c", target_rank=0),  # rank 0 is full again
        ],
    )
    outcomes = state.apply_batch(batch)
    assert outcomes[0].node.node_id == "n0" and not outcomes[0].refusal_code
    assert [o.refusal_code for o in outcomes[1:]] == [
        grpc.StatusCode.ALREADY_EXISTS.value[0],
        grpc.StatusCode.NOT_FOUND.value[0],
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
    ]
    assert "'a' is already in flight (owned by frontend 'fe-1')" in outcomes[1].refusal
    assert "no ready node has rank 7" in outcomes[2].refusal
    assert state.lookup("old")[0] == "finished" and state.lookup("a")[0] == "live"
    assert state.lookup("a", "key-a")[0] == "live"  # the batched owner is kept as the unary one is
    assert state.lookup("a", "key-b")[0] == "unknown"
    assert state.release("a", "fe-1")  # the batch's frontend owns its reservations


def test_least_loaded_through_the_load_index_matches_a_scan_over_every_node(state: ClusterState) -> None:
    import random

    rng = random.Random(17)
    ids = [f"n{i}" for i in range(12)]
    for node_id in ids:
        add_node(state, node_id, max_running=rng.randint(1, 6), max_queued=rng.randint(0, 2))
    live: list[str] = []
    for step in range(600):
        action = rng.random()
        if action < 0.15:
            node_id = rng.choice(ids)
            state.node_heartbeat(
                node_id,
                rng.choice([READY, READY, READY, DRAINING]),
                load(running=rng.randint(0, 4), max_running=rng.randint(1, 6), max_queued=rng.randint(0, 2)),
            )
        elif action < 0.45 and live:
            assert state.release(live.pop(rng.randrange(len(live))), "fe-1")
        else:
            eligible = [n for n in state._nodes.values() if n.entry.state == READY and not n.is_full()]
            if not eligible:
                with pytest.raises(DeploymentFull):
                    reserve(state, f"r{step}")
                continue
            lowest = min(n.load_score() for n in eligible)
            chosen = reserve(state, f"r{step}")
            live.append(f"r{step}")
            assert chosen in {n.entry.node_id for n in eligible}
            assert state._nodes[chosen].load_score() - 1 / max(
                1, state._nodes[chosen].entry.load.max_running_requests
            ) == pytest.approx(lowest)  # its score before this reservation was the lowest


# ------------------------------------------------------- the frontends' node table


def table_ids(entries: list[cluster_pb2.NodeEntry]) -> list[str]:
    return [entry.node_id for entry in entries]


def since(state: ClusterState, cursor: TableCursor) -> tuple[bool, list[str]]:
    full, entries = state.node_table_since(cursor)
    return full, table_ids(entries)


def test_a_frontend_gets_the_whole_table_first_then_only_what_changed(state: ClusterState, clock: FakeClock) -> None:
    add_node(state, "a")
    add_node(state, "b")
    cursor = TableCursor()
    assert since(state, cursor) == (True, ["a", "b"])
    assert since(state, cursor) == (False, []), "nothing changed: nothing to send"

    clock.advance(FRONTEND_LOAD_REFRESH_S)
    state.node_heartbeat("b", READY, load(running=3))
    full, entries = state.node_table_since(cursor)
    assert not full and table_ids(entries) == ["b"] and entries[0].load.running_requests == 3
    behind = dataclasses.replace(cursor)
    add_node(state, "c", ready=False)
    state.node_heartbeat("a", DRAINING, None)
    full, entries = state.node_table_since(cursor)
    assert not full and table_ids(entries) == ["c", "a"]  # in the order they changed
    assert entries[1].state == DRAINING and entries[0].state == STARTING
    # A frontend further behind gets everything that changed since its own cursor.
    state.node_heartbeat("b", READY, load(running=4, max_running=16))  # limits are not load figures alone
    assert since(state, behind) == (False, ["c", "a", "b"])
    assert since(state, cursor) == (False, ["b"]) and since(state, cursor) == (False, [])


def test_load_figures_alone_reach_a_frontend_at_most_every_refresh_period(
    state: ClusterState, clock: FakeClock
) -> None:
    add_node(state, "a")
    add_node(state, "b")
    cursor = TableCursor()
    assert since(state, cursor) == (True, ["a", "b"])
    for running in range(1, 4):
        clock.advance(1.0)
        state.node_heartbeat("a", READY, load(running=running))
        assert since(state, cursor) == (False, []), "figures alone wait for the refresh"
    state.node_heartbeat("b", DRAINING, None)
    full, entries = state.node_table_since(cursor)
    assert table_ids(entries) == ["b"] and entries[0].state == DRAINING, "a state change goes at once"
    clock.advance(FRONTEND_LOAD_REFRESH_S)
    full, entries = state.node_table_since(cursor)
    assert table_ids(entries) == ["a", "b"] and entries[0].load.running_requests == 3, "every change since"
    state.node_heartbeat("a", READY, load(running=9))
    assert since(state, cursor) == (False, [])
    clock.advance(FRONTEND_LOAD_REFRESH_S)
    assert since(state, cursor) == (False, ["a"])


def test_a_node_leaving_the_table_sends_the_whole_table_again(state: ClusterState, clock: FakeClock) -> None:
    add_node(state, "a")
    add_node(state, "b")
    cursor = TableCursor()
    state.node_table_since(cursor)
    clock.advance(31.0)  # past FORGET_AFTER_EXPIRIES x 3 s: both forgotten
    state.node_heartbeat("b", READY, None)
    state.expire()
    assert since(state, cursor) == (True, ["b"])  # "a" is gone: the frontend's copy must drop it


def test_a_heartbeat_that_changes_nothing_leaves_the_table_and_the_index_alone(
    state: ClusterState, clock: FakeClock
) -> None:
    add_node(state, "a")
    add_node(state, "b")
    state.node_heartbeat("a", READY, load(running=1))
    state.node_heartbeat("b", READY, load(running=1))
    cursor = TableCursor()
    state.node_table_since(cursor)
    index = state._least_loaded
    pushed = len(index._heap)
    for _ in range(5):
        state.node_heartbeat("a", READY, load(running=1))
        state.node_heartbeat("b", READY, None)
    clock.advance(FRONTEND_LOAD_REFRESH_S)  # whatever changed would be sent now
    assert since(state, cursor) == (False, [])
    assert len(index._heap) == pushed, "no new load-index entry for an unchanged score"
    # A reservation since the last report still counts until the next report, which then resets it.
    assert reserve(state, "r1") in ("a", "b")
    picked = state.lookup("r1")[1].node_id
    state.node_heartbeat(picked, READY, load(running=1))
    clock.advance(FRONTEND_LOAD_REFRESH_S)
    assert since(state, cursor) == (False, []), "same figures: the table is unchanged"
    # Equal again (the report counts r1): the tie goes to the node picked longest ago.
    assert reserve(state, "r2") != picked


def test_a_node_serving_a_live_models_name_with_another_tokenizer_is_refused_while_it_lives(
    state: ClusterState, clock: FakeClock
) -> None:
    smol = cluster_pb2.ModelCard(name="SmolLM2-135M-Instruct", engine="llama.cpp", tokenizer_digest="a" * 64)
    rebuilt = cluster_pb2.ModelCard(name="SmolLM2-135M-Instruct", engine="llama.cpp", tokenizer_digest="b" * 64)
    other = cluster_pb2.ModelCard(name="Qwen/Qwen3-0.6B", engine="simulated", tokenizer_digest="b" * 64)
    state.register_node(cluster_pb2.NodeEntry(node_id="n0", address="n0:1", model=smol), None)
    state.register_node(cluster_pb2.NodeEntry(node_id="n1", address="n1:1", model=smol), None)
    assert state.register_node(cluster_pb2.NodeEntry(node_id="n2", address="n2:1", model=other), None).rank == 2
    with pytest.raises(
        ModelMismatch, match="node 'n3' serves 'SmolLM2-135M-Instruct'.*live node 'n0' serves a model of that name"
    ):
        state.register_node(cluster_pb2.NodeEntry(node_id="n3", address="n3:1", model=rebuilt), None)
    clock.advance(4.0)
    state.expire()  # every node silent past the expiry: DOWN
    assert state.register_node(cluster_pb2.NodeEntry(node_id="n3", address="n3:1", model=rebuilt), None).rank == 0


def add_model_node(state: ClusterState, node_id: str, model: str, **limits) -> None:
    card = cluster_pb2.ModelCard(name=model, tokenizer_digest=model * 8)
    state.register_node(
        cluster_pb2.NodeEntry(node_id=node_id, address=f"{node_id}:1", model=card, load=load(**limits)), None
    )
    assert state.node_heartbeat(node_id, READY, None)


def test_with_several_models_a_request_goes_to_a_node_of_its_model(state: ClusterState) -> None:
    add_model_node(state, "a0", "A")
    add_model_node(state, "a1", "A")
    add_model_node(state, "b0", "B", running=7)  # busier than the A nodes: least loaded alone would avoid it
    assert {reserve(state, f"b{i}", model="B") for i in range(4)} == {"b0"}
    assert {reserve(state, f"a{i}", model="A") for i in range(4)} == {"a0", "a1"}
    key = {reserve(state, f"k{i}", model="B", routing_key="user-7") for i in range(3)}
    assert key == {"b0"}, "a routing key picks among its model's nodes"
    with pytest.raises(RankNotFound, match="rank 2 serves model 'B'"):
        reserve(state, "r", model="A", target_rank=2)
    with pytest.raises(NoNodeAvailable, match="no node serving 'C' is ready"):
        reserve(state, "c", model="C")


def test_with_one_model_the_models_name_is_not_needed(state: ClusterState) -> None:
    add_model_node(state, "a0", "A")
    assert reserve(state, "r0") == "a0" and reserve(state, "r1", model="A") == "a0"
    with pytest.raises(NoNodeAvailable, match="no node serving 'B' is ready"):
        reserve(state, "r2", model="B")  # a model whose nodes are gone: never another model's node


# ------------------------------------------------------------------ routing by the nodes' KV events


@pytest.fixture
def kv_state(clock: FakeClock) -> ClusterState:
    return ClusterState(now=clock, node_expiry_s=3.0, frontend_expiry_s=3.0, prefix_routing="kv-events")


def stored(*chain: bytes) -> kv_pb2.KvEventBatch:
    blocks = [kv_pb2.KvBlockHash(value=value) for value in chain]
    return kv_pb2.KvEventBatch(events=[kv_pb2.KvEvent(block_stored=kv_pb2.BlockStored(block_hashes=blocks))])


def test_a_request_goes_to_the_node_holding_the_longest_run_of_its_blocks(kv_state: ClusterState) -> None:
    state = kv_state
    for node_id in ("a", "b", "c"):
        add_node(state, node_id)
    state.kv_index.apply("a", stored(b"h1"))
    state.kv_index.apply("b", stored(b"h1", b"h2"))
    state.kv_index.apply("c", stored(b"h2", b"h3"))  # not from the first block: no run
    assert reserve(state, "r0", block_hashes=[b"h1", b"h2", b"h3"]) == "b"
    assert reserve(state, "r1", block_hashes=[b"h1", b"h2", b"h3"], routing_key="key-0") == "a", "a key wins"
    assert state.snapshot()["routing_decisions"]["kv_blocks"] == 1
    state.kv_index.forget("b")
    assert reserve(state, "r2", block_hashes=[b"h1"]) == "a"
    state.kv_index.apply(
        "a", kv_pb2.KvEventBatch(events=[kv_pb2.KvEvent(all_blocks_cleared=kv_pb2.AllBlocksCleared())])
    )
    reserve(state, "r3", block_hashes=[b"h1"])
    assert state.snapshot()["routing_decisions"]["kv_blocks"] == 2, "held nowhere: the next rule decides"


def test_the_node_with_the_blocks_is_passed_over_when_much_busier(kv_state: ClusterState) -> None:
    state = kv_state
    add_node(state, "a", running=6, max_running=8)  # 0.75 busier than b
    add_node(state, "b")
    state.kv_index.apply("a", stored(b"h1"))
    assert reserve(state, "r0", block_hashes=[b"h1"]) == "b"
    assert state.snapshot()["routing_decisions"]["kv_blocks"] == 0


def test_among_nodes_holding_the_same_run_the_one_its_last_block_names_is_picked(kv_state: ClusterState) -> None:
    state = kv_state
    for node_id in ("a", "b", "c"):
        add_node(state, node_id, running=0, max_running=8)
    for node_id in ("a", "b"):
        state.kv_index.apply(node_id, stored(b"h1", b"h2"))
    named = rendezvous_pick(b"h2".hex(), ["a", "b"], lambda node_id: node_id)
    other = ({"a", "b"} - {named}).pop()
    state.node_heartbeat(named, READY, load(running=1))  # a little busier than the other holder: still its node
    assert reserve(state, "r0", block_hashes=[b"h1", b"h2"]) == named
    state.node_heartbeat(named, READY, load(running=7))  # far busier: the least loaded holder
    assert reserve(state, "r1", block_hashes=[b"h1", b"h2"]) == other
    assert state.snapshot()["routing_decisions"]["kv_blocks"] == 2


def test_a_run_of_half_the_blocks_or_less_does_not_decide(kv_state: ClusterState) -> None:
    state = kv_state
    add_node(state, "a", running=1, max_running=8)
    add_node(state, "b")
    state.kv_index.apply("a", stored(b"template", b"h2"))
    assert reserve(state, "r0", block_hashes=[b"template", b"x2", b"x3"]) == "b", "the least loaded"
    assert reserve(state, "r1", block_hashes=[b"template", b"h2", b"x3"]) == "a"
    assert state.snapshot()["routing_decisions"]["kv_blocks"] == 1


def test_a_new_prompt_goes_to_the_least_loaded_node_and_its_next_requests_follow(kv_state, clock) -> None:
    state = kv_state
    add_node(state, "a", running=1, max_running=8)
    add_node(state, "b")
    doc1, doc2 = [b"preamble", b"d1-1", b"d1-2"], [b"preamble", b"d2-1", b"d2-2"]
    assert reserve(state, "r0", block_hashes=doc1 + [b"q0"]) == "b"
    state.node_heartbeat("b", READY, load(running=1))
    state.node_heartbeat("a", READY, load(running=0))
    assert reserve(state, "r1", block_hashes=doc1 + [b"q1"]) == "b", "not cached yet: where its first request went"
    assert reserve(state, "r2", block_hashes=doc2 + [b"q2"]) == "a", "the same preamble only: the least loaded"
    state.node_heartbeat("b", READY, load(running=7))  # far busier than a
    assert reserve(state, "r3", block_hashes=doc1 + [b"q3"]) == "a"
    assert state.snapshot()["routing_decisions"]["kv_blocks"] == 1
    state.node_heartbeat("b", READY, load(running=0))
    state.node_heartbeat("a", READY, load(running=0))
    clock.advance(PREDICTED_TTL_S)  # no event ever said the blocks were cached: the guess lapses
    reserve(state, "r4", block_hashes=doc1 + [b"q4"])
    assert state.snapshot()["routing_decisions"]["kv_blocks"] == 1


def test_a_new_prompt_goes_to_the_node_holding_the_fewest_distinct_blocks(kv_state, clock) -> None:
    state = kv_state
    add_node(state, "a")
    add_node(state, "b", running=1, max_running=8)  # a little busier, within the slack
    state.kv_index.apply("a", stored(b"template", b"p1-1", b"p1-2"))
    state.kv_index.apply("b", stored(b"template"))
    assert reserve(state, "r0", block_hashes=[b"template", b"p2-1", b"p2-2"]) == "b", "b keeps fewer prefixes"
    assert state.kv_index.held("b", clock()) == 3, "the routed request's blocks count as on b"
    assert reserve(state, "r1", block_hashes=[b"template", b"p3-1", b"p3-2", b"p3-3"]) == "a", "now a has fewer"
    assert state.snapshot()["routing_decisions"]["new_prefix"] == 2
    clock.advance(PREDICTED_TTL_S)
    assert state.kv_index.held("b", clock()) == 1, "predictions lapse"
    state.node_heartbeat("b", READY, load(running=7))  # far busier: the least loaded instead
    assert reserve(state, "r2", block_hashes=[b"template", b"p4-1", b"p4-2"]) == "a"
    assert state.snapshot()["routing_decisions"]["least_loaded"] == 1


def test_routing_by_first_tokens_ignores_the_blocks(state: ClusterState) -> None:
    add_node(state, "a")
    add_node(state, "b")
    state.kv_index.apply("a", stored(b"h1", b"h2"))
    reserve(state, "r0", block_hashes=[b"h1", b"h2"], prefix_key="p")
    decisions = state.snapshot()["routing_decisions"]
    assert decisions["kv_blocks"] == 0 and decisions["prefix"] == 1
