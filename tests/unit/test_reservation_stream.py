"""The batched Reserve/Release of the frontend (frontend/reservation_stream.py), over a scripted stream: no network."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.frontend.reservation_stream import ReservationBatcher, ReservationRefused, StreamBroken

from .frontend_fakes import QueuedReplies, node_entry, rpc_error, settle


class ScriptedCall(QueuedReplies):
    """Records every batch written; the test answers them (`answer`) or breaks the stream (`fail`)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[cluster_pb2.ReservationBatch] = []

    async def write(self, batch) -> None:
        if self.cancelled:
            raise rpc_error(grpc.StatusCode.CANCELLED)
        self.written.append(batch)

    def answer(self, *outcomes: cluster_pb2.ReservationOutcome) -> None:
        self.replies.put_nowait(cluster_pb2.ReservationReplies(outcome=outcomes))

    def fail(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.replies.put_nowait(rpc_error(code, "connection reset"))


class Streams:
    def __init__(self) -> None:
        self.calls: list[ScriptedCall] = []

    def open(self) -> ScriptedCall:
        self.calls.append(ScriptedCall())
        return self.calls[-1]


def reservation(request_id: str, owner: str = "") -> cluster_pb2.ReserveRequest:
    return cluster_pb2.ReserveRequest(request_id=request_id, frontend_id="fe-1", routing_key="k", owner=owner)


@pytest.fixture
async def streams():
    yield Streams()


@pytest.fixture
async def batcher(streams: Streams):
    batcher = ReservationBatcher("fe-1", streams.open)
    yield batcher
    await batcher.close()


async def test_reservations_of_one_tick_go_out_as_one_batch_and_are_answered_in_order(batcher, streams):
    n0, n1 = node_entry("n0"), node_entry("n1", rank=1)
    waiting = [asyncio.create_task(batcher.reserve(reservation(f"r{i}", owner=f"key-{i}"))) for i in range(3)]
    await settle()
    [call] = streams.calls
    [batch] = call.written
    assert batch.frontend_id == "fe-1"
    assert [r.request_id for r in batch.reserve] == ["r0", "r1", "r2"]
    assert [r.owner for r in batch.reserve] == ["key-0", "key-1", "key-2"]  # the owner rides per reservation
    assert all(r.frontend_id == "" for r in batch.reserve)  # named once, by the batch
    call.answer(
        cluster_pb2.ReservationOutcome(node=n0),
        cluster_pb2.ReservationOutcome(refusal_code=grpc.StatusCode.ALREADY_EXISTS.value[0], refusal="dup"),
        cluster_pb2.ReservationOutcome(node=n1),
    )
    assert await waiting[0] == n0
    with pytest.raises(ReservationRefused, match="dup") as refused:
        await waiting[1]
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert await waiting[2] == n1


async def first_reservation_answered(batcher: ReservationBatcher, streams: Streams) -> ScriptedCall:
    """Reserves "r0" on a new stream and answers it; returns the stream's call."""
    first = asyncio.create_task(batcher.reserve(reservation("r0")))
    await settle()
    [call] = streams.calls
    call.answer(cluster_pb2.ReservationOutcome(node=node_entry("n0")))
    await first
    return call


async def test_a_release_rides_on_the_next_batch_and_a_tick_of_releases_alone_is_one_message(batcher, streams):
    call = await first_reservation_answered(batcher, streams)
    batcher.release("r0")
    second = asyncio.create_task(batcher.reserve(reservation("r1")))
    await settle()
    assert len(call.written) == 2
    assert list(call.written[1].release) == ["r0"] and [r.request_id for r in call.written[1].reserve] == ["r1"]
    call.answer(cluster_pb2.ReservationOutcome(node=node_entry("n0")))
    await second
    batcher.release("r1")
    batcher.release("r0-again")
    await settle()
    assert [list(b.release) for b in call.written[2:]] == [["r1", "r0-again"]]
    assert batcher.streams_opened == 1


async def test_while_a_write_is_slow_the_next_ticks_gather_into_one_batch(streams):
    gate = asyncio.Event()

    class SlowCall(ScriptedCall):
        async def write(self, batch) -> None:
            await super().write(batch)
            if len(self.written) == 1:
                await gate.wait()

    batcher = ReservationBatcher("fe-1", lambda: streams.calls.append(SlowCall()) or streams.calls[-1])
    tasks = [asyncio.create_task(batcher.reserve(reservation("r0")))]
    await settle()
    for i in range(1, 4):  # three later ticks while the first write is stuck
        tasks.append(asyncio.create_task(batcher.reserve(reservation(f"r{i}"))))
        await asyncio.sleep(0)
    gate.set()
    await settle()
    [call] = streams.calls
    assert [[r.request_id for r in b.reserve] for b in call.written] == [["r0"]]  # r0's answer is still due
    call.answer(cluster_pb2.ReservationOutcome(node=node_entry("n0")))
    await settle()
    assert [[r.request_id for r in b.reserve] for b in call.written] == [["r0"], ["r1", "r2", "r3"]]
    for task in tasks:
        task.cancel()
    await batcher.close()


async def test_while_a_batch_is_unanswered_later_ticks_gather_and_go_out_once_it_is_answered(batcher, streams):
    first = asyncio.create_task(batcher.reserve(reservation("r0")))
    await settle()
    [call] = streams.calls
    assert len(call.written) == 1  # an idle stream sends at once
    later = []
    for i in range(1, 4):  # three later ticks, one reservation each, while r0 is unanswered
        later.append(asyncio.create_task(batcher.reserve(reservation(f"r{i}"))))
        await asyncio.sleep(0)
    batcher.release("gone")
    await settle()
    assert len(call.written) == 1
    call.answer(cluster_pb2.ReservationOutcome(node=node_entry("n0")))
    assert (await first).node_id == "n0"
    await settle()
    assert [r.request_id for r in call.written[1].reserve] == ["r1", "r2", "r3"]
    assert list(call.written[1].release) == ["gone"]
    call.answer(*(cluster_pb2.ReservationOutcome(node=node_entry(f"n{i}")) for i in range(1, 4)))
    assert [(await task).node_id for task in later] == ["n1", "n2", "n3"]
    assert len(call.written) == 2


async def test_a_reservation_does_not_wait_behind_an_unanswered_batch_of_releases_alone(batcher, streams):
    call = await first_reservation_answered(batcher, streams)
    batcher.release("r0")
    await settle()
    assert [list(b.release) for b in call.written] == [[], ["r0"]]  # the release alone, unanswered
    batcher.release("r-later")
    await settle()
    assert len(call.written) == 2  # releases alone still wait for the unanswered batch
    second = asyncio.create_task(batcher.reserve(reservation("r1")))
    await settle()
    assert len(call.written) == 3  # the reservation went out at once, the waiting release riding on it
    assert [r.request_id for r in call.written[2].reserve] == ["r1"] and list(call.written[2].release) == ["r-later"]
    call.answer()  # the releases' batch, then the reservation's: replies in order
    call.answer(cluster_pb2.ReservationOutcome(node=node_entry("n1")))
    assert (await second).node_id == "n1"


async def test_a_large_tick_is_split_into_batches_of_at_most_max_batch(streams):
    batcher = ReservationBatcher("fe-1", streams.open, max_batch=2, max_unanswered=3)
    tasks = [asyncio.create_task(batcher.reserve(reservation(f"r{i}"))) for i in range(5)]
    await settle()
    assert [len(b.reserve) for b in streams.calls[0].written] == [2, 2, 1]
    await batcher.close()
    for task in tasks:
        with pytest.raises(StreamBroken):
            await task


async def test_the_stream_breaking_mid_batch_fails_the_unanswered_keeps_the_answered_and_resends_releases(
    batcher, streams
):
    answered = asyncio.create_task(batcher.reserve(reservation("r0")))
    await settle()
    call = streams.calls[0]
    batcher.release("old")
    pending = [asyncio.create_task(batcher.reserve(reservation(f"r{i}"))) for i in (1, 2)]
    await settle()
    call.answer(cluster_pb2.ReservationOutcome(node=node_entry("n0")))
    await settle()
    assert len(call.written) == 2  # the second batch is on the wire, unanswered
    call.fail()
    assert (await answered).node_id == "n0"  # accepted before the break: unaffected
    for task in pending:
        with pytest.raises(StreamBroken, match="UNAVAILABLE"):
            await task
    assert call.cancelled
    assert batcher.pending_releases == 1  # "old" was never acknowledged: kept for the next stream

    batcher.flush()  # e.g. the next heartbeat: a new stream carries the kept release
    await settle()
    assert len(streams.calls) == 2
    assert [list(b.release) for b in streams.calls[1].written] == [["old"]]


async def test_a_write_that_fails_fails_its_reservations_and_the_next_reservation_opens_a_new_stream(streams):
    batcher = ReservationBatcher("fe-1", streams.open, max_unanswered=2)  # a second batch goes out unanswered
    first = asyncio.create_task(batcher.reserve(reservation("r0")))
    await settle()
    streams.calls[0].cancelled = True  # the next write raises
    second = asyncio.create_task(batcher.reserve(reservation("r1")))
    with pytest.raises(StreamBroken):
        await second
    with pytest.raises(StreamBroken):
        await first  # written on the same stream, never answered
    third = asyncio.create_task(batcher.reserve(reservation("r2")))
    await settle()
    assert len(streams.calls) == 2
    streams.calls[1].answer(cluster_pb2.ReservationOutcome(node=node_entry("n2")))
    assert (await third).node_id == "n2"
    await batcher.close()


async def test_a_reservation_whose_caller_left_before_the_answer_is_skipped(batcher, streams):
    gone = asyncio.create_task(batcher.reserve(reservation("r0")))
    stays = asyncio.create_task(batcher.reserve(reservation("r1")))
    await settle()
    gone.cancel()
    streams.calls[0].answer(
        cluster_pb2.ReservationOutcome(node=node_entry("n0")), cluster_pb2.ReservationOutcome(node=node_entry("n1"))
    )
    assert (await stays).node_id == "n1"
    assert gone.cancelled()


async def test_the_coordinator_ending_the_stream_fails_what_it_did_not_answer(batcher, streams):
    waiting = asyncio.create_task(batcher.reserve(reservation("r0")))
    await settle()
    streams.calls[0].replies.put_nowait(grpc.aio.EOF)
    with pytest.raises(StreamBroken, match="ended the stream"):
        await waiting


async def test_releases_are_split_like_reservations_and_only_so_many_are_kept_after_a_break(streams, monkeypatch):
    monkeypatch.setattr(ReservationBatcher, "max_kept_riders", 3)
    batcher = ReservationBatcher("fe-1", streams.open, max_batch=2, max_unanswered=3)
    for i in range(5):
        batcher.release(f"r{i}")
    await settle()
    assert [list(b.release) for b in streams.calls[0].written] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    streams.calls[0].fail()
    await settle()
    assert batcher.pending_releases == 3  # the newest three of five unacknowledged releases
    batcher.flush()
    await settle()
    assert [list(b.release) for b in streams.calls[1].written] == [["r2", "r3"], ["r4"]]
    await batcher.close()


async def test_a_stream_that_cannot_even_open_fails_the_batch_at_once():
    def refuse():
        raise RuntimeError("channel closed")

    batcher = ReservationBatcher("fe-1", refuse)
    waiting = asyncio.create_task(batcher.reserve(reservation("r0")))
    batcher.release("old")
    with pytest.raises(StreamBroken, match="channel closed"):
        await asyncio.wait_for(waiting, 1.0)
    assert batcher.pending_releases == 1
    await batcher.close()


async def test_a_reservation_unanswered_past_its_timeout_raises_timeout_error_and_is_never_answered_or_sent_late(
    batcher, streams
):
    late = asyncio.create_task(batcher.reserve(reservation("r0"), timeout_s=0.05))
    await settle()
    queued = asyncio.create_task(batcher.reserve(reservation("r1"), timeout_s=0.05))  # waits behind r0's batch
    await settle()
    with pytest.raises(TimeoutError):
        await late
    with pytest.raises(TimeoutError):
        await queued
    [call] = streams.calls
    call.answer(cluster_pb2.ReservationOutcome(node=node_entry("n0")))  # r0's answer, too late: dropped
    in_time = asyncio.create_task(batcher.reserve(reservation("r2"), timeout_s=5.0))
    await settle()
    assert [[r.request_id for r in b.reserve] for b in call.written] == [["r0"], ["r2"]]  # r1 is not sent late
    call.answer(cluster_pb2.ReservationOutcome(node=node_entry("n2")))
    assert (await in_time).node_id == "n2"
