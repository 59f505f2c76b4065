"""node/kv_events.py: numbered batches, the snapshot, replay from a kept batch, and a subscriber that falls
behind."""

from __future__ import annotations

import asyncio

import pytest

from openengine_serve.common.kv_blocks import BLOCK_SIZE, BlockLedger
from openengine_serve.node import kv_events
from openengine_serve.node.kv_events import FellBehind, KvEventLog, ReplayUnavailable

from .test_kv_blocks import replay


def tokens(first: int, blocks: int) -> list[int]:
    return [first] * BLOCK_SIZE + list(range(1000, 1000 + (blocks - 1) * BLOCK_SIZE))


def next_batch(subscription):
    return asyncio.run(asyncio.wait_for(subscription.next(), 5))


def stepped(log: KvEventLog, ledger: BlockLedger) -> None:
    log.record(ledger.take_events())


def test_batches_are_numbered_and_carry_the_rank():
    log, ledger = KvEventLog(rank=3), BlockLedger()
    log.record([])  # a step without events is no batch
    ledger.store("", tokens(1, 2))
    stepped(log, ledger)
    subscription = log.subscribe(include_snapshot=False, start_sequence_number=0)
    ledger.store("", tokens(2, 1))
    stepped(log, ledger)
    batch = next_batch(subscription)
    assert (batch.sequence_number, batch.data_parallel_rank) == (2, 3)
    assert log.sequence_number == 2 and log.blocks == 3


def test_a_snapshot_then_the_later_batches_rebuild_the_blocks_held():
    log, ledger = KvEventLog(rank=0), BlockLedger()
    held_a = ledger.store("", tokens(1, 3))
    ledger.store("", tokens(1, 2) + [5] * BLOCK_SIZE)
    stepped(log, ledger)
    ledger.remove(held_a)
    stepped(log, ledger)
    subscription = log.subscribe(include_snapshot=True, start_sequence_number=1)
    ledger.store("ns/", tokens(9, 2))
    stepped(log, ledger)
    held: dict = {"stale": (b"", [])}
    first = next_batch(subscription)
    assert first.sequence_number == 2  # the state after batch 2
    replay(first.events, held)
    replay(next_batch(subscription).events, held)
    assert len(held) == len(ledger) == log.blocks == 5


def test_replay_from_a_kept_batch_and_refusal_of_one_no_longer_kept(monkeypatch):
    monkeypatch.setattr(kv_events, "KEPT_BATCHES", 3)
    log, ledger = KvEventLog(rank=0), BlockLedger()
    for first in range(5):
        ledger.store("", tokens(first, 1))
        stepped(log, ledger)
    subscription = log.subscribe(include_snapshot=False, start_sequence_number=4)
    assert [next_batch(subscription).sequence_number for _ in range(2)] == [4, 5]
    with pytest.raises(ReplayUnavailable, match="keeps batches 3 to 5"):
        log.subscribe(include_snapshot=False, start_sequence_number=2)
    with pytest.raises(ReplayUnavailable):
        log.subscribe(include_snapshot=False, start_sequence_number=7)
    assert log.subscribe(include_snapshot=False, start_sequence_number=6)  # the next batch: nothing to replay


def test_the_batches_kept_and_a_subscribers_backlog_are_bounded_in_bytes(monkeypatch):
    monkeypatch.setattr(kv_events, "KEPT_BYTES", 3 * 1024)
    log, ledger = KvEventLog(rank=0), BlockLedger()
    subscription = log.subscribe(include_snapshot=False, start_sequence_number=0)
    for first in range(12):
        ledger.store("", tokens(first, 8))  # about 600 bytes a batch
        stepped(log, ledger)
    first = next_batch(subscription)
    fit = 3 * 1024 // first.ByteSize()  # batches of one size (the same blocks and tokens but the first)
    assert 2 <= fit < 12
    with pytest.raises(ReplayUnavailable, match=f"keeps batches {12 - fit + 1} to 12"):
        log.subscribe(include_snapshot=False, start_sequence_number=1)
    assert [next_batch(subscription).sequence_number for _ in range(fit - 1)] == list(range(2, fit + 1))
    with pytest.raises(FellBehind):
        next_batch(subscription)


def test_a_subscriber_that_keeps_up_is_never_ended(monkeypatch):
    monkeypatch.setattr(kv_events, "KEPT_BYTES", 3 * 1024)
    log, ledger = KvEventLog(rank=0), BlockLedger()
    subscription = log.subscribe(include_snapshot=False, start_sequence_number=0)
    for first in range(40):  # about 24 KB in all
        ledger.store("", tokens(first, 8))
        stepped(log, ledger)
        assert next_batch(subscription).sequence_number == first + 1


def test_a_subscriber_that_falls_behind_is_ended_after_what_it_was_sent(monkeypatch):
    monkeypatch.setattr(kv_events, "SUBSCRIBER_BACKLOG", 2)
    log, ledger = KvEventLog(rank=0), BlockLedger()
    subscription = log.subscribe(include_snapshot=False, start_sequence_number=0)
    for first in range(4):
        ledger.store("", tokens(first, 1))
        stepped(log, ledger)

    read = []
    with pytest.raises(FellBehind):
        while True:
            read.append(next_batch(subscription).sequence_number)
    assert read == [1, 2]
    subscription.close()
    assert not log.subscriptions


def test_a_new_worker_starts_from_no_blocks():
    log, ledger = KvEventLog(rank=0), BlockLedger()
    ledger.store("", tokens(1, 2))
    stepped(log, ledger)
    log.clear()
    assert log.blocks == 0
    held: dict = {}
    replay(log.snapshot().events, held)
    assert held == {}
