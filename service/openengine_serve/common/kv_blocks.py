"""KV blocks as KV events name them (`SubscribeKvEvents`): what a node's prefix cache holds, in blocks of
`BLOCK_SIZE` tokens, each named by a hash that chains its tokens to every token before it.

The hash (`HASH_ENCODING`) of a block is BLAKE2b with a 16-byte digest of the previous block's hash followed by
the block's token ids as little-endian uint32; the first block's previous hash is `root_hash(namespace)`, where
the namespace is the prefix-cache salt of the request (the key's cache namespace, then the client's
`kv.cache_salt`; "" without API keys and salt), with its LoRA adapter when it names one (`cache_namespace`). So
two blocks have one hash only when the same tokens follow the same prefix in the same namespace, and a router
that knows a request's tokens computes the hashes of its blocks (`block_hashes`) and asks which node holds the
longest run of them.

The cache keeps whole sequences (a prompt and the output read after it); each covers its full blocks. A block is
stored when the first sequence covering it enters the cache, and removed when the last one leaves
(`BlockLedger`), so a subscriber who applies the events in order holds exactly the node's set of blocks.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from openengine_serve.api.openengine.v1 import kv_pb2

BLOCK_SIZE = 16
KEPT_BATCHES = 4096  # event batches a node keeps for a subscriber who comes back (`start_sequence_number`)
HASH_ENCODING = "openengine-blake2b128-chain-v1"
_ROOT_PERSON = b"oe-kv-root"


def cache_namespace(salt: str, lora_name: str) -> str:
    """The prefix-cache namespace of a request: its salt, and its LoRA adapter (an adapter's KV differs from the
    base model's for the same tokens). The NUL cannot occur in a name the frontend accepts."""
    return f"{salt}\0lora:{lora_name}" if lora_name else salt


def root_hash(namespace: str) -> bytes:
    """The chain's start for a namespace (the previous hash of its first block)."""
    return hashlib.blake2b(namespace.encode(), digest_size=16, person=_ROOT_PERSON).digest()


def block_hashes(namespace: str, tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The hashes of the full blocks of `tokens` (a partial last block has none)."""
    hashes: list[bytes] = []
    previous = root_hash(namespace)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes


def wire_hash(value: bytes) -> kv_pb2.KvBlockHash:
    return kv_pb2.KvBlockHash(value=value, encoding=HASH_ENCODING)


class BlockLedger:
    """How many cached sequences hold each block; `store` and `remove` record the KV events of the blocks that
    appear and go, `take_events` hands them over."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._holders: dict[bytes, int] = {}  # block hash -> cached sequences covering it
        self._events: list[kv_pb2.KvEvent] = []

    def __len__(self) -> int:
        """Blocks held: the node's own count, which a subscriber's set must match."""
        return len(self._holders)

    def store(self, namespace: str, tokens: Sequence[int], lora_name: str = "") -> list[bytes]:
        """A sequence entered the cache (computed with the LoRA adapter `lora_name`, "" none); returns its block
        hashes (what `remove` takes when it leaves). Its new blocks are a suffix of its chain (a block is held only
        with every block before it): one BlockStored."""
        hashes = block_hashes(namespace, tokens, self.block_size)
        first_new = len(hashes)
        for index, value in enumerate(hashes):
            held = self._holders.get(value, 0)
            if not held and first_new == len(hashes):
                first_new = index
            self._holders[value] = held + 1
        if first_new < len(hashes):
            stored = kv_pb2.BlockStored(
                block_hashes=[wire_hash(value) for value in hashes[first_new:]],
                token_ids=tokens[first_new * self.block_size : len(hashes) * self.block_size],
                block_size=self.block_size,
                lora_name=lora_name,
            )  # medium unset: the engine's own KV memory (llama.cpp's cache, in host memory on CPU)
            if first_new:
                stored.parent_block_hash.CopyFrom(wire_hash(hashes[first_new - 1]))
            self._events.append(kv_pb2.KvEvent(block_stored=stored))
        return hashes

    def remove(self, hashes: Sequence[bytes]) -> None:
        """A sequence (its `store` hashes) left the cache: its blocks no other sequence holds are removed."""
        gone = []
        for value in hashes:
            held = self._holders[value] - 1
            if held:
                self._holders[value] = held
            else:
                del self._holders[value]
                gone.append(value)
        if gone:
            removed = kv_pb2.BlockRemoved(block_hashes=[wire_hash(value) for value in gone])
            self._events.append(kv_pb2.KvEvent(block_removed=removed))

    def take_events(self) -> list[kv_pb2.KvEvent]:
        events, self._events = self._events, []
        return events


def batch(sequence_number: int, rank: int, events: Sequence[kv_pb2.KvEvent]) -> kv_pb2.KvEventBatch:
    return kv_pb2.KvEventBatch(
        sequence_number=sequence_number,
        timestamp_unix_nanos=time.time_ns(),
        data_parallel_rank=rank,
        events=events,
    )


class BlockChange(NamedTuple):
    """One block's change in KV events: stored (after `parent`, b"" for a first block, holding `tokens`) or
    removed; `block` b"": every block was cleared. `lora_name`: the adapter a stored block's KV was computed with."""

    block: bytes
    stored: bool = False
    parent: bytes = b""
    tokens: Sequence[int] = ()
    lora_name: str = ""


def block_changes(events: Iterable[kv_pb2.KvEvent]) -> Iterator[BlockChange]:
    """The events as changes of single blocks, in order (a BlockStored of a chain stores a parent before its
    children)."""
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            parent, size = stored.parent_block_hash.value, stored.block_size
            for index, block in enumerate(stored.block_hashes):
                tokens = stored.token_ids[index * size : (index + 1) * size]
                yield BlockChange(block.value, True, parent, tokens, stored.lora_name)
                parent = block.value
        elif kind == "block_removed":
            for block in event.block_removed.block_hashes:
                yield BlockChange(block.value)
        elif kind == "all_blocks_cleared":
            yield BlockChange(b"")
