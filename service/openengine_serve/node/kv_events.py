"""The node's KV events: its engine's prefix cache reports the blocks it stores and removes with each step
(common/kv_blocks.py); the node numbers them in batches, keeps the last `KEPT_BATCHES` for a subscriber who
comes back (`start_sequence_number`), mirrors the blocks held now (a subscriber's snapshot), and hands each batch
to the open subscriptions (`Node.KvEvents`, which the frontends' `SubscribeKvEvents` and the coordinator read).

The batches kept hold at most `KEPT_BYTES` (a batch carries its new blocks' tokens: a long prompt's is tens of
KB). A subscription that falls `SUBSCRIBER_BACKLOG` batches or `KEPT_BYTES` behind is ended (it would otherwise
hold the node's memory without bound); its reader subscribes again with a snapshot.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Sequence

from openengine_serve.api.openengine.v1 import kv_pb2
from openengine_serve.common.kv_blocks import KEPT_BATCHES, batch, block_changes, wire_hash

SUBSCRIBER_BACKLOG = 4096
KEPT_BYTES = 16 << 20


class ReplayUnavailable(LookupError):
    """The start asked for is older than the batches kept (or newer than the last one)."""


class FellBehind(Exception):
    """The subscriber read too slowly: its backlog reached SUBSCRIBER_BACKLOG batches or KEPT_BYTES."""


class Subscription:
    def __init__(self, log: KvEventLog, first: Iterable[kv_pb2.KvEventBatch]) -> None:
        self._log = log
        self._pending: deque[tuple[kv_pb2.KvEventBatch, int]] = deque((b, b.ByteSize()) for b in first)
        self._pending_bytes = sum(size for _, size in self._pending)
        self._arrived = asyncio.Event()
        self.fell_behind = False

    def put(self, kv_batch: kv_pb2.KvEventBatch, size: int) -> None:
        if len(self._pending) >= SUBSCRIBER_BACKLOG or self._pending_bytes + size > KEPT_BYTES:
            self.fell_behind = True
        else:
            self._pending.append((kv_batch, size))
            self._pending_bytes += size
        self._arrived.set()

    async def next(self) -> kv_pb2.KvEventBatch:
        """The next batch; raises FellBehind once the backlog overflowed."""
        while not self._pending:
            if self.fell_behind:
                raise FellBehind(
                    f"the subscriber fell {SUBSCRIBER_BACKLOG} batches or {KEPT_BYTES >> 20} MiB of events behind"
                )
            self._arrived.clear()
            await self._arrived.wait()
        kv_batch, size = self._pending.popleft()
        self._pending_bytes -= size
        return kv_batch

    def close(self) -> None:
        self._log.subscriptions.discard(self)


class KvEventLog:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sequence_number = 0  # of the last batch
        self.subscriptions: set[Subscription] = set()
        self._kept: deque[tuple[kv_pb2.KvEventBatch, int]] = deque()  # with their sizes, the oldest first
        self._kept_bytes = 0
        # block hash -> (its parent's hash or b"", its tokens), in the order stored: a parent before its children
        self._held: dict[bytes, tuple[bytes, list[int], str]] = {}  # block -> (parent, tokens, LoRA adapter)

    @property
    def blocks(self) -> int:
        return len(self._held)

    def record(self, events: Sequence[kv_pb2.KvEvent]) -> None:
        """One engine step's events (none: nothing happens)."""
        if not events:
            return
        self._apply(events)
        self.sequence_number += 1
        kv_batch = batch(self.sequence_number, self.rank, events)
        size = kv_batch.ByteSize()
        self._kept.append((kv_batch, size))
        self._kept_bytes += size
        while len(self._kept) > KEPT_BATCHES or (self._kept_bytes > KEPT_BYTES and len(self._kept) > 1):
            self._kept_bytes -= self._kept.popleft()[1]
        for subscription in self.subscriptions:
            subscription.put(kv_batch, size)

    def clear(self) -> None:
        """The engine worker was replaced: its cache is empty."""
        self.record([kv_pb2.KvEvent(all_blocks_cleared=kv_pb2.AllBlocksCleared())])

    def subscribe(self, include_snapshot: bool, start_sequence_number: int) -> Subscription:
        """A subscription to the batches after the last one; first the snapshot, or the kept batches from
        `start_sequence_number` (ignored with a snapshot, which already holds them). Raises ReplayUnavailable."""
        if include_snapshot:
            first = [self.snapshot()]
        elif start_sequence_number:
            first = self._replay(start_sequence_number)
        else:
            first = []
        subscription = Subscription(self, first)
        self.subscriptions.add(subscription)
        return subscription

    def snapshot(self) -> kv_pb2.KvEventBatch:
        """One batch that, applied to any state, leaves the blocks held now: AllBlocksCleared, then every block
        stored (a parent before its children). Numbered as the last batch, whose state it is."""
        events = [kv_pb2.KvEvent(all_blocks_cleared=kv_pb2.AllBlocksCleared())]
        for value, (parent, tokens, lora_name) in self._held.items():
            stored = kv_pb2.BlockStored(
                block_hashes=[wire_hash(value)], token_ids=tokens, block_size=len(tokens), lora_name=lora_name
            )
            if parent:
                stored.parent_block_hash.CopyFrom(wire_hash(parent))
            events.append(kv_pb2.KvEvent(block_stored=stored))
        return batch(self.sequence_number, self.rank, events)

    def _replay(self, start: int) -> list[kv_pb2.KvEventBatch]:
        oldest = self._kept[0][0].sequence_number if self._kept else self.sequence_number + 1
        if start > self.sequence_number + 1 or start < oldest:
            raise ReplayUnavailable(
                f"start_sequence_number {start} is not held: this node keeps batches {oldest} to "
                f"{self.sequence_number} (the next is {self.sequence_number + 1}); subscribe with include_snapshot"
            )
        return [kv_batch for kv_batch, _ in list(self._kept)[start - oldest :]]

    def _apply(self, events: Sequence[kv_pb2.KvEvent]) -> None:
        for change in block_changes(events):
            if not change.block:
                self._held.clear()
            elif change.stored:
                self._held[change.block] = (change.parent, list(change.tokens), change.lora_name)
            else:
                self._held.pop(change.block, None)
