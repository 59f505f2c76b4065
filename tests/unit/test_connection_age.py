"""OPENENGINE_MAX_CONNECTION_AGE_S on pygrpc-native (frontend/connection_age.py): which connections are
refused and closed when, and closing a real loopback connection found by its gRPC peer string."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from openengine_serve.frontend import connection_age
from openengine_serve.frontend.connection_age import QUIET_S, ConnectionAges, PeerSockets, peer_address

PEER = "ipv4:10.0.0.7:40000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_young_connection_admits_calls_and_is_not_due():
    clock = Clock()
    ages = ConnectionAges(10.0, 50051, clock)
    assert ages.open(PEER)
    clock.now += 9.9
    assert ages.open(PEER)
    assert ages.due([PEER]) == []


def test_an_aged_connection_refuses_new_calls_and_waits_for_its_open_ones():
    clock = Clock()
    ages = ConnectionAges(10.0, 50051, clock)
    assert ages.open(PEER)  # a long call, still open at the age
    clock.now += 10.0
    assert not ages.open(PEER)  # refused: not started
    clock.now += 1.0
    assert ages.due([PEER]) == []  # the open call runs to its end first
    ages.close(PEER)
    assert ages.due([PEER]) == []  # its response may still be leaving
    clock.now += QUIET_S * 1.01
    assert ages.due([PEER]) == [PEER]


def one_call_ended() -> tuple[Clock, ConnectionAges]:
    """A connection with a maximum age of 1 s whose one call has ended."""
    clock = Clock()
    ages = ConnectionAges(1.0, 50051, clock)
    assert ages.open(PEER)
    ages.close(PEER)
    return clock, ages


def test_refused_calls_do_not_keep_a_connection_from_closing():
    clock, ages = one_call_ended()
    clock.now += 1.0
    for _ in range(5):
        clock.now += QUIET_S / 4
        assert not ages.open(PEER)
    assert ages.due([PEER]) == [PEER]


def test_closed_connections_refuse_late_calls_then_are_forgotten():
    clock, ages = one_call_ended()
    clock.now += 2.0
    ages._mark_closed(PEER)
    assert not ages.open(PEER)  # a call that was already on its way
    clock.now += connection_age.FORGET_CLOSED_S
    assert ages.due([PEER]) == []
    assert ages.open(PEER)  # the same address again later is a new connection


def test_a_refusal_is_held_until_its_connection_is_closed():
    """So that a client's retry goes on a new connection, however long the close takes."""
    clock, ages = one_call_ended()
    clock.now += 1.0
    assert not ages.open(PEER)

    async def run() -> tuple[bool, float, float]:
        held = asyncio.create_task(ages.hold_refusal(PEER, hold_s=5.0))
        await asyncio.sleep(0.2)
        waiting = not held.done()
        ages._mark_closed(PEER)
        await asyncio.wait_for(held, 1.0)
        closed, other = "ipv4:10.0.0.8:40000", "ipv4:10.0.0.9:40000"
        ages.open(closed)
        ages.open(other)
        clock.now += 1.0
        ages._mark_closed(closed)
        assert not ages.open(closed) and not ages.open(other)
        started = time.monotonic()
        await ages.hold_refusal(closed, hold_s=5.0)  # a call on its way to a closed connection: answered at once
        after_close = time.monotonic() - started
        started = time.monotonic()
        await ages.hold_refusal(other, hold_s=0.1)  # never closed (its socket not found): answered after the hold
        return waiting, after_close, time.monotonic() - started

    waiting, after_close, never_closed = asyncio.run(run())
    assert waiting and after_close < 0.05 and 0.1 <= never_closed < 0.5


@pytest.mark.parametrize(
    "peer, address",
    [
        ("ipv4:10.1.2.3:5000", ("10.1.2.3", 5000)),
        ("ipv6:[::1]:5000", ("::1", 5000)),
        ("ipv6:[::ffff:10.1.2.3]:5000", ("10.1.2.3", 5000)),
        ("unix:/tmp/socket", None),
    ],
)
def test_peer_address(peer, address):
    assert peer_address(peer) == address


def test_a_connection_found_by_its_peer_is_shut_down_for_its_client():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    other = socket.create_connection(("127.0.0.1", port), timeout=5)
    accepted = [listener.accept()[0], listener.accept()[0]]
    try:
        host, client_port = client.getsockname()
        peer = f"ipv4:{host}:{client_port}"
        sockets = PeerSockets(port)
        found, gone = sockets.find([peer, "ipv4:127.0.0.1:1"])
        assert list(found) == [peer] and gone == ["ipv4:127.0.0.1:1"]
        found[peer].shutdown(socket.SHUT_RDWR)
        found[peer].close()  # the duplicate only: the original stays open
        assert client.recv(1) == b""  # the client sees the connection end
        other.sendall(b"x")
        assert accepted[1].recv(1) == b"x"  # the other connection is untouched
        accepted[0].fileno()  # and the original descriptor still exists
    finally:
        for sock in (listener, client, other, *accepted):
            sock.close()


def test_the_sweep_has_nothing_to_look_at_until_a_connection_can_be_due():
    clock = Clock()
    ages = ConnectionAges(10.0, 50051, clock)
    assert ages.next_check() is None  # no connection: the sweep sleeps until a call comes
    assert ages.open(PEER)
    assert ages.next_check() == 110.0  # its age
    clock.now = 110.0
    assert ages.due_now() == []  # a call still open: looked at again when it ends
    assert ages.next_check() is None
    ages.close(PEER)
    assert ages.next_check() == pytest.approx(110.0 + QUIET_S)
    clock.now += QUIET_S
    assert ages.due_now() == [PEER]


def test_the_sweep_loop_closes_an_aged_connection_without_polling(monkeypatch):
    """A real loop: the connection is closed about QUIET_S after its age, and an idle sweep never wakes."""
    swept: list[tuple[float, list[str]]] = []
    ages = ConnectionAges(0.2, 50051)
    monkeypatch.setattr(ages, "sweep", lambda due: swept.append((time.monotonic(), due)))
    wakes = 0
    due_now = ages.due_now

    def counted():
        nonlocal wakes
        wakes += 1
        return due_now()

    monkeypatch.setattr(ages, "due_now", counted)

    async def run() -> float:
        sweep = asyncio.create_task(ages.sweep_loop())
        await asyncio.sleep(0.3)
        assert wakes == 0  # no connection: nothing to look at
        opened = time.monotonic()
        assert ages.open(PEER)
        ages.close(PEER)
        await asyncio.sleep(0.4)
        sweep.cancel()
        return opened

    opened = asyncio.run(run())
    assert [due for _, due in swept] == [[PEER]]
    assert 0.2 <= swept[0][0] - opened < 0.35
    assert wakes <= 2  # at its age (and a wake-up for the check the open added)
