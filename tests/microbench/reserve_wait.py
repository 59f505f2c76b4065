"""The batched Reserve's own wait, without the machine's noise: the frontend's real ReservationBatcher against a
stand-in coordinator stream that answers every batch after a fixed round trip (asyncio timers, no CPU load).

    python -m tests.microbench.reserve_wait --rate 40 --hold-s 0.26 --rtt-ms 2 --duration-s 10

Poisson reservations at `--rate`, each released `--hold-s` later (a request's life at the bench's fixed load);
prints the reservations' latency (call to answer) p50/p90/p99/max and the batches sent. Run it with
PYTHONPATH pointing at another build to compare two batchers (docs/benchmarks.md, "TTFT: where the first
token's time goes").
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from openengine_bench import report
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.frontend.reservation_stream import ReservationBatcher


class AnsweringCall:
    """A Reservations call whose coordinator answers each batch `rtt_s` after it was written, in order."""

    def __init__(self, rtt_s: float) -> None:
        self.rtt_s = rtt_s
        self.replies: asyncio.Queue = asyncio.Queue()
        self.node = cluster_pb2.NodeEntry(node_id="n0", address="127.0.0.1:1")

    async def write(self, batch: cluster_pb2.ReservationBatch) -> None:
        reply = cluster_pb2.ReservationReplies(
            outcome=[cluster_pb2.ReservationOutcome(node=self.node) for _ in batch.reserve]
        )
        asyncio.get_running_loop().call_later(self.rtt_s, self.replies.put_nowait, reply)

    async def read(self):
        return await self.replies.get()

    def cancel(self) -> bool:
        return True


async def measure(
    rate: float, hold_s: float, rtt_s: float, duration_s: float, max_unanswered: int = 0, seed: int = 1
) -> dict:
    """`max_unanswered` 0: the batcher's default."""
    options = {"max_unanswered": max_unanswered} if max_unanswered else {}
    batcher = ReservationBatcher("fe-1", lambda: AnsweringCall(rtt_s), **options)
    arrivals = random.Random(seed)
    latencies: list[float] = []

    async def one(request_id: str) -> None:
        started = time.monotonic()
        await batcher.reserve(cluster_pb2.ReserveRequest(request_id=request_id, routing_key="k"))
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(hold_s)
        batcher.release(request_id)

    tasks = []
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        tasks.append(asyncio.create_task(one(f"r{len(tasks)}")))
        await asyncio.sleep(arrivals.expovariate(rate))
    await asyncio.gather(*tasks)
    await batcher.close()
    ms = lambda q: round(report.percentile(latencies, q) * 1000, 2)  # noqa: E731
    return {
        "reservations": len(latencies),
        "batches": batcher.batches_sent,
        "p50_ms": ms(50),
        "p90_ms": ms(90),
        "p99_ms": ms(99),
        "max_ms": round(max(latencies) * 1000, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=40.0, help="reservations per second (default 40)")
    parser.add_argument("--hold-s", type=float, default=0.26, help="reservation to release (default 0.26 s)")
    parser.add_argument("--rtt-ms", type=float, default=2.0, help="the coordinator's round trip (default 2 ms)")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument(
        "--max-unanswered", type=int, default=0, help="batches out unanswered (default: the batcher's own)"
    )
    args = parser.parse_args(argv)
    print(asyncio.run(measure(args.rate, args.hold_s, args.rtt_ms / 1000, args.duration_s, args.max_unanswered)))


if __name__ == "__main__":
    main()
