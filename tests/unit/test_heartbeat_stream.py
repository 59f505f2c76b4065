"""A peer's heartbeat stream to one coordinator (common/heartbeat_stream.py), over scripted streams: no network."""

from __future__ import annotations

import grpc
import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.heartbeat_stream import BACKOFF_FIRST_S, HeartbeatFailed, HeartbeatStream

from .frontend_fakes import QueuedReplies, rpc_error

HEARTBEAT = cluster_pb2.NodeHeartbeatRequest(node_id="n1", state=cluster_pb2.NODE_STATE_READY)


class ScriptedCall(QueuedReplies):
    """Answers each heartbeat written with the next scripted reply (or error); nothing scripted: no answer."""

    def __init__(self, script: list) -> None:
        super().__init__()
        self.written: list = []
        self.script = script

    async def write(self, message) -> None:
        if self.cancelled:
            raise rpc_error(grpc.StatusCode.CANCELLED, "call cancelled")
        self.written.append(message)
        if self.script:
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


@pytest.mark.parametrize("failure, code", [
    (rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset"), grpc.StatusCode.UNAVAILABLE),
    (grpc.aio.EOF, grpc.StatusCode.UNAVAILABLE),  # the coordinator ended the stream
    (None, grpc.StatusCode.DEADLINE_EXCEEDED),  # no reply at all
])
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
