"""The engine's batching arithmetic and step encoding, without MPI or sockets (engine/simulated/batch.py)."""

from __future__ import annotations

import time

import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.engine.config import WorkerConfig
from openengine_serve.engine.interface import step_message
from openengine_serve.engine.simulated.batch import Batch, encode_token_fields

PROMPT = [9707, 11, 1879]


@pytest.fixture(scope="module")
def token_fields():
    return encode_token_fields()


def make_batch(token_fields, max_batch: int = 4) -> Batch:
    return Batch(max_batch, token_fields)


def add(request_id: str, *, sequences: int = 1, priority: int = 0, **fields) -> cluster_pb2.EngineRequest:
    values = dict(
        request_id=request_id,
        frontend_id="fe-1",
        prompt_token_ids=PROMPT,
        max_tokens=1000,
        ignore_eos=True,
        temperature=0.7,
        num_sequences=sequences,
        priority=priority,
    )
    values.update(fields)
    return cluster_pb2.EngineRequest(**values)


def step(batch: Batch, number: int = 1) -> cluster_pb2.EngineStep:
    events: list[bytes] = []
    batch.admit()
    running_tokens = batch.generate(events)
    return cluster_pb2.EngineStep.FromString(step_message(number, events, batch.load(running_tokens), 0.001, [11]))


def test_admission_counts_sequences_and_takes_whole_requests_by_priority(token_fields):
    batch = make_batch(token_fields, max_batch=4)
    batch.enqueue(add("a", sequences=3))
    batch.enqueue(add("b", sequences=2))  # does not fit next to a: waits whole
    batch.enqueue(add("urgent", sequences=1, priority=5))
    assert (batch.queued_sequences, batch.waiting_tokens) == (6, 6 * len(PROMPT))
    batch.admit()
    assert batch.running_request_ids == ["urgent", "a"]
    assert batch.queued_request_ids == ["b"]
    assert (batch.running_sequences, batch.queued_sequences, batch.waiting_tokens) == (4, 2, 2 * len(PROMPT))


def test_a_request_larger_than_the_batch_runs_alone(token_fields):
    batch = make_batch(token_fields, max_batch=2)
    batch.enqueue(add("big", sequences=3))
    batch.enqueue(add("small"))
    batch.admit()
    assert batch.running_request_ids == ["big"] and batch.running_sequences == 3
    assert batch.queued_request_ids == ["small"]


def test_running_tokens_count_prompt_and_generated_tokens(token_fields):
    batch = make_batch(token_fields)
    batch.enqueue(add("a", sequences=2))
    first, second = step(batch, 1), step(batch, 2)
    assert first.running_tokens == 2 * (len(PROMPT) + 1)
    assert second.running_tokens == 2 * (len(PROMPT) + 2)
    assert (second.running, second.queued, second.worker_pids) == (2, 0, [11])


def test_cancel_of_a_queued_output_and_of_a_running_request(token_fields):
    batch = make_batch(token_fields, max_batch=1)
    batch.enqueue(add("running"))
    batch.admit()
    batch.enqueue(add("queued", sequences=2))
    events: list[bytes] = []
    batch.cancel(cluster_pb2.CancelRequest(request_id="queued", output_index=1), events)
    assert (batch.queued_sequences, batch.waiting_tokens) == (1, len(PROMPT))
    batch.cancel(cluster_pb2.CancelRequest(request_id="running"), events)
    batch.cancel(cluster_pb2.CancelRequest(request_id="never-seen"), events)
    cancelled = cluster_pb2.EngineStep.FromString(b"".join(events)).events
    assert [(e.request_id, e.output_index, e.finish) for e in cancelled] == [
        ("queued", 1, cluster_pb2.ENGINE_FINISH_CANCELLED),
        ("running", 0, cluster_pb2.ENGINE_FINISH_CANCELLED),
    ]
    assert batch.running_sequences == 0 and batch.running_request_ids == []
    batch.admit()  # the cancelled output does not count: the remaining one fits
    assert batch.running_request_ids == ["queued"] and batch.running_sequences == 1


def pause(batch: Batch, request_id: str, resume: bool = False) -> None:
    batch.pause(cluster_pb2.PauseRequest(request_id=request_id, resume=resume))


def test_a_paused_request_gets_no_token_keeps_its_slot_and_resumes_where_it_stopped(token_fields):
    batch = make_batch(token_fields, max_batch=3)
    batch.enqueue(add("paused", sequences=2))
    batch.enqueue(add("other"))
    step(batch, 1)
    pause(batch, "paused")
    paused_tokens = 2 * (len(PROMPT) + 1)
    batch.enqueue(add("waiting"))  # the paused request's slots stay held: the batch is full
    second, third = step(batch, 2), step(batch, 3)
    assert [e.request_id for e in [*second.events, *third.events]] == ["other", "other"]
    assert batch.queued_request_ids == ["waiting"] and second.running == 3
    assert third.running_tokens == paused_tokens + len(PROMPT) + 3  # paused ones counted, not grown
    pause(batch, "paused", resume=True)
    fourth = step(batch, 4)
    # the same tokens as a request never paused: its second token comes next
    reference = make_batch(token_fields)
    reference.enqueue(add("paused", sequences=2))
    expected = [e.tokens[0].token_id for number in (1, 2) for e in step(reference, number).events][2:]
    assert [e.tokens[0].token_id for e in fourth.events if e.request_id == "paused"] == expected
    assert batch.paused_tokens == 0


def test_a_request_paused_past_the_grace_gives_its_slots_to_a_waiting_one_until_resumed(token_fields):
    batch = make_batch(token_fields, max_batch=2)
    batch.paused_slot_grace_s = 0.2
    batch.enqueue(add("paused", sequences=2))
    step(batch, 1)
    pause(batch, "paused")
    batch.enqueue(add("waiting"))
    assert not step(batch, 2).events and batch.queued_request_ids == ["waiting"], "within the grace it keeps them"
    time.sleep(0.2)
    third = step(batch, 3)
    assert [e.request_id for e in third.events] == ["waiting"] and third.running == 1
    assert batch.running_request_ids == ["waiting"] and batch.paused_tokens == 0
    pause(batch, "paused", resume=True)
    batch.cancel(cluster_pb2.CancelRequest(request_id="waiting"), [])
    fourth = step(batch, 4)
    reference = make_batch(token_fields)
    reference.enqueue(add("paused", sequences=2))
    expected = [e.tokens[0].token_id for number in (1, 2) for e in step(reference, number).events][2:]
    assert [e.tokens[0].token_id for e in fourth.events] == expected, "it went on where it stopped"


def test_a_parked_request_can_be_cancelled(token_fields):
    batch = make_batch(token_fields, max_batch=1)
    batch.paused_slot_grace_s = 0
    batch.enqueue(add("paused"))
    step(batch, 1)
    pause(batch, "paused")
    batch.enqueue(add("waiting"))
    step(batch, 2)
    events: list[bytes] = []
    batch.cancel(cluster_pb2.CancelRequest(request_id="paused"), events)
    (cancelled,) = cluster_pb2.EngineStep.FromString(b"".join(events)).events
    assert (cancelled.request_id, cancelled.finish) == ("paused", cluster_pb2.ENGINE_FINISH_CANCELLED)
    assert (batch.running_sequences, batch.queued_sequences) == (1, 0) and not batch._parked


def test_all_paused_is_idle_and_a_paused_request_can_be_cancelled(token_fields):
    batch = make_batch(token_fields)
    batch.enqueue(add("a", sequences=2))
    step(batch, 1)
    pause(batch, "a")
    pause(batch, "unknown")  # unknown or finished ids are ignored
    assert batch.idle and batch.running_sequences == 2 and batch.paused_request_ids == ["a"]
    events: list[bytes] = []
    batch.cancel(cluster_pb2.CancelRequest(request_id="a", output_index=0), events)
    assert batch.paused_tokens == len(PROMPT) + 1
    batch.cancel(cluster_pb2.CancelRequest(request_id="a"), events)
    cancelled = cluster_pb2.EngineStep.FromString(b"".join(events)).events
    assert [(e.output_index, e.finish) for e in cancelled] == [
        (0, cluster_pb2.ENGINE_FINISH_CANCELLED),
        (1, cluster_pb2.ENGINE_FINISH_CANCELLED),
    ]
    assert (batch.running_sequences, batch.paused_tokens, batch.running_request_ids) == (0, 0, [])
    pause(batch, "a", resume=True)  # resuming what ended does nothing
    assert batch.idle and batch.running_request_ids == []


def test_finished_outputs_leave_the_batch(token_fields):
    batch = make_batch(token_fields)
    batch.enqueue(add("short", max_tokens=3))
    finishes = [event.finish for number in (1, 2, 3) for event in step(batch, number).events]
    assert finishes == [0, 0, cluster_pb2.ENGINE_FINISH_LENGTH]
    assert batch.idle and batch.running_sequences == 0


def test_step_bytes_equal_protobuf_serialization(token_fields):
    """The hand-assembled EngineStep (fast path for tokens after the first) is protobuf's own bytes."""
    batch = make_batch(token_fields)
    batch.enqueue(add("a", sequences=2))
    batch.enqueue(add("b", frontend_id="fe-2"))
    for number in (1, 2, 3):
        events: list[bytes] = []
        batch.admit()
        running_tokens = batch.generate(events)
        hand = step_message(number, events, batch.load(running_tokens), 0.002, [11, 12])
        parsed = cluster_pb2.EngineStep.FromString(hand)
        assert len(parsed.events) == 3 and all(len(event.tokens) == 1 for event in parsed.events)
        assert [event.first for event in parsed.events] == [number == 1] * 3, "each output's first token says so"
        assert hand == parsed.SerializeToString()
        rebuilt = cluster_pb2.EngineStep(
            step=number,
            running=3,
            running_tokens=running_tokens,
            step_seconds=0.002,
            worker_pids=[11, 12],
            events=[
                cluster_pb2.OutputEvent(
                    request_id=e.request_id,
                    output_index=e.output_index,
                    lane=e.lane,
                    tokens=[cluster_pb2.TokenRecord(token_id=e.tokens[0].token_id)],
                    first=number == 1,
                )
                for e in parsed.events
            ],
        )
        assert hand == rebuilt.SerializeToString()


def test_idle_heartbeat_is_an_empty_step(token_fields):
    batch = make_batch(token_fields)
    assert (
        step_message(7, [], batch.load(0), 0.0, [11])
        == cluster_pb2.EngineStep(step=7, worker_pids=[11]).SerializeToString()
    )


def test_worker_config_round_trips_and_rejects_bad_values():
    config = WorkerConfig(
        command_address="tcp://127.0.0.1:1", step_address="tcp://127.0.0.1:2", max_batch=8, step_ms=2.5, ranks=2
    )
    assert WorkerConfig.from_json(config.to_json()) == config
    with pytest.raises(ValueError, match="unknown engine worker config keys: colour"):
        WorkerConfig.from_json('{"command_address": "a", "step_address": "b", "max_batch": 1, "colour": 1}')
    with pytest.raises(ValueError, match="max_batch >= 1"):
        WorkerConfig(command_address="a", step_address="b", max_batch=0)


# ------------------------------------------------------------------ fair share between API keys


def test_a_second_key_gets_its_share_of_a_batch_one_key_filled(token_fields):
    """Key a fills the batch and queues more; key b's requests go before a's queued ones and take back b's share
    (half the batch) from a's last admitted requests, which resume where they stopped."""
    batch = make_batch(token_fields, max_batch=4)
    for i in range(6):
        batch.enqueue(add(f"a{i}", owner="a"))
    step(batch)
    assert batch.running_request_ids == ["a0", "a1", "a2", "a3"]
    for i in range(3):
        batch.enqueue(add(f"b{i}", owner="b"))
    produced = step(batch, 2)
    assert sorted(batch.running_request_ids) == ["a0", "a1", "b0", "b1"], "each key holds its share: 2 of 4"
    assert sorted(batch.queued_request_ids) == ["a2", "a3", "a4", "a5", "b2"]
    assert {e.request_id for e in produced.events} == {"a0", "a1", "b0", "b1"}
    batch.cancel(cluster_pb2.CancelRequest(request_id="b0"), [])
    batch.cancel(cluster_pb2.CancelRequest(request_id="b1"), [])
    step(batch, 3)
    assert sorted(batch.running_request_ids) == ["a0", "a1", "a2", "b2"]
    batch.cancel(cluster_pb2.CancelRequest(request_id="b2"), [])
    resumed = step(batch, 4)
    assert sorted(batch.running_request_ids) == ["a0", "a1", "a2", "a3"], "alone again, a takes the whole batch"
    a3 = [e for e in resumed.events if e.request_id == "a3"]
    assert not a3[0].first, "a preempted request continues its output"


def test_a_keys_share_of_the_batch_follows_its_weight(token_fields):
    batch = make_batch(token_fields, max_batch=8)
    for i in range(8):
        batch.enqueue(add(f"a{i}", owner="a", share_weight=3))
    step(batch)
    for i in range(8):
        batch.enqueue(add(f"b{i}", owner="b"))
    step(batch, 2)
    running = batch.running_request_ids
    assert (sum(r.startswith("a") for r in running), sum(r.startswith("b") for r in running)) == (6, 2), running


def test_one_key_alone_and_priority_keep_their_order(token_fields):
    batch = make_batch(token_fields, max_batch=2)
    for i in range(3):
        batch.enqueue(add(f"a{i}", owner="a"))
    batch.enqueue(add("b-low", owner="b", priority=-1))
    batch.admit()
    assert batch.running_request_ids == ["a0", "a1"], "b's lower priority: not before a's queue, no preemption"
    assert batch.queued_request_ids == ["a2", "b-low"]
