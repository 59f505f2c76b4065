"""Token and inter-token metrics added once per event-loop iteration equal one update per delta."""

from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry, Counter, Histogram

from openengine_serve.frontend.metrics import _LATENCY, DeltaMetrics


def _pair(registry: CollectorRegistry):
    return (
        Counter("t_tokens", "tokens", registry=registry),
        Histogram("t_itl", "gaps", buckets=_LATENCY, registry=registry),
    )


def _samples(registry: CollectorRegistry) -> dict:
    """Every sample but the creation times; sums rounded (added in another order, they differ in the last bits)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): round(s.value, 9)
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


async def test_batched_updates_expose_what_one_observe_per_delta_exposes():
    rng = random.Random(3)
    deltas = [
        (
            rng.randrange(1, 4),
            None if i % 17 == 0 else rng.choice([0.0, 0.001, 0.0025, 0.002, 20.0, rng.random() * 0.3]),
        )
        for i in range(500)
    ]
    direct, batched = CollectorRegistry(), CollectorRegistry()
    tokens, gaps = _pair(direct)
    for count, gap in deltas:
        tokens.inc(count)
        if gap is not None:
            gaps.observe(gap)
    tally = DeltaMetrics(*_pair(batched))
    for n, (count, gap) in enumerate(deltas):
        tally.add(count, gap)
        if n % 50 == 0:
            await asyncio.sleep(0)  # a flush in between, as between engine steps
    assert _samples(batched) != _samples(direct), "nothing is flushed before the loop runs"
    await asyncio.sleep(0)
    assert _samples(batched) == _samples(direct)


async def test_without_bucket_access_every_value_is_observed():
    class Plain:  # a histogram offering only observe()
        def __init__(self) -> None:
            self.values = []

        def observe(self, value):
            self.values.append(value)

    counter = Counter("t_plain_tokens", "tokens", registry=CollectorRegistry())
    plain = Plain()
    tally = DeltaMetrics(counter, plain)
    tally.add(2, 0.5)
    tally.add(1)
    tally.add(1, 0.25)
    await asyncio.sleep(0)
    assert plain.values == [0.5, 0.25] and counter._value.get() == 4
