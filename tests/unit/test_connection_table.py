"""limits.ConnectionTable: which connections get calls admitted, and when a place frees."""

from __future__ import annotations

from openengine_serve.frontend.limits import ConnectionTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def peer(port: int) -> str:
    return f"ipv4:127.0.0.1:{port}"


def test_connections_beyond_the_limit_are_refused_until_one_is_gone():
    clock = Clock()
    table = ConnectionTable(2, 0.0, local_port=1, closes=False, clock=clock)
    assert table.call_started(peer(1000)) and table.call_started(peer(1001))
    assert table.call_started(peer(1000))  # another call on an admitted connection
    assert not table.call_started(peer(1002))
    assert "OPENENGINE_MAX_CONNECTIONS" in table.refusal and "maximum of 2 " in table.refusal
    for _ in range(2):
        table.call_ended(peer(1000))
    table.call_ended(peer(1001))
    clock.now += 1
    table.sweep({("127.0.0.1", 1000), ("127.0.0.1", 1002)}, scanned_at=clock.now)  # 1001 has gone
    assert table.call_started(peer(1002))
    assert not table.call_started(peer(1003))


def test_a_connection_with_a_call_open_or_newer_than_the_scan_is_kept():
    clock = Clock()
    table = ConnectionTable(2, 0.0, local_port=1, closes=False, clock=clock)
    table.call_started(peer(1000))  # still open when the scan misses it
    clock.now += 0.5
    scanned_at = clock.now
    clock.now += 0.5
    table.call_started(peer(1001))  # admitted while the scan ran: not in its table yet
    table.call_ended(peer(1001))
    table.sweep(set(), scanned_at)
    assert not table.call_started(peer(1002))


def test_probes_are_answered_beyond_the_limit_without_taking_a_place():
    clock = Clock()
    table = ConnectionTable(1, 0.0, local_port=1, closes=False, clock=clock)
    assert table.call_started(peer(1000), capped=False)
    assert table.call_started(peer(1001))
    assert table.call_started(peer(1000), capped=False)
    assert not table.call_started(peer(1000))
