"""coordinator/kv_index.py: which node holds which block, from their events, and the longest runs."""

from __future__ import annotations

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.coordinator import kv_index
from openengine_serve.coordinator.kv_index import PREDICTED_TTL_S, KvIndex


def batch(*events: kv_pb2.KvEvent) -> kv_pb2.KvEventBatch:
    return kv_pb2.KvEventBatch(events=events)


def stored(*chain: bytes) -> kv_pb2.KvEvent:
    return kv_pb2.KvEvent(block_stored=kv_pb2.BlockStored(block_hashes=[kv_pb2.KvBlockHash(value=v) for v in chain]))


def removed(*values: bytes) -> kv_pb2.KvEvent:
    return kv_pb2.KvEvent(block_removed=kv_pb2.BlockRemoved(block_hashes=[kv_pb2.KvBlockHash(value=v) for v in values]))


CLEARED = kv_pb2.KvEvent(all_blocks_cleared=kv_pb2.AllBlocksCleared())
NOW = 100.0


def test_the_longest_run_from_the_first_block_and_who_holds_it():
    index = KvIndex()
    index.apply("a", batch(stored(b"1", b"2", b"3")))
    index.apply("b", batch(stored(b"1", b"2"), stored(b"x")))
    assert index.longest_runs([b"1", b"2", b"3", b"4"], NOW) == ({"a"}, 3)
    assert index.longest_runs([b"1", b"2", b"y"], NOW) == ({"a", "b"}, 2)
    assert index.longest_runs([b"x"], NOW) == ({"b"}, 1)
    assert index.longest_runs([b"2", b"3"], NOW) == ({"a"}, 2)
    assert index.longest_runs([b"9", b"1"], NOW) == (set(), 0)  # a run starts at the first block asked
    assert index.longest_runs([], NOW) == (set(), 0)


def test_removed_cleared_and_forgotten_blocks_route_no_more():
    index = KvIndex()
    index.apply("a", batch(stored(b"1", b"2")))
    index.apply("b", batch(stored(b"1", b"2")))
    index.apply("a", batch(removed(b"2")))
    assert index.longest_runs([b"1", b"2"], NOW) == ({"b"}, 2)
    index.apply("b", batch(CLEARED))
    assert index.longest_runs([b"1", b"2"], NOW) == ({"a"}, 1) and index.blocks("b") == 0
    index.forget("a")
    assert index.longest_runs([b"1"], NOW) == (set(), 0) and index.blocks("a") == 0
    assert not index._holders, "nothing left behind for blocks no node holds"


def test_a_routed_requests_blocks_count_as_on_its_node_until_its_events_or_the_time_limit():
    index = KvIndex()
    index.predict("a", [b"1", b"2", b"3"], NOW)
    assert index.longest_runs([b"1", b"2", b"4"], NOW) == ({"a"}, 2)
    assert index.blocks("a") == 0, "the gauge counts what the events say only"
    index.apply("a", batch(stored(b"1", b"2")))  # the request ended: its events take over
    index.apply("a", batch(removed(b"1", b"2")))
    assert index.longest_runs([b"1", b"2", b"3"], NOW) == (set(), 0), "a prediction the events replaced is gone"
    index.predict("b", [b"x", b"y"], NOW)
    assert index.longest_runs([b"x", b"y"], NOW + PREDICTED_TTL_S - 1) == ({"b"}, 2)
    index.predict("b", [b"x"], NOW + 10)  # a later request with the same first block renews it
    assert index.longest_runs([b"x", b"y"], NOW + PREDICTED_TTL_S) == ({"b"}, 1)
    assert index.longest_runs([b"x"], NOW + 10 + PREDICTED_TTL_S) == (set(), 0)
    index.predict("c", [b"z"], NOW)
    index.forget("c")
    assert index.longest_runs([b"z"], NOW) == (set(), 0)
    assert not index._predicted and not index._predicted_holders


def test_predictions_are_bounded(monkeypatch):
    monkeypatch.setattr(kv_index, "PREDICTED_KEPT", 3)
    index = KvIndex()
    index.predict("a", [b"1", b"2", b"3", b"4", b"5"], NOW)
    assert index.longest_runs([b"1"], NOW) == (set(), 0) and index.longest_runs([b"3", b"4", b"5"], NOW) == ({"a"}, 3)
