"""tests.microbench.reserve_wait: the real ReservationBatcher against a coordinator answering after a fixed delay."""

from __future__ import annotations

from . import reserve_wait


async def test_every_reservation_is_answered_no_sooner_than_the_round_trip_and_releases_ride_along():
    result = await reserve_wait.measure(rate=200, hold_s=0.01, rtt_s=0.003, duration_s=0.3)
    assert result["reservations"] > 20
    assert 3.0 <= result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
    # every reservation and release went out, some of them together
    assert result["reservations"] <= result["batches"] < 2 * result["reservations"]
