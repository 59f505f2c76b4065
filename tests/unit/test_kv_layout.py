"""The llama.cpp engine's KV layout on the real model, in this process (engine/llamacpp/kv_layout.py): requests that
fit a per-sequence stream run there, others in the shared cache; an output outgrowing its stream goes on in the
shared cache; both share the batch. Greedy outputs are checked against llama-cpp-python's reference model (within
near ties, as in test_llama_engine.py), every sequence's cells below 512.
"""

from __future__ import annotations

import time

import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2 as C
from openengine_serve.common import guides
from openengine_serve.engine.llamacpp.kv_layout import KvLayoutEngine, stream_cells
from openengine_serve.engine.llamacpp.runtime import one_stream_state

from ..greedy_reference import first_beyond_near_tie, reference_model
from .test_llama_engine import PROMPT, SYSTEM, add, record, step, worker_config


def layout(max_batch: int = 4, context_size: int = 1024, prefix_cache_tokens: int = 0) -> KvLayoutEngine:
    """Streams of 256 cells at the defaults."""
    return KvLayoutEngine(worker_config(max_batch, context_size, prefix_cache_tokens=prefix_cache_tokens))


@pytest.fixture(scope="module")
def reference():
    return reference_model(n_ctx=1024)


def run(engine: KvLayoutEngine, outputs: dict, first_events: dict | None = None, max_steps: int = 3000) -> None:
    for _ in range(max_steps):
        if engine.idle:
            return
        for event in record(outputs, step(engine)):
            if event.first and first_events is not None:
                first_events[event.request_id] = event
    raise AssertionError("the engine did not become idle")


def assert_greedy(reference, prompts: dict[str, list[int]], outputs: dict, lengths: dict[str, int]) -> None:
    for request_id, prompt in prompts.items():
        out = outputs[(request_id, 0)]
        assert out["finish"].finish == C.ENGINE_FINISH_LENGTH, (request_id, out["finish"])
        assert len(out["ids"]) == lengths[request_id], request_id
        beyond = first_beyond_near_tie(reference, prompt, out["ids"], ignore_eos=True)
        assert beyond is None, f"{request_id}: not a greedy continuation at {beyond}"


def test_a_stream_is_the_context_split_over_the_batch_as_llama_server_splits_it():
    assert stream_cells(16384, 32) == 512  # llama-server -c 16384 -np 32
    assert stream_cells(1024, 4) == 256
    assert stream_cells(1000, 3) == 512, "rounded up to llama.cpp's 256"


def test_requests_that_fit_a_stream_run_in_one_and_others_in_the_shared_cache():
    engine = layout()
    assert engine.stream_cells == 256 and engine.streams is not None
    placed = {
        "short": add("short", PROMPT, max_tokens=8),
        "long-answer": add("long-answer", PROMPT, max_tokens=1000),  # a short prompt: most answers end early
        "fills-a-stream": add("fills-a-stream", SYSTEM[:200], max_tokens=56),
        "long": add("long", SYSTEM[:200], max_tokens=57),
    }
    for request in placed.values():
        engine.enqueue(request)
    assert set(engine.streams._queued) == {"short", "long-answer", "fills-a-stream"}
    assert set(engine.shared._queued) == {"long"}
    assert engine.load().queued == 4
    engine.close()


def test_streams_give_the_greedy_output_with_their_ids_contiguous_and_in_order(reference):
    engine = layout()
    assert engine.streams is not None
    prompts = {"short": PROMPT, "a": list(range(1000, 1100)), "b": list(range(2000, 2100))}
    lengths = {"short": 10, "a": 60, "b": 60}
    for request_id, prompt in prompts.items():
        engine.enqueue(add(request_id, prompt, max_tokens=lengths[request_id]))
    outputs: dict = {}
    orders = []
    while ("short", 0) not in outputs or outputs[("short", 0)]["finish"] is None:
        record(outputs, step(engine))
        batch = engine.streams._batch
        orders.append(batch.seq_ids[: batch.size].tolist())
    assert all(order == sorted(order) for order in orders), "the batch holds its runs in id order"
    record(outputs, step(engine))
    running = engine.streams._running
    assert sorted(o.seq_id for s in running.values() for o in s.outputs.values()) == [0, 1], (
        "a and b moved down into the ids short left"
    )
    run(engine, outputs)
    assert not engine.shared._running and engine.load().running == 0
    assert_greedy(reference, prompts, outputs, lengths)
    engine.close()


def test_streams_share_a_prefix_by_copying_it_and_give_the_greedy_output(reference):
    engine = layout(prefix_cache_tokens=2048)
    prefix = SYSTEM[:120]
    prompts = {"first": prefix + [11, 12, 13], "again": prefix + [11, 12, 13], "other": prefix + [21, 22]}
    outputs: dict = {}
    first_events: dict = {}
    for request_id in ("first", "again", "other"):  # one after another: each finds the last in the prefix cache
        engine.enqueue(add(request_id, prompts[request_id], max_tokens=16))
        run(engine, outputs, first_events)
    together = {"x": prefix + [31, 32], "y": prefix + [41]}  # sent together: y takes the cells x has read
    for request_id, prompt in together.items():
        engine.enqueue(add(request_id, prompt, max_tokens=16))
    run(engine, outputs, first_events)
    cached = {request_id: event.cached_prompt_tokens for request_id, event in first_events.items()}
    assert cached == {"first": 0, "again": 122, "other": 120, "x": 120, "y": 120}, cached
    assert not engine.shared._running
    assert_greedy(reference, prompts | together, outputs, dict.fromkeys(prompts | together, 16))
    engine.close()


def test_several_outputs_of_one_prompt_each_get_a_copy_of_its_stream(reference):
    engine = layout()
    engine.enqueue(add("two", PROMPT, max_tokens=20, num_sequences=2))
    outputs: dict = {}
    run(engine, outputs)
    assert outputs[("two", 0)]["ids"] == outputs[("two", 1)]["ids"], "greedy: both outputs alike"
    assert_greedy(reference, {"two": PROMPT}, outputs, {"two": 20})
    engine.close()


def test_an_output_outgrowing_its_stream_goes_on_in_the_shared_cache_without_losing_a_token(reference):
    engine = layout()
    assert engine.streams is not None
    prompts = {"grows": list(range(1000, 1100)), "short": PROMPT}
    lengths = {"grows": 200, "short": 40}  # 100 + 200 cells > a stream's 256
    for request_id, prompt in prompts.items():
        engine.enqueue(add(request_id, prompt, max_tokens=lengths[request_id]))
    assert set(engine.streams._queued) == {"grows", "short"}
    outputs: dict = {}
    where = []
    read_in_shared = []  # tokens the shared engine read beyond each output's one token a step
    while not engine.idle:
        record(outputs, step(engine))
        if outputs.get(("grows", 0), {}).get("finish") is None:
            where.append("shared" if "grows" in engine.shared._running else "streams")
            read_in_shared.append(engine.shared.prefilled_tokens)
    moved = where.index("shared")
    assert "streams" not in where[moved:], "it stays in the shared cache"
    assert sum(read_in_shared) == 0, "its KV cells moved with it: nothing read again"
    assert len(outputs[("grows", 0)]["ids"]) == lengths["grows"], "no token lost or sent twice"
    assert_greedy(reference, prompts, outputs, lengths)
    engine.close()


def guided_at_once(first: C.EngineRequest, second: C.EngineRequest) -> int:
    """The most guided outputs running at once over both engines (max_guided_sequences 1): `first` is running
    when `second` arrives."""
    engine = KvLayoutEngine(worker_config(4, 1024, max_guided_sequences=1))  # streams of 256 cells
    most = 0
    deadline = time.monotonic() + 120  # the guides compile off the step loop: steps before are empty
    for request in (first, second):
        engine.enqueue(request)
        while time.monotonic() < deadline and (not engine.idle if request is second else engine.load().running == 0):
            if not step(engine):
                time.sleep(0.001)
            most = max(most, engine.streams.guided_sequences + engine.shared.guided_sequences)
    assert engine.idle, "both ran to their end"
    engine.close()
    return most


def test_guided_outputs_of_both_engines_share_one_limit():
    guide = guides.grammar_of("regex", "[a-z ]{1,400}")
    in_a_stream = add("in-a-stream", PROMPT, max_tokens=30, guide=guide)
    in_the_shared_cache = add("in-the-shared-cache", SYSTEM[:200], max_tokens=30, guide=guide)
    assert guided_at_once(in_a_stream, in_the_shared_cache) == 1, "the shared engine counts the streams' guided"
    assert guided_at_once(in_the_shared_cache, in_a_stream) == 1, "the stream engine counts the shared's guided"


def u32(*values: int) -> bytes:
    return b"".join(v.to_bytes(4, "little") for v in values)


def test_a_sequences_state_in_a_stream_is_rewritten_as_a_one_stream_caches():
    header = b"MAGC" + u32(5)  # llama.cpp's magic number and the sequence id
    cells = u32(2) + b"two cells' positions, seq ids and K/V rows"
    one_stream = header + u32(1) + cells
    assert one_stream_state(header + u32(3, 0) + cells + u32(0)) == one_stream
    assert one_stream_state(header + u32(3) + cells + u32(0, 0)) == one_stream, "the first stream"
    assert one_stream_state(header + u32(3, 0, 0) + cells) == one_stream, "the last stream"
    assert one_stream_state(one_stream) == one_stream, "already one stream"
    assert one_stream_state(header + u32(3, 0, 0, 0)) is None, "no cell"
    assert one_stream_state(header + u32(3, 0) + cells + u32(7)) is None, "not a zero count after its stream"
    assert one_stream_state(header + u32(3, 0)) is None, "truncated"


def test_the_stream_engine_and_the_shared_engine_share_the_batch():
    engine = layout(max_batch=2, context_size=512)  # streams of 256 cells
    engine.enqueue(add("long", SYSTEM[:200], max_tokens=100))  # the shared cache
    engine.enqueue(add("s1", PROMPT, max_tokens=100))
    engine.enqueue(add("s2", PROMPT, max_tokens=100))
    step(engine)
    load = engine.load()
    assert (load.running, load.queued) == (2, 1), load
    assert "long" in engine.shared._running and "s1" in engine.streams._running
    events: list[bytes] = []
    engine.cancel(C.CancelRequest(request_id="long"), events)
    engine.cancel(C.CancelRequest(request_id="s2"), events)
    finished = {e.request_id: e.finish for e in C.EngineStep.FromString(b"".join(events)).events}
    assert finished == {"long": C.ENGINE_FINISH_CANCELLED, "s2": C.ENGINE_FINISH_CANCELLED}
    engine.cancel(C.CancelRequest(request_id="s1"), events)
    assert engine.idle and engine.load().running == 0
    engine.close()


def test_one_sequence_uses_the_shared_cache_alone():
    engine = layout(max_batch=1)
    assert engine.streams is None and engine.engines == (engine.shared,)
    engine.close()
