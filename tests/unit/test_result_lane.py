"""The node's result lane: steps merge while the frontend is behind; beyond the bound the waiting requests
are shed with a retryable error."""

from __future__ import annotations

import asyncio

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.node.server import ResultLane


def event(request_id: str, token: int, finish=cluster_pb2.ENGINE_FINISH_NONE) -> cluster_pb2.OutputEvent:
    return cluster_pb2.OutputEvent(
        request_id=request_id, tokens=[cluster_pb2.TokenRecord(token_id=token)], finish=finish, lane="fe"
    )


def test_steps_merge_into_one_waiting_message():
    async def main():
        lane = ResultLane(max_backlog_steps=10)
        for step in range(1, 4):
            assert lane.put(step, [event("a", step), event("b", step)]) == []
        assert lane.backlog_steps == 3 and not lane.idle.is_set()
        message = await lane.take()
        assert message.step == 3
        # each output's token events folded into one: one event per stream, whatever the steps behind
        assert [(e.request_id, [t.token_id for t in e.tokens]) for e in message.events] == [
            ("a", [1, 2, 3]),
            ("b", [1, 2, 3]),
        ]
        lane.taken()
        assert lane.backlog_steps == 0 and lane.idle.is_set()
        waiting = asyncio.ensure_future(lane.take())
        await asyncio.sleep(0)
        assert not waiting.done(), "take waits for the next step"
        lane.put(4, [event("a", 4)])
        assert [e.tokens[0].token_id for e in (await waiting).events] == [4]

    asyncio.run(main())


def test_beyond_the_bound_waiting_requests_are_shed_and_finished_ones_kept():
    async def main():
        lane = ResultLane(max_backlog_steps=2)
        assert lane.put(1, [event("a", 1), event("b", 1)]) == []
        assert lane.put(2, [event("a", 2), event("b", 2, cluster_pb2.ENGINE_FINISH_LENGTH)]) == []
        assert lane.put(3, [event("a", 3)]) == ["a"]
        message = await lane.take()
        kept = [(e.request_id, e.finish) for e in message.events]
        assert kept == [
            ("b", cluster_pb2.ENGINE_FINISH_NONE),
            ("b", cluster_pb2.ENGINE_FINISH_LENGTH),
            ("a", cluster_pb2.ENGINE_FINISH_ERROR),
        ], "b finished in full; a ends with one error"
        error = message.events[-1]
        assert error.retryable and "2 engine steps behind" in error.message and error.lane == "fe"

    asyncio.run(main())


def test_folding_keeps_each_outputs_order_around_prompt_finish_and_other_outputs():
    async def main():
        lane = ResultLane(max_backlog_steps=10)
        prompt = event("a", 0)
        prompt.prompt_tokens.add(token_id=99)
        second = event("a", 10)
        second.output_index = 1
        lane.put(1, [prompt, event("b", 1)])
        lane.put(2, [event("a", 1), second, event("b", 2)])
        lane.put(3, [event("a", 2), event("b", 3, cluster_pb2.ENGINE_FINISH_STOP_TOKEN)])
        lane.put(4, [event("a", 3)])
        message = await lane.take()
        assert [(e.request_id, e.output_index, [t.token_id for t in e.tokens], e.finish) for e in message.events] == [
            ("a", 0, [0], cluster_pb2.ENGINE_FINISH_NONE),  # the prompt event stays alone, first
            ("b", 0, [1, 2], cluster_pb2.ENGINE_FINISH_NONE),
            ("a", 0, [1, 2, 3], cluster_pb2.ENGINE_FINISH_NONE),
            ("a", 1, [10], cluster_pb2.ENGINE_FINISH_NONE),
            ("b", 0, [3], cluster_pb2.ENGINE_FINISH_STOP_TOKEN),
        ]
        assert list(message.events[0].prompt_tokens) == [cluster_pb2.TokenRecord(token_id=99)]
        lane.taken()
        lane.put(5, [event("a", 4)])  # nothing waits: a new message, no folding into the one taken
        lane.put(6, [event("a", 5)])
        assert [[t.token_id for t in e.tokens] for e in (await lane.take()).events] == [[4, 5]]

    asyncio.run(main())


def test_with_a_window_unacknowledged_messages_hold_the_next_and_steps_fold_meanwhile():
    async def main():
        lane = ResultLane(max_backlog_steps=10, window=2)
        lane.put(1, [event("a", 1)])
        await lane.take()
        lane.put(2, [event("a", 2)])
        await lane.take()
        assert lane.unacknowledged == 2
        waiting = asyncio.ensure_future(lane.take())
        for step in range(3, 6):
            lane.put(step, [event("a", step), event("b", step)])
        await asyncio.sleep(0)
        assert not waiting.done(), "two messages the frontend has not handled: the third waits on the node"
        lane.acknowledge(1)
        message = await waiting
        assert [(e.request_id, [t.token_id for t in e.tokens]) for e in message.events] == [
            ("a", [3, 4, 5]),
            ("b", [3, 4, 5]),
        ], "the steps waited folded, not as one message each"
        assert lane.unacknowledged == 2
        lane.acknowledge(5)  # more than sent (a frontend acknowledging across a reconnect): no negative credit
        assert lane.unacknowledged == 0 and lane.credit.is_set()

    asyncio.run(main())


def first(request_id: str, token: int) -> cluster_pb2.OutputEvent:
    first_event = event(request_id, token)
    first_event.first = True
    return first_event


def tokens(message: cluster_pb2.StepResults) -> list[tuple[str, list[int]]]:
    return [(e.request_id, [t.token_id for t in e.tokens]) for e in message.events]


def test_first_tokens_go_out_alone_past_the_window_while_the_rest_folds():
    async def main():
        lane = ResultLane(max_backlog_steps=10, window=1)
        lane.put(1, [event("a", 1)])
        await lane.take()
        waiting = asyncio.ensure_future(lane.take())
        lane.put(2, [event("a", 2)])
        await asyncio.sleep(0)
        assert not waiting.done(), "no credit: a running request's token waits"
        lane.put(3, [event("a", 3), first("b", 7)])
        assert tokens(await asyncio.wait_for(waiting, 1)) == [("b", [7])], "the new request's first token, alone"
        assert lane.unacknowledged == 2 and not lane.idle.is_set()
        waiting = asyncio.ensure_future(lane.take())
        lane.put(4, [event("b", 8), first("c", 5)])
        await asyncio.sleep(0)
        assert not waiting.done(), "one message past the window at a time: c's first token waits too"
        lane.acknowledge(1)
        assert tokens(await asyncio.wait_for(waiting, 1)) == [("c", [5])], "the slot past the window is free again"
        waiting = asyncio.ensure_future(lane.take())
        await asyncio.sleep(0)
        assert not waiting.done()
        lane.acknowledge(2)
        assert tokens(await asyncio.wait_for(waiting, 1)) == [("a", [2, 3]), ("b", [8])], (
            "the running streams' tokens folded meanwhile, in order"
        )
        lane.taken()
        assert lane.idle.is_set()

    asyncio.run(main())


def test_first_tokens_held_join_the_next_message_when_credit_comes_first():
    async def main():
        lane = ResultLane(max_backlog_steps=10, window=1)
        lane.put(1, [event("a", 1)])
        await lane.take()
        lane.put(2, [first("b", 7)])  # the slot past the window is free: b's first token can go alone
        assert tokens(await lane.take()) == [("b", [7])]
        lane.put(3, [first("c", 5), event("a", 2)])  # no slot: c waits beside a's folded token
        assert not lane.credit.is_set()
        lane.acknowledge(2)
        assert tokens(await asyncio.wait_for(lane.take(), 1)) == [("c", [5]), ("a", [2])]

    asyncio.run(main())


def test_without_a_window_every_waiting_message_is_handed_over():
    async def main():
        lane = ResultLane(max_backlog_steps=10)
        for step in range(1, 4):
            lane.put(step, [event("a", step)])
            assert (await lane.take()).events[0].tokens[0].token_id == step
        lane.put(4, [first("b", 1)])
        assert tokens(await asyncio.wait_for(lane.take(), 1)) == [("b", [1])]
        lane.acknowledge(1)  # a Lane opened with window 0 acknowledges too: never a limit
        assert lane.unacknowledged == 0 and lane.credit.is_set()

    asyncio.run(main())
