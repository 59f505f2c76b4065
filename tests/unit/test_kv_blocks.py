"""common/kv_blocks.py: the block hashes of KV events, and the ledger whose events a subscriber replays into the
same set of blocks the cache holds."""

from __future__ import annotations

import hashlib
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.common.kv_blocks import (
    BLOCK_SIZE,
    HASH_ENCODING,
    BlockChange,
    BlockLedger,
    block_changes,
    block_hashes,
    root_hash,
    wire_hash,
)


def test_a_block_hash_is_blake2b_of_the_previous_hash_and_the_block_tokens():
    tokens = list(range(100, 100 + 2 * BLOCK_SIZE + 5))
    first = hashlib.blake2b(root_hash("") + struct.pack(f"<{BLOCK_SIZE}I", *tokens[:BLOCK_SIZE]), digest_size=16)
    second = hashlib.blake2b(first.digest() + struct.pack(f"<{BLOCK_SIZE}I", *tokens[BLOCK_SIZE:32]), digest_size=16)
    assert block_hashes("", tokens) == [first.digest(), second.digest()]  # the partial third block has none


def test_events_read_as_changes_of_single_blocks_each_after_its_parent():
    parent, first, second = b"p" * 16, b"a" * 16, b"b" * 16
    events = [
        kv_pb2.KvEvent(
            block_stored=kv_pb2.BlockStored(
                block_hashes=[wire_hash(first), wire_hash(second)],
                parent_block_hash=wire_hash(parent),
                token_ids=list(range(2 * BLOCK_SIZE)),
                block_size=BLOCK_SIZE,
            )
        ),
        kv_pb2.KvEvent(block_removed=kv_pb2.BlockRemoved(block_hashes=[wire_hash(second)])),
        kv_pb2.KvEvent(all_blocks_cleared=kv_pb2.AllBlocksCleared()),
    ]
    changes = [change._replace(tokens=list(change.tokens)) for change in block_changes(events)]
    assert changes == [
        BlockChange(first, True, parent, list(range(BLOCK_SIZE))),
        BlockChange(second, True, first, list(range(BLOCK_SIZE, 2 * BLOCK_SIZE))),
        BlockChange(second, tokens=[]),
        BlockChange(b"", tokens=[]),
    ]


def test_blocks_share_a_hash_only_after_the_same_tokens_in_the_same_namespace():
    prompt = list(range(3 * BLOCK_SIZE))
    other_tail = prompt[: 2 * BLOCK_SIZE] + [7] * BLOCK_SIZE
    assert block_hashes("", prompt)[:2] == block_hashes("", other_tail)[:2]
    assert block_hashes("", prompt)[2] != block_hashes("", other_tail)[2]
    assert not set(block_hashes("", prompt)) & set(block_hashes("tenant-a/", prompt))
    shifted = [1] + prompt[:-1]  # the same later blocks after another first one
    assert not set(block_hashes("", prompt)) & set(block_hashes("", shifted))


def replay(events, held: dict[bytes, tuple[bytes, list[int]]]) -> None:
    """What a subscriber does with the events: the set of blocks, each with its parent and tokens."""
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            assert stored.block_size == BLOCK_SIZE
            parent = stored.parent_block_hash.value
            assert not parent or parent in held, "a block's parent is stored before it"
            for index, block in enumerate(stored.block_hashes):
                assert block.encoding == HASH_ENCODING and block.value not in held
                held[block.value] = (parent, list(stored.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]))
                parent = block.value
        elif kind == "block_removed":
            for block in event.block_removed.block_hashes:
                del held[block.value]  # a removal names a held block
        else:
            held.clear()


def test_a_block_two_sequences_hold_is_stored_once_and_removed_with_the_last():
    ledger = BlockLedger()
    system = list(range(2 * BLOCK_SIZE))
    a = ledger.store("", system + [1] * BLOCK_SIZE)
    b = ledger.store("", system + [2] * BLOCK_SIZE + [3] * 5)
    stored = [event.block_stored for event in ledger.take_events()]
    assert [len(s.block_hashes) for s in stored] == [3, 1]
    assert stored[1].parent_block_hash.value == a[1] and list(stored[1].token_ids) == [2] * BLOCK_SIZE
    assert len(ledger) == 4
    ledger.remove(a)
    (removed,) = ledger.take_events()
    assert [block.value for block in removed.block_removed.block_hashes] == [a[2]]
    ledger.remove(b)
    (removed,) = ledger.take_events()
    assert {block.value for block in removed.block_removed.block_hashes} == set(b)
    assert len(ledger) == 0 and ledger.take_events() == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.sampled_from(["", "ns/"]),
            st.lists(st.integers(0, 3), min_size=0, max_size=5 * BLOCK_SIZE),
        ),
        max_size=30,
    )
)
def test_replaying_the_events_gives_the_blocks_the_cached_sequences_cover(operations):
    ledger = BlockLedger()
    cached: list[tuple[str, list[int], list[bytes]]] = []
    held: dict[bytes, tuple[bytes, list[int]]] = {}
    for add, namespace, tokens in operations:
        if add or not cached:
            cached.append((namespace, tokens, ledger.store(namespace, tokens)))
        else:
            ledger.remove(cached.pop(len(tokens) % len(cached))[2])
        replay(ledger.take_events(), held)
        expected = {value for ns, toks, _ in cached for value in block_hashes(ns, toks)}
        assert set(held) == expected and len(ledger) == len(expected)
        for ns, toks, _ in cached:  # each block's tokens and parent are those of its chain
            chain = block_hashes(ns, toks)
            for index, value in enumerate(chain):
                assert held[value] == (
                    chain[index - 1] if index else b"",
                    toks[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE],
                )
