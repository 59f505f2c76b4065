"""coordinator/kv_index.py: which node holds which block, from their events, and the longest runs."""

from __future__ import annotations

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.coordinator.kv_index import KvIndex


def batch(*events: kv_pb2.KvEvent) -> kv_pb2.KvEventBatch:
    return kv_pb2.KvEventBatch(events=events)


def stored(*chain: bytes) -> kv_pb2.KvEvent:
    return kv_pb2.KvEvent(block_stored=kv_pb2.BlockStored(block_hashes=[kv_pb2.KvBlockHash(value=v) for v in chain]))


def removed(*values: bytes) -> kv_pb2.KvEvent:
    return kv_pb2.KvEvent(block_removed=kv_pb2.BlockRemoved(block_hashes=[kv_pb2.KvBlockHash(value=v) for v in values]))


CLEARED = kv_pb2.KvEvent(all_blocks_cleared=kv_pb2.AllBlocksCleared())


def test_the_longest_run_from_the_first_block_and_who_holds_it():
    index = KvIndex()
    index.apply("a", batch(stored(b"1", b"2", b"3")))
    index.apply("b", batch(stored(b"1", b"2"), stored(b"x")))
    assert index.longest_runs([b"1", b"2", b"3", b"4"]) == ({"a"}, 3)
    assert index.longest_runs([b"1", b"2", b"y"]) == ({"a", "b"}, 2)
    assert index.longest_runs([b"x"]) == ({"b"}, 1)
    assert index.longest_runs([b"2", b"3"]) == ({"a"}, 2)
    assert index.longest_runs([b"9", b"1"]) == (set(), 0)  # a run starts at the first block asked
    assert index.longest_runs([]) == (set(), 0)


def test_removed_cleared_and_forgotten_blocks_route_no_more():
    index = KvIndex()
    index.apply("a", batch(stored(b"1", b"2")))
    index.apply("b", batch(stored(b"1", b"2")))
    index.apply("a", batch(removed(b"2")))
    assert index.longest_runs([b"1", b"2"]) == ({"b"}, 2)
    index.apply("b", batch(CLEARED))
    assert index.longest_runs([b"1", b"2"]) == ({"a"}, 1) and index.blocks("b") == 0
    index.forget("a")
    assert index.longest_runs([b"1"]) == (set(), 0) and index.blocks("a") == 0
    assert not index._holders, "nothing left behind for blocks no node holds"
