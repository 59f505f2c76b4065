"""The shared routing rule (rendezvous hashing) that the coordinator and the frontend's fallback both use."""

from __future__ import annotations

import collections
import itertools

import pytest

from openengine_serve.common.routing import owning_coordinator, rendezvous_pick, rendezvous_weight

NODES = ["node-a", "node-b", "node-c", "node-d"]
KEYS = [f"session-{i}" for i in range(2000)]


def pick(key: str, nodes: list[str]) -> str:
    return rendezvous_pick(key, nodes, str)


def test_the_weight_is_the_same_in_every_process():
    # A frontend and the coordinator (other processes, other versions during a rolling update) must agree:
    # the weight is a fixed function of its inputs, not Python's per-process salted hash.
    assert rendezvous_weight("user-7", "node-a") == 0xEA008C700D14ED4F
    assert rendezvous_weight("user-7", "node-a") != rendezvous_weight("user-7", "node-b")


def test_the_choice_does_not_depend_on_the_order_of_the_nodes():
    for key in KEYS[:50]:
        assert len({pick(key, list(order)) for order in itertools.permutations(NODES)}) == 1


def test_keys_spread_over_the_nodes():
    counts = collections.Counter(pick(key, NODES) for key in KEYS)
    assert set(counts) == set(NODES)
    assert all(350 < n < 650 for n in counts.values()), counts  # 500 each on average


def test_a_node_leaving_moves_only_its_own_keys():
    before = {key: pick(key, NODES) for key in KEYS}
    after = {key: pick(key, NODES[1:]) for key in KEYS}
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == "node-a"}


def test_no_node_is_an_error():
    with pytest.raises(ValueError, match="at least one node"):
        pick("k", [])


COORDINATORS = ["coord-0:50052", "coord-1:50052", "coord-2:50052"]
REQUEST_IDS = [f"req-{i}" for i in range(3000)]


def test_one_coordinator_owns_every_id():
    assert {owning_coordinator(i, ["only:50052"]) for i in REQUEST_IDS[:100]} == {"only:50052"}


def test_every_frontend_agrees_on_an_ids_coordinator_whatever_order_it_lists_them_in():
    for request_id in REQUEST_IDS[:50]:
        owners = {owning_coordinator(request_id, list(order)) for order in itertools.permutations(COORDINATORS)}
        assert len(owners) == 1
    # A fixed function of its inputs (other processes and versions agree), not Python's salted hash.
    assert owning_coordinator("req-0", COORDINATORS) == "coord-1:50052"
    assert owning_coordinator("req-1", COORDINATORS) == "coord-0:50052"


def test_ids_spread_over_the_coordinators():
    counts = collections.Counter(owning_coordinator(i, COORDINATORS) for i in REQUEST_IDS)
    assert set(counts) == set(COORDINATORS)
    assert all(850 < n < 1150 for n in counts.values()), counts  # 1000 each on average


def test_adding_a_coordinator_moves_only_the_ids_it_takes():
    before = {i: owning_coordinator(i, COORDINATORS[:2]) for i in REQUEST_IDS}
    after = {i: owning_coordinator(i, COORDINATORS) for i in REQUEST_IDS}
    moved = {i for i in REQUEST_IDS if before[i] != after[i]}
    assert moved and all(after[i] == "coord-2:50052" for i in moved)
