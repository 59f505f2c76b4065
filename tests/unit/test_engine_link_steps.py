"""The node's step receiver (node/engine_link.py) leaves the event loop to everything else while steps queue."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.node.engine_link import EngineLink

QUEUED_STEPS = 50


class QueuedSteps:
    """A ZMQ step socket with steps already queued: pyzmq answers recv with a future that is already done."""

    def __init__(self, count: int) -> None:
        self.left = count

    def recv(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.left:
            self.left -= 1
            future.set_result(cluster_pb2.EngineStep(step=QUEUED_STEPS - self.left).SerializeToString())
        return future  # none left: never done, like a socket with nothing to read


def test_queued_steps_leave_turns_to_the_other_tasks():
    async def main():
        order: list[str] = []
        link = EngineLink(step_ms=2, max_batch=4, max_queue=4, ranks=1, on_step=lambda step: order.append("step"))
        receiver = asyncio.create_task(
            link._receive_steps(SimpleNamespace(steps=QueuedSteps(QUEUED_STEPS), worker_pids=()))
        )

        async def other_calls():  # e.g. a lane's credit or a heartbeat reply waiting for its turn
            while len(order) < 2 * QUEUED_STEPS:
                order.append("other")
                await asyncio.sleep(0)

        await asyncio.wait_for(other_calls(), 5)
        receiver.cancel()
        first_steps = order[: order.index("other", 1)]
        assert order.count("step") >= QUEUED_STEPS // 2, order
        assert len(first_steps) <= 2, f"the receiver ran {first_steps.count('step')} queued steps in one turn"

    asyncio.run(main())
