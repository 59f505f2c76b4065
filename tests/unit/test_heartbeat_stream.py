"""A peer's heartbeat stream to one coordinator and the loop around it (common/heartbeat_stream.py), over scripted
streams: no network."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.config import CoordinatorConfig
from openengine_serve.common.heartbeat_stream import (
    ACK_EVERY_S,
    BACKOFF_FIRST_S,
    HeartbeatFailed,
    HeartbeatStream,
    PeerHeartbeats,
)
from openengine_serve.coordinator.server import CoordinatorService

from .frontend_fakes import QueuedReplies, rpc_error

HEARTBEAT = cluster_pb2.NodeHeartbeatRequest(node_id="n1", state=cluster_pb2.NODE_STATE_READY)


class ScriptedCall(QueuedReplies):
    """Answers each heartbeat written with the next scripted reply (or error); nothing scripted: no answer. A
    heartbeat marked reply_optional is not answered (as a coordinator that honours it)."""

    def __init__(self, script: list) -> None:
        super().__init__()
        self.written: list = []
        self.script = script

    async def write(self, message) -> None:
        if self.cancelled:
            raise rpc_error(grpc.StatusCode.CANCELLED, "call cancelled")
        self.written.append(message)
        if self.script and not getattr(message, "reply_optional", False):
            self.replies.put_nowait(self.script.pop(0))


class Streams:
    def __init__(self, *scripts: list) -> None:
        self.scripts = list(scripts)
        self.calls: list[ScriptedCall] = []

    def open(self) -> ScriptedCall:
        self.calls.append(ScriptedCall(self.scripts.pop(0)))
        return self.calls[-1]


KNOWN = cluster_pb2.HeartbeatReply(known=True)


async def test_every_heartbeat_rides_the_same_stream_and_gets_its_reply():
    streams = Streams([KNOWN, cluster_pb2.HeartbeatReply(known=False), KNOWN])
    heartbeats = HeartbeatStream(streams.open, reply_timeout_s=1.0)
    assert [(await heartbeats.beat(HEARTBEAT)).known for _ in range(3)] == [True, False, True]
    assert heartbeats.streams_opened == 1 and len(streams.calls[0].written) == 3
    assert heartbeats.next_delay(1.0) == 1.0


@pytest.mark.parametrize(
    "failure, code",
    [
        (rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset"), grpc.StatusCode.UNAVAILABLE),
        (grpc.aio.EOF, grpc.StatusCode.UNAVAILABLE),  # the coordinator ended the stream
        (None, grpc.StatusCode.DEADLINE_EXCEEDED),  # no reply at all
    ],
)
async def test_a_failed_stream_is_cancelled_and_the_next_heartbeat_opens_a_new_one(failure, code):
    first = [KNOWN] + ([failure] if failure is not None else [])
    streams = Streams(first, [KNOWN])
    heartbeats = HeartbeatStream(streams.open, reply_timeout_s=0.05)
    await heartbeats.beat(HEARTBEAT)
    with pytest.raises(HeartbeatFailed) as failed:
        await heartbeats.beat(HEARTBEAT)
    assert failed.value.code == code
    assert streams.calls[0].cancelled and heartbeats.failures == 1
    assert (await heartbeats.beat(HEARTBEAT)).known
    assert heartbeats.streams_opened == 2 and heartbeats.failures == 0


async def test_after_failures_the_next_heartbeat_waits_a_growing_backoff_never_more_than_the_interval():
    never_answered = [[] for _ in range(8)]
    heartbeats = HeartbeatStream(Streams(*never_answered, [KNOWN]).open, reply_timeout_s=0.01, jitter=lambda: 1.0)
    delays = []
    for _ in range(8):
        with pytest.raises(HeartbeatFailed):
            await heartbeats.beat(HEARTBEAT)
        delays.append(heartbeats.next_delay(1.0))
    assert delays[:3] == [BACKOFF_FIRST_S, 2 * BACKOFF_FIRST_S, 4 * BACKOFF_FIRST_S]
    assert delays == sorted(delays) and delays[-1] == 1.0
    heartbeats.record_failure()  # e.g. the registration that follows failed too
    assert heartbeats.next_delay(1.0) == 1.0
    await heartbeats.beat(HEARTBEAT)
    assert heartbeats.next_delay(1.0) == 1.0, "a reply ends the backoff"
    # Jitter spreads peers over [half, all] of the backoff.
    jittered = HeartbeatStream(Streams().open, reply_timeout_s=0.01, jitter=lambda: 0.0)
    jittered.record_failure()
    assert jittered.next_delay(1.0) == BACKOFF_FIRST_S / 2


async def test_a_stream_that_cannot_be_opened_fails_the_heartbeat():
    def closed_channel():
        raise RuntimeError("the channel is closed")

    heartbeats = HeartbeatStream(closed_channel, reply_timeout_s=1.0)
    with pytest.raises(HeartbeatFailed) as failed:
        await heartbeats.beat(HEARTBEAT)
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "closed" in failed.value.detail
    assert heartbeats.failures == 1


QUIET_OK = cluster_pb2.HeartbeatReply(known=True)


def quiet_heartbeat() -> cluster_pb2.NodeHeartbeatRequest:
    heartbeat = cluster_pb2.NodeHeartbeatRequest()
    heartbeat.CopyFrom(HEARTBEAT)
    return heartbeat


async def test_quiet_heartbeats_skip_the_reply_once_the_stream_was_answered_and_ask_again_every_ack_period():
    clock = [100.0]
    streams = Streams([QUIET_OK] * 3)
    heartbeats = HeartbeatStream(streams.open, reply_timeout_s=1.0, now=lambda: clock[0])
    replies = []
    for _ in range(4):
        replies.append(await heartbeats.beat(quiet_heartbeat(), quiet=True))
        clock[0] += 1.0
    assert replies[0].known and replies[1:] == [None, None, None], "the first heartbeat of a stream asks"
    assert [h.reply_optional for h in streams.calls[0].written] == [False, True, True, True]
    clock[0] += ACK_EVERY_S
    assert (await heartbeats.beat(quiet_heartbeat(), quiet=True)).known, "a reply at least every ACK_EVERY_S"
    assert not streams.calls[0].written[-1].reply_optional
    assert (await heartbeats.beat(quiet_heartbeat(), quiet=False)).known, "not quiet (a drain): always asks"
    assert heartbeats.replies_skipped == 3 and heartbeats.streams_opened == 1


async def test_a_stream_the_coordinator_ended_is_reopened_and_its_first_heartbeat_asks():
    streams = Streams([QUIET_OK], [cluster_pb2.HeartbeatReply(known=False)], [QUIET_OK])
    heartbeats = HeartbeatStream(streams.open, reply_timeout_s=1.0)
    await heartbeats.beat(quiet_heartbeat(), quiet=True)
    streams.calls[0].ended_with = grpc.StatusCode.OK  # the coordinator forgot the node
    assert not (await heartbeats.beat(quiet_heartbeat(), quiet=True)).known
    assert heartbeats.streams_opened == 2 and heartbeats.failures == 0
    streams.calls[1].ended_with = grpc.StatusCode.UNAVAILABLE  # broken, not ended: the heartbeat fails
    with pytest.raises(HeartbeatFailed) as failed:
        await heartbeats.beat(quiet_heartbeat(), quiet=True)
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and heartbeats.failures == 1
    assert (await heartbeats.beat(quiet_heartbeat(), quiet=True)).known and heartbeats.streams_opened == 3


class PlaintextContext:
    """A call without internal TLS: no certificate names an instance."""

    def auth_context(self) -> dict:
        return {}


async def test_the_coordinator_answers_a_quiet_heartbeat_only_by_ending_the_stream_of_an_unknown_node():
    service = CoordinatorService(CoordinatorConfig())
    service.state.register_node(cluster_pb2.NodeEntry(node_id="n1", address="127.0.0.1:1"), 0)

    async def replies(*heartbeats):
        async def sent():
            for heartbeat in heartbeats:
                yield heartbeat

        return [reply async for reply in service.NodeHeartbeats(sent(), PlaintextContext())]

    def heartbeat(node_id, reply_optional):
        return cluster_pb2.NodeHeartbeatRequest(
            node_id=node_id, state=cluster_pb2.NODE_STATE_READY, reply_optional=reply_optional
        )

    answered = await replies(
        heartbeat("n1", False), heartbeat("n1", True), heartbeat("n1", True), heartbeat("n1", False)
    )
    assert [r.known for r in answered] == [True, True], "the two quiet heartbeats are not answered"
    assert service.state.node_entries()[0].state == cluster_pb2.NODE_STATE_READY, "a quiet heartbeat counts"
    # Unknown: a heartbeat that asks gets known=false; a quiet one ends the stream, unread ones after it too.
    assert [r.known for r in await replies(heartbeat("n2", False), heartbeat("n1", False))] == [False, True]
    assert await replies(heartbeat("n2", True), heartbeat("n1", False)) == []


# ------------------------------------------------------------------ the loop (PeerHeartbeats)

FORGOTTEN = cluster_pb2.HeartbeatReply(known=False)
DRAINING = cluster_pb2.NODE_STATE_DRAINING


class Peer:
    """A peer's hooks for PeerHeartbeats, writing down what the loop did. The interval is long: a heartbeat that
    comes within a test's few seconds came at once, after the backoff, or woken."""

    def __init__(self, streams: Streams, registrations: list | None = None, **options) -> None:
        self.events: list = []
        self.registrations = registrations or []  # each registration's result: an interval, or an error to raise
        self.state = cluster_pb2.NODE_STATE_READY
        self.loop = PeerHeartbeats(
            HeartbeatStream(streams.open, reply_timeout_s=1.0, jitter=lambda: 0.0),
            interval_s=60.0,
            register=self.register,
            heartbeat=self.heartbeat,
            on_reply=lambda heartbeat, reply: self.events.append(("reply", reply.known)),
            on_register_failed=lambda exc: self.events.append(("register failed", exc.code())),
            on_heartbeat_failed=lambda exc: self.events.append(("heartbeat failed", exc.code)),
            **options,
        )
        self.task = asyncio.create_task(self.loop.run())

    async def register(self):
        self.events.append("register")
        result = self.registrations.pop(0) if self.registrations else None
        if isinstance(result, Exception):
            raise result
        return result

    def heartbeat(self) -> cluster_pb2.NodeHeartbeatRequest:
        self.events.append("heartbeat")
        return cluster_pb2.NodeHeartbeatRequest(node_id="n1", state=self.state)

    async def settled(self, count: int) -> list:
        """The events, once there are `count` of them and no more came for a moment."""
        async with asyncio.timeout(3):
            while len(self.events) < count:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        return self.events

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


async def test_the_loop_registers_heartbeats_and_registers_again_at_once_when_forgotten():
    streams = Streams([FORGOTTEN, KNOWN, KNOWN])
    peer = Peer(streams)
    assert await peer.settled(6) == [
        "register",
        "heartbeat",
        ("reply", False),
        "register",
        "heartbeat",
        ("reply", True),
    ], "then waits the interval"
    assert peer.loop.interval_s == 60.0, "a registration that asks for no interval keeps the peer's"
    peer.loop.wake.set()  # e.g. a node's drain: the next heartbeat now
    assert (await peer.settled(8))[6:] == ["heartbeat", ("reply", True)]
    await peer.stop()
    assert streams.calls[0].cancelled, "the loop's end closes its stream"


async def test_a_peer_may_register_again_at_its_next_heartbeat_instead():
    peer = Peer(Streams([FORGOTTEN, KNOWN]), register_at_once_when_forgotten=False)
    assert await peer.settled(3) == ["register", "heartbeat", ("reply", False)]
    peer.loop.wake.set()
    assert (await peer.settled(6))[3:] == ["register", "heartbeat", ("reply", True)]
    await peer.stop()


async def test_a_failed_registration_counts_into_the_backoff_and_is_tried_again():
    unavailable = rpc_error(grpc.StatusCode.UNAVAILABLE, "no coordinator")
    peer = Peer(Streams([KNOWN]), registrations=[unavailable, None])
    # The second registration within the test's seconds: after the backoff's first step, not the interval.
    assert await peer.settled(5) == [
        "register",
        ("register failed", grpc.StatusCode.UNAVAILABLE),
        "register",
        "heartbeat",
        ("reply", True),
    ]
    assert peer.loop.stream.failures == 0 and peer.loop.stream.next_delay(60.0) == 60.0
    await peer.stop()


@pytest.mark.parametrize("register_after_failed_heartbeat", [False, True])
async def test_a_failed_heartbeat_is_told_and_the_next_goes_after_the_backoff(register_after_failed_heartbeat):
    streams = Streams([KNOWN, rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset")], [KNOWN])
    peer = Peer(streams, register_after_failed_heartbeat=register_after_failed_heartbeat)
    await peer.settled(3)
    peer.loop.wake.set()
    registers_again = ["register"] if register_after_failed_heartbeat else []
    assert (await peer.settled(7 + len(registers_again)))[3:] == [
        "heartbeat",
        ("heartbeat failed", grpc.StatusCode.UNAVAILABLE),
        *registers_again,
        "heartbeat",
        ("reply", True),
    ]
    assert peer.loop.stream.streams_opened == 2
    await peer.stop()


async def test_quiet_heartbeats_are_not_handed_a_reply_and_a_draining_one_is():
    streams = Streams([QUIET_OK, QUIET_OK])
    peer = Peer(streams, quiet=lambda heartbeat: heartbeat.state != DRAINING)
    await peer.settled(3)
    peer.loop.wake.set()
    assert (await peer.settled(4))[3:] == ["heartbeat"], "quiet: the reply skipped"
    peer.state = DRAINING
    peer.loop.wake.set()
    assert (await peer.settled(6))[4:] == ["heartbeat", ("reply", True)]
    assert [h.reply_optional for h in streams.calls[0].written] == [False, True, False]
    await peer.stop()


async def test_the_interval_is_the_one_the_registration_asked_for_when_it_asked():
    peer = Peer(Streams([KNOWN] * 3), registrations=[0.02])
    assert (await peer.settled(7))[:7] == ["register"] + ["heartbeat", ("reply", True)] * 3
    assert peer.loop.interval_s == 0.02
    await peer.stop()
