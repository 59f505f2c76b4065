"""The node's step receiver (node/engine_link.py): it reads the worker's steps off a real ZMQ socket, leaves the
event loop to everything else while steps queue, and is not left asleep by a check of the socket."""

from __future__ import annotations

import asyncio
import secrets
import time
from types import SimpleNamespace

import zmq

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.node.engine_link import EngineLink, _StepSocket

QUEUED_STEPS = 50


def socket_pair(context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """The worker's PUSH end and the node's PULL end, on an abstract Unix socket as in the node."""
    address = f"ipc://@openengine-test-{secrets.token_hex(8)}"
    pull = context.socket(zmq.PULL)
    pull.bind(address)
    push = context.socket(zmq.PUSH)
    push.connect(address)
    return push, pull


def wait_until_queued(steps: _StepSocket, deadline_s: float = 5.0) -> None:
    """Blocks the event loop (its reader cannot run) until a step is waiting in the socket."""
    deadline = time.monotonic() + deadline_s
    while not steps.pending():
        assert time.monotonic() < deadline, "the step never arrived"
        time.sleep(0.001)


def test_queued_steps_leave_turns_to_the_other_tasks():
    async def main():
        context = zmq.Context()
        push, pull = socket_pair(context)
        steps = _StepSocket(pull)
        for step in range(1, QUEUED_STEPS + 1):
            push.send(cluster_pb2.EngineStep(step=step).SerializeToString())
        wait_until_queued(steps)
        time.sleep(0.2)  # the rest queued on the node's side too
        order: list[str] = []
        link = EngineLink(step_ms=2, max_batch=4, max_queue=4, ranks=1, on_step=lambda step: order.append("step"))
        receiver = asyncio.create_task(link._receive_steps(SimpleNamespace(steps=steps, worker_pids=())))

        async def other_calls():  # e.g. a lane's credit or a heartbeat reply waiting for its turn
            while len(order) < 2 * QUEUED_STEPS:
                order.append("other")
                await asyncio.sleep(0)

        await asyncio.wait_for(other_calls(), 5)
        receiver.cancel()
        steps.close()
        push.close(linger=0)
        context.term()
        first_steps = order[: order.index("other", 1)]
        assert order.count("step") >= QUEUED_STEPS // 2, order
        assert len(first_steps) <= 2, f"the receiver ran {first_steps.count('step')} queued steps in one turn"

    asyncio.run(main())


def test_a_receiver_waiting_for_a_step_gets_it_after_the_socket_was_checked():
    """Checking the socket (the stall watch does) handles ZMQ's mailbox, which quiets the descriptor the
    receiver waits on: the check itself must wake it."""

    async def main():
        context = zmq.Context()
        push, pull = socket_pair(context)
        steps = _StepSocket(pull)
        received = asyncio.create_task(steps.recv())
        await asyncio.sleep(0.05)  # waiting on the descriptor
        for step in (1, 2):
            push.send(cluster_pb2.EngineStep(step=step).SerializeToString())
            wait_until_queued(steps)
            got = await asyncio.wait_for(received, 2)
            assert cluster_pb2.EngineStep.FromString(got).step == step
            received = asyncio.create_task(steps.recv())
            await asyncio.sleep(0.05)
        received.cancel()
        steps.close()
        push.close(linger=0)
        context.term()

    asyncio.run(main())
