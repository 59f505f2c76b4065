"""EngineLink against the real launcher, MPI-spawned worker ranks and ZMQ on abstract Unix sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable

import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.engine.simulated import model
from openengine_serve.node.engine_link import EngineFull, EngineLink, EngineUnavailable

from .processes import alive, descendants

START_TIMEOUT_S = 60.0  # MPI spawn plus vocabulary load, on a busy machine


class StepLog:
    """on_step target: keeps every step and wakes waiters."""

    def __init__(self) -> None:
        self.steps: list[cluster_pb2.EngineStep] = []
        self.queue_times: list[float] = []  # on_queue_time target
        self._changed = asyncio.Event()

    def __call__(self, step: cluster_pb2.EngineStep) -> None:
        self.steps.append(step)
        self._changed.set()

    def events(self, request_id: str) -> list[tuple[int, cluster_pb2.OutputEvent]]:
        return [(step.step, event) for step in self.steps for event in step.events if event.request_id == request_id]

    def finishes(self, request_id: str) -> dict[int, int]:
        return {event.output_index: event.finish for _, event in self.events(request_id) if event.finish}

    async def until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                self._changed.clear()
                await self._changed.wait()


def long_request(request_id: str, **fields) -> cluster_pb2.EngineRequest:
    values = dict(
        request_id=request_id,
        frontend_id="fe-1",
        prompt_token_ids=[9707, 11, 1879],
        max_tokens=100_000,
        ignore_eos=True,
        temperature=0.7,
    )
    values.update(fields)
    return cluster_pb2.EngineRequest(**values)


@pytest.fixture(scope="module")
async def engine():
    log = StepLog()
    link = EngineLink(
        step_ms=2,
        max_batch=4,
        max_queue=2,
        ranks=1,
        on_step=log,
        on_queue_time=log.queue_times.append,
        start_timeout_s=START_TIMEOUT_S,
    )
    async with asyncio.timeout(START_TIMEOUT_S + 5):
        await link.start()
    yield link, log
    async with asyncio.timeout(15):
        await link.stop(timeout=5)


async def test_streams_exactly_max_tokens_one_token_per_step(engine):
    link, log = engine
    async with asyncio.timeout(20):
        link.submit(long_request("stream", max_tokens=40))
        await log.until(lambda: log.finishes("stream"))
    events = log.events("stream")
    assert [len(event.tokens) for _, event in events] == [1] * 40
    steps = [step for step, _ in events]
    assert steps == list(range(steps[0], steps[0] + 40))
    assert events[-1][1].finish == cluster_pb2.ENGINE_FINISH_LENGTH
    assert {event.lane for _, event in events} == {"fe-1"}
    # What crossed the wire is exactly what the model produces for this request.
    state = model.RequestState(long_request("elsewhere", max_tokens=40))
    expected = [state.next_token(state.outputs[0])[0] for _ in range(40)]
    assert [event.tokens[0].token_id for _, event in events] == expected
    assert "stream" not in link.outstanding


async def test_logprobs_and_prompt_logprobs_cross_the_wire(engine):
    link, log = engine
    async with asyncio.timeout(20):
        link.submit(
            long_request(
                "logprobs",
                num_sequences=2,
                max_tokens=6,
                output_logprobs=True,
                output_candidates=cluster_pb2.Candidates(top_n=2),
                prompt_logprobs=True,
            )
        )
        await log.until(lambda: len(log.finishes("logprobs")) == 2)
    events = [event for _, event in log.events("logprobs")]
    with_prompt = [event for event in events if event.prompt_tokens]
    assert len(with_prompt) == 1 and with_prompt[0] == next(e for e in events if e.output_index == 0)
    assert [record.token_id for record in with_prompt[0].prompt_tokens] == [9707, 11, 1879]
    assert not with_prompt[0].prompt_tokens[0].has_logprob
    records = [record for event in events for record in event.tokens]
    assert len(records) == 12
    assert all(record.has_logprob and len(record.candidates) == 2 for record in records)


async def test_three_sequences_stream_side_by_side(engine):
    link, log = engine
    async with asyncio.timeout(20):
        link.submit(long_request("three", num_sequences=3, max_tokens=25))
        assert link.outstanding["three"] == {0, 1, 2}
        await log.until(lambda: len(log.finishes("three")) == 3)
    tokens = {index: [] for index in range(3)}
    for _, event in log.events("three"):
        tokens[event.output_index].extend(record.token_id for record in event.tokens)
    assert all(len(stream) == 25 for stream in tokens.values())
    assert len({tuple(stream) for stream in tokens.values()}) == 3
    assert link.open_sequences == 0


async def test_cancel_frees_the_slot_within_a_few_steps(engine):
    link, log = engine
    async with asyncio.timeout(20):
        link.submit(long_request("cancel-me", num_sequences=2))
        await log.until(lambda: len(log.events("cancel-me")) >= 2)
        assert link.cancel("cancel-me", output_index=1)
        await log.until(lambda: 1 in log.finishes("cancel-me"))
        assert link.outstanding["cancel-me"] == {0}
        assert not link.cancel("cancel-me", output_index=1)

        step_at_cancel = log.steps[-1].step
        assert link.cancel("cancel-me")
        await log.until(lambda: 0 in log.finishes("cancel-me"))
    cancel_step = next(step for step, event in log.events("cancel-me") if event.output_index == 0 and event.finish)
    assert cancel_step - step_at_cancel <= 5
    assert log.finishes("cancel-me") == {0: cluster_pb2.ENGINE_FINISH_CANCELLED, 1: cluster_pb2.ENGINE_FINISH_CANCELLED}
    assert "cancel-me" not in link.outstanding
    assert not link.cancel("cancel-me")


async def test_a_paused_request_gets_no_token_until_resumed_and_loses_none(engine):
    link, log = engine
    async with asyncio.timeout(20):
        link.submit(long_request("paused", num_sequences=2, max_tokens=30))
        await log.until(lambda: len(log.events("paused")) >= 4)
        assert not link.pause("paused", resume=False, lane="another-frontend"), "only its own frontend's"
        assert link.pause("paused", resume=False, lane="fe-1")
        steps = len(log.steps)
        await log.until(lambda: len(log.steps) >= steps + 3)  # the pause reached the worker (steps or heartbeats)
        received = len(log.events("paused"))
        await asyncio.sleep(0.2)  # ~100 steps at 2 ms, or idle heartbeats: none for it
        assert len(log.events("paused")) == received
        assert link.outstanding["paused"] == {0, 1} and log.steps[-1].running >= 2, "its slots stay held"
        assert link.pause("paused", resume=True, lane="fe-1")
        await log.until(lambda: len(log.finishes("paused")) == 2)
    assert not link.pause("paused", resume=True, lane="fe-1"), "finished: nothing to resume"
    for index in (0, 1):
        state = model.RequestState(long_request("paused", num_sequences=2, max_tokens=30))
        expected = [state.next_token(state.outputs[index])[0] for _ in range(30)]
        tokens = [
            record.token_id
            for _, event in log.events("paused")
            if event.output_index == index
            for record in event.tokens
        ]
        assert tokens == expected, "every token, in order, as if it had never paused"
    assert log.finishes("paused") == {0: cluster_pb2.ENGINE_FINISH_LENGTH, 1: cluster_pb2.ENGINE_FINISH_LENGTH}


async def test_engine_full_counts_running_and_queued_sequences(engine):
    link, log = engine
    queue_times = len(log.queue_times)
    async with asyncio.timeout(20):
        link.submit(long_request("full-a", num_sequences=3))
        link.submit(long_request("full-b", num_sequences=2))
        with pytest.raises(EngineFull):
            link.submit(long_request("full-c", num_sequences=2))
        link.submit(long_request("full-c", num_sequences=1))  # 6 = max_batch + max_queue
        with pytest.raises(EngineFull):
            link.submit(long_request("full-d"))
        await log.until(lambda: log.steps[-1].running == 3 and log.steps[-1].queued == 3)
        for request_id in ("full-c", "full-b", "full-a"):  # the queued first: none is admitted by a's cancel
            link.cancel(request_id)
        await log.until(lambda: not link.outstanding)
    assert link.load.running == 0
    # a queue time for full-a's first token; none for full-b and full-c, cancelled while queued
    assert len(log.queue_times) == queue_times + 1 and 0 < log.queue_times[-1] < 5


async def test_higher_priority_is_admitted_first(engine):
    link, log = engine
    async with asyncio.timeout(20):
        link.submit(long_request("prio-wide", num_sequences=3))
        link.submit(long_request("prio-narrow"))
        await log.until(lambda: log.events("prio-wide") and log.events("prio-narrow"))
        link.submit(long_request("prio-low", priority=0))  # the batch is full: both queue
        link.submit(long_request("prio-high", priority=5))
        link.cancel("prio-narrow")  # room for one of them
        await log.until(lambda: log.events("prio-high"))
        assert not log.events("prio-low")
        assert link.load.running == 4 and link.load.queued == 1
        for request_id in ("prio-wide", "prio-low", "prio-high"):
            link.cancel(request_id)
        await log.until(lambda: not link.outstanding)


async def test_refuses_bad_requests(engine):
    link, _ = engine
    with pytest.raises(ValueError):
        link.submit(long_request("too-wide", num_sequences=5))
    with pytest.raises(ValueError):
        link.submit(long_request("no-tokens", max_tokens=0))


async def test_fail_all_finishes_every_output_and_nothing_follows(engine):
    link, log = engine
    async with asyncio.timeout(20):
        link.submit(long_request("failed-a", num_sequences=2))
        link.submit(long_request("failed-b", frontend_id="fe-2"))
        await log.until(lambda: log.events("failed-a") and log.events("failed-b"))
        assert link.lanes_of_outstanding() == {"failed-a": "fe-1", "failed-b": "fe-2"}
        link.fail_all("node is shutting down", retryable=False)
        assert not link.outstanding and link.open_sequences == 0
        step_count = len(log.steps)
        await log.until(lambda: len(log.steps) > step_count + 10 and log.steps[-1].running == 0)
    for request_id, outputs in (("failed-a", 2), ("failed-b", 1)):
        events = [event for _, event in log.events(request_id)]
        assert [event.finish for event in events[-outputs:]] == [cluster_pb2.ENGINE_FINISH_ERROR] * outputs
        assert all(not event.retryable and event.message == "node is shutting down" for event in events[-outputs:])
        assert all(not event.finish for event in events[:-outputs])


async def test_lost_worker_fails_open_outputs_then_restarts(engine):
    link, log = engine
    async with asyncio.timeout(START_TIMEOUT_S + 20):
        link.submit(long_request("doomed", num_sequences=2))
        await log.until(lambda: len(log.events("doomed")) >= 2)
        old_pids = link.worker_pids
        restarts = link.restarts
        os.kill(old_pids[0], signal.SIGKILL)

        await log.until(lambda: len(log.finishes("doomed")) == 2)
        errors = [event for _, event in log.events("doomed") if event.finish]
        assert {event.finish for event in errors} == {cluster_pb2.ENGINE_FINISH_ERROR}
        assert all(event.retryable and "lost" in event.message and event.lane == "fe-1" for event in errors)
        assert not link.outstanding
        with pytest.raises(EngineUnavailable):
            link.submit(long_request("too-early"))

        await log.until(lambda: link.ready, timeout=START_TIMEOUT_S)
        assert link.restarts == restarts + 1
        assert link.worker_pids and set(link.worker_pids).isdisjoint(old_pids)
        link.submit(long_request("after-restart", max_tokens=5))
        await log.until(lambda: log.finishes("after-restart"))
    assert sum(len(event.tokens) for _, event in log.events("after-restart")) == 5


async def test_stalled_worker_is_replaced(engine):
    link, log = engine
    async with asyncio.timeout(START_TIMEOUT_S + 20):
        await log.until(lambda: link.ready, timeout=START_TIMEOUT_S)
        link.submit(long_request("stalled"))
        await log.until(lambda: log.events("stalled"))
        restarts = link.restarts
        os.kill(link.worker_pids[0], signal.SIGSTOP)  # alive but silent
        await log.until(lambda: log.finishes("stalled"), timeout=15)
        [event] = [event for _, event in log.events("stalled") if event.finish]
        assert event.finish == cluster_pb2.ENGINE_FINISH_ERROR and "no engine step" in event.message
        await log.until(lambda: link.ready, timeout=START_TIMEOUT_S)
        assert link.restarts == restarts + 1


NODE_SCRIPT = """
import asyncio, sys
from openengine_serve.node.engine_link import EngineLink

async def main():
    link = EngineLink(step_ms=2, max_batch=4, max_queue=0, ranks=2, on_step=lambda step: None)
    await link.start()
    print(link.launcher_pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_killed_node_leaves_no_engine_process():
    node = await asyncio.create_subprocess_exec(sys.executable, "-c", NODE_SCRIPT, stdout=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(START_TIMEOUT_S + 20):
            launcher_pid = int(await node.stdout.readline())
            processes = {launcher_pid} | set(descendants(launcher_pid))
            assert len(processes) >= 5  # launcher, mpiexec, hydra proxy, two ranks
            node.kill()
            await node.wait()
            while any(map(alive, processes)):
                await asyncio.sleep(0.05)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()


async def test_two_ranks_step_together_and_stop_leaves_nothing_behind():
    log = StepLog()
    link = EngineLink(step_ms=2, max_batch=4, max_queue=0, ranks=2, on_step=log, start_timeout_s=START_TIMEOUT_S)
    async with asyncio.timeout(START_TIMEOUT_S + 30):
        await link.start()
        try:
            assert len(link.worker_pids) == 2
            processes = {link.launcher_pid} | set(descendants(link.launcher_pid))
            assert set(link.worker_pids) <= processes
            link.submit(long_request("two-ranks", max_tokens=10))
            await log.until(lambda: log.finishes("two-ranks"))
            link.submit(long_request("left-open"))
            await log.until(lambda: log.events("left-open"))
        finally:
            await link.stop(timeout=5)
        assert not link.ready
        assert log.finishes("left-open") == {0: cluster_pb2.ENGINE_FINISH_ERROR}
        while any(map(alive, processes)):
            await asyncio.sleep(0.05)
