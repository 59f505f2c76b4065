"""The llama.cpp engine's scheduling on the real model, in this process (no MPI, no sockets): chunked prefill,
admission, preemption when the KV cache is full, cancel, pause, several outputs of one prompt.

Greedy outputs are compared with the same request served alone. Every step here stays below 64 tokens
(prefill_chunk 32, at most 4 sequences) and, where outputs are compared, the KV cache's used cells below 512
(a lone query over 512 cells or more takes ggml's split-KV kernel): ggml's CPU flash attention then takes the
same kernel whatever the batch holds, so a row's logits do not depend on its neighbours (docs/engines.md,
batch invariance).
"""

from __future__ import annotations

import time

import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2 as C
from openengine_serve.engine.config import WorkerConfig
from openengine_serve.engine.llamacpp.engine import PROMPT_LOGPROB_ROWS_PER_STEP, LlamaEngine
from openengine_serve.engine.model_card import default_model_path

from ..greedy_reference import end_of_generation_ids, first_beyond_near_tie, llama_reference, reference_model

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def worker_config(max_batch: int = 4, context_size: int = 4096, prefill_chunk: int = 32, **values) -> WorkerConfig:
    """The real model's engine config, on 2 threads."""
    return WorkerConfig(
        command_address="-",
        step_address="-",
        max_batch=max_batch,
        engine="llama.cpp",
        model_path=default_model_path(),
        context_size=context_size,
        prefill_chunk=prefill_chunk,
        threads=2,
        **values,
    )


def engine(max_batch: int = 4, context_size: int = 4096, prefill_chunk: int = 32) -> LlamaEngine:
    return LlamaEngine(worker_config(max_batch, context_size, prefill_chunk))


def add(request_id: str, prompt=PROMPT, max_tokens: int = 8, **fields) -> C.EngineRequest:
    return C.EngineRequest(
        request_id=request_id,
        frontend_id="fe",
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        **fields,
    )


def step(llama: LlamaEngine) -> list[C.OutputEvent]:
    events: list[bytes] = []
    llama.step(events)
    return list(C.EngineStep.FromString(b"".join(events)).events)


def record(outputs: dict, events: list[C.OutputEvent]) -> list[C.OutputEvent]:
    """Adds the events to `outputs`: per output, its tokens and finish event."""
    for event in events:
        out = outputs.setdefault((event.request_id, event.output_index), {"ids": [], "finish": None})
        out["ids"] += [t.token_id for t in event.tokens]
        if event.finish:
            out["finish"] = event
    return events


def run(llama: LlamaEngine, outputs: dict | None = None, max_steps: int = 2000) -> dict[tuple[str, int], dict]:
    """Steps until idle."""
    outputs = {} if outputs is None else outputs
    for _ in range(max_steps):
        if llama.idle:
            return outputs
        record(outputs, step(llama))
    raise AssertionError("the engine did not become idle")


@pytest.fixture(scope="module")
def reference():
    """llama-cpp-python's own API on the same GGUF: the reference the greedy outputs are checked against."""
    return reference_model(n_ctx=1024)


@pytest.fixture(scope="module")
def alone():
    """Greedy outputs of llama-cpp-python's own `Llama.generate` (not this engine), each prompt alone, read in
    chunks of 32 as the engine reads them here: the reference for the scheduling tests."""
    import llama_cpp

    model = llama_reference(default_model_path(), n_ctx=512, n_batch=32, n_ubatch=32)
    eog = set(end_of_generation_ids(model))

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        tokens = []
        model.reset()  # nothing reused from the previous prompt
        logits_processor = llama_cpp.LogitsProcessorList([lambda _ids, scores: ignore(scores, eog)])
        for token in model.generate(prompt, temp=0.0, reset=True, logits_processor=logits_processor):
            tokens.append(token)
            if len(tokens) == max_tokens:
                return tokens
        raise AssertionError("unreachable: end-of-generation tokens are masked")

    return {
        "short": greedy(PROMPT, 40),
        "a": greedy(list(range(1000, 1100)), 80),
        "b": greedy(list(range(2000, 2100)), 80),
    }


def ignore(scores, token_ids):
    """Masks `token_ids` (ignore_eos: the engine never picks an end-of-generation token)."""
    scores[list(token_ids)] = -float("inf")
    return scores


def test_a_long_prompt_is_read_in_chunks_while_a_running_stream_keeps_getting_tokens(alone):
    llama = engine(prefill_chunk=64)
    llama.enqueue(add("short", max_tokens=40))
    step(llama)  # the short prompt in, its first token out
    llama.enqueue(add("long", list(range(1000, 1300)), max_tokens=40))
    steps_to_first_long_token = 0
    while True:
        events = step(llama)
        steps_to_first_long_token += 1
        assert any(e.request_id == "short" for e in events), "the running stream gets a token every step"
        if any(e.request_id == "long" for e in events):
            break
    assert steps_to_first_long_token == 5, "300 prompt tokens in chunks of 64"
    assert len(run(llama)[("long", 0)]["ids"]) == 39


def test_a_full_kv_cache_preempts_the_last_admitted_and_its_output_is_unchanged(alone):
    """Two requests whose prompt and output do not fit the cache together: the one admitted last is
    preempted, reads its prompt and output again later, and still produces what it produces alone."""
    llama = engine(context_size=256)
    assert llama.context_size == 256
    llama.enqueue(add("a", list(range(1000, 1100)), max_tokens=80))
    llama.enqueue(add("b", list(range(2000, 2100)), max_tokens=80))
    outputs: dict = {}
    record(outputs, step(llama))
    steps_together = 1
    while llama.running_sequences == 2:
        record(outputs, step(llama))
        steps_together += 1
    assert (llama.running_sequences, llama.queued_sequences) == (1, 1), "b went back to the queue"
    assert 20 < steps_together < 80, "preempted once the two outgrew the 256 cells"
    run(llama, outputs)
    assert outputs[("a", 0)]["ids"] == alone["a"]
    assert outputs[("b", 0)]["ids"] == alone["b"], "the preempted request went on as if alone"
    assert {o["finish"].finish for o in outputs.values()} == {C.ENGINE_FINISH_LENGTH}
    assert llama.cells == 0 and sorted(llama._free_seq_ids) == [0, 1, 2, 3], "every sequence freed"


def test_a_request_larger_than_the_cache_fails_with_what_to_do():
    llama = engine(context_size=256)
    llama.enqueue(add("huge", max_tokens=80, num_sequences=4, temperature=1.0))
    outputs = run(llama)
    finishes = [o["finish"] for o in outputs.values()]
    assert {f.finish for f in finishes} == {C.ENGINE_FINISH_ERROR}
    assert not finishes[0].retryable and "OPENENGINE_CONTEXT_SIZE" in finishes[0].message
    assert llama.cells == 0 and llama.running_sequences == 0


def test_several_outputs_read_the_prompt_once_and_share_its_cells(alone):
    llama = engine()
    llama.enqueue(add("three", max_tokens=40, num_sequences=3))
    events = step(llama)
    assert [(e.output_index, e.first) for e in events] == [(0, True), (1, True), (2, True)]
    assert llama.cells == len(PROMPT), "the prompt's cells once, not per output"
    outputs = run(llama)
    assert [[events[i].tokens[0].token_id] + outputs[("three", i)]["ids"] for i in range(3)] == [alone["short"]] * 3, (
        "greedy outputs agree"
    )


def test_cancel_ends_queued_and_running_outputs_and_frees_their_sequences():
    llama = engine(max_batch=2)
    llama.enqueue(add("a", max_tokens=500, num_sequences=2))
    llama.enqueue(add("queued", max_tokens=5))
    step(llama)
    assert (llama.running_sequences, llama.queued_sequences) == (2, 1)
    events: list[bytes] = []
    llama.cancel(C.CancelRequest(request_id="a", output_index=1), events)
    llama.cancel(C.CancelRequest(request_id="queued"), events)
    cancelled = C.EngineStep.FromString(b"".join(events)).events
    assert [(e.request_id, e.output_index, e.finish) for e in cancelled] == [
        ("a", 1, C.ENGINE_FINISH_CANCELLED),
        ("queued", 0, C.ENGINE_FINISH_CANCELLED),
    ]
    assert (llama.running_sequences, llama.queued_sequences, len(llama._free_seq_ids)) == (1, 0, 1)
    freed = llama._free_seq_ids[0]
    assert llama.model.last_position(freed) == -1, "the cancelled output's KV cells are freed"
    llama.cancel(C.CancelRequest(request_id="a"), events)
    assert llama.idle and llama.running_sequences == 0 and len(llama._free_seq_ids) == 2
    assert [llama.model.last_position(seq_id) for seq_id in (0, 1)] == [-1, -1]


def test_a_paused_request_gets_no_tokens_until_resumed(alone):
    llama = engine()
    llama.enqueue(add("paused", max_tokens=40))
    llama.enqueue(add("other", max_tokens=40))
    step(llama)
    llama.pause(C.PauseRequest(request_id="paused"))
    for _ in range(5):
        assert {e.request_id for e in step(llama)} == {"other"}
    llama.pause(C.PauseRequest(request_id="paused", resume=True))
    outputs = run(llama)
    assert outputs[("paused", 0)]["ids"] == alone["short"][1:], "it went on where it stopped"


def test_a_request_paused_past_the_grace_gives_its_slot_to_a_waiting_one_and_resumes_from_the_cache(alone):
    llama = cached_engine(max_batch=1)
    llama.paused_slot_grace_s = 0.3
    outputs: dict = {}
    llama.enqueue(add("paused", max_tokens=40))
    for _ in range(20):
        record(outputs, step(llama))
    llama.pause(C.PauseRequest(request_id="paused"))
    llama.enqueue(add("waiting", max_tokens=8))
    for _ in range(3):
        assert not step(llama), "within the grace the paused request keeps its slot"
    time.sleep(0.3)
    run(llama, outputs)
    assert outputs[("waiting", 0)]["ids"] == alone["short"][:8], "the waiting request ran in its slot"
    assert len(outputs[("paused", 0)]["ids"]) == 20 and llama.running_sequences == 0, "the paused one left the batch"
    llama.pause(C.PauseRequest(request_id="paused", resume=True))
    read = 0
    while not llama.idle:
        record(outputs, step(llama))
        read += llama.prefilled_tokens
    assert outputs[("paused", 0)]["ids"] == alone["short"], "it went on where it stopped"
    assert read == 0, "its prompt and output so far came back from the prefix cache"


def test_a_parked_request_can_be_cancelled():
    llama = engine(max_batch=1)
    llama.paused_slot_grace_s = 0
    llama.enqueue(add("paused", max_tokens=40))
    step(llama)
    llama.pause(C.PauseRequest(request_id="paused"))
    llama.enqueue(add("waiting", max_tokens=2))
    run(llama)
    events: list[bytes] = []
    llama.cancel(C.CancelRequest(request_id="paused"), events)
    (event,) = C.EngineStep.FromString(b"".join(events)).events
    assert event.request_id == "paused" and event.finish == C.ENGINE_FINISH_CANCELLED
    assert not llama._parked and llama.idle and llama.load().queued == 0


def test_priority_orders_admission_when_the_batch_is_full():
    llama = engine(max_batch=1)
    llama.enqueue(add("running", max_tokens=3))
    step(llama)
    llama.enqueue(add("low", max_tokens=1))
    llama.enqueue(add("high", max_tokens=1, priority=5))
    order = [e.request_id for _ in range(8) for e in step(llama) if e.finish]
    assert order == ["running", "high", "low"]


def test_prompt_logprobs_cover_the_prompt_from_its_start_index():
    llama = engine(prefill_chunk=4)  # the prompt's rows come from two chunks
    llama.enqueue(
        add("p", max_tokens=1, prompt_logprobs=True, prompt_logprob_start=2, prompt_candidates=C.Candidates(top_n=2))
    )
    first = next(e for e in run_events(llama) if e.tokens)
    records = first.prompt_tokens
    assert [r.token_id for r in records] == PROMPT[2:]
    assert all(r.has_logprob and r.rank >= 1 and len(r.candidates) == 2 for r in records)


def test_a_long_prompts_logprob_rows_are_spread_over_steps_while_a_stream_runs():
    llama = engine(prefill_chunk=256)
    llama.enqueue(add("stream", max_tokens=60))
    step(llama)
    prompt = list(range(1000, 1200))
    llama.enqueue(add("rows", prompt, max_tokens=1, prompt_logprobs=True, prompt_candidates=C.Candidates(top_n=20)))
    rows_per_step, stream_tokens, records = [], 0, None
    while records is None:
        events = step(llama)
        rows_per_step.append(int(llama._batch.logits[: llama._batch.size].sum()))
        stream_tokens += sum(len(e.tokens) for e in events if e.request_id == "stream")
        records = next((e.prompt_tokens for e in events if e.request_id == "rows" and e.tokens), None)
    assert [r.token_id for r in records] == prompt, "every prompt row is read, in order"
    budget = PROMPT_LOGPROB_ROWS_PER_STEP + 1  # and the running stream's row
    assert max(rows_per_step) <= budget, f"rows per step {rows_per_step}: at most {budget}"
    assert stream_tokens == len(rows_per_step), "the stream got a token every step meanwhile"


def run_events(llama: LlamaEngine) -> list[C.OutputEvent]:
    events = []
    while not llama.idle:
        events += step(llama)
    return events


# ------------------------------------------------------------------ the prefix cache

SYSTEM = list(range(3000, 3200))  # a 200-token shared prefix


def cached_engine(**settings) -> LlamaEngine:
    return LlamaEngine(worker_config(**{"prefix_cache_tokens": 2048, **settings}))


def served(llama: LlamaEngine, request: C.EngineRequest) -> tuple[list[int], int, int, int]:
    """(tokens, the first event's cached_prompt_tokens, prompt tokens read, tokens reused) of one request."""
    llama.enqueue(request)
    tokens, cached, read, reused = [], None, 0, 0
    while not llama.idle:
        events = step(llama)
        read += llama.prefilled_tokens
        reused += llama.cached_prompt_tokens
        for event in events:
            tokens += [t.token_id for t in event.tokens]
            if event.first:
                cached = event.cached_prompt_tokens
    return tokens, cached, read, reused


def test_a_shared_prefix_is_read_once_and_gives_the_same_greedy_output(reference):
    llama = cached_engine(context_size=256)  # below 512 cells: no split-KV kernel (see the module docstring)
    assert llama.context_size == 256
    prefix = SYSTEM[:120]
    first = served(llama, add("first", prefix + [11, 12, 13], max_tokens=16))
    second = served(llama, add("second", prefix + [11, 12, 13], max_tokens=16))
    other = served(llama, add("other", prefix + [21, 22], max_tokens=16))
    bypass = served(llama, add("bypass", prefix + [11, 12, 13], max_tokens=16, bypass_prefix_cache=True))
    assert first[1:] == (0, 123, 0)
    assert second[1:] == (122, 1, 122), "all but the last prompt token came from the cache"
    assert other[1:] == (120, 2, 120), "a prompt sharing only the prefix reuses the prefix"
    assert bypass[1:] == (0, 123, 0)
    # With the cache and without, the same greedy choices, except where two tokens are a near tie: the cached
    # prompt's last token is read in another batch shape (docs/engines.md, batch invariance).
    prompt = prefix + [11, 12, 13]
    for name, output in (("first", first[0]), ("second", second[0]), ("bypass", bypass[0])):
        beyond = first_beyond_near_tie(reference, prompt, output, ignore_eos=True)
        assert beyond is None, f"{name}: not a greedy continuation at {beyond}"
    other_prompt = prefix + [21, 22]
    assert first_beyond_near_tie(reference, other_prompt, other[0], ignore_eos=True) is None


def test_a_running_requests_prompt_cells_are_shared_as_far_as_it_has_read_them(reference):
    """Requests sent one after another with one prefix: a later one shares the cells a running one has read,
    and while that one still reads their common prefix it waits for it rather than read it too; not under
    another salt; its greedy output is unchanged. The cells they share are counted once, before and after the
    first one ends."""
    llama = cached_engine(context_size=448)  # below 512 cells (see the module docstring)
    prefix = SYSTEM[:120]
    llama.enqueue(add("first", prefix + [11, 12, 13], max_tokens=40))
    outputs: dict = {}
    first_events: dict[str, C.OutputEvent] = {}

    def steps(count: int) -> None:
        for _ in range(count):
            for event in record(outputs, step(llama)):
                if event.first:
                    first_events[event.request_id] = event

    steps(2)  # 64 of its 123 prompt tokens read (chunks of 32)
    llama.enqueue(add("early", prefix + [21, 22], max_tokens=8))
    llama.enqueue(add("other-salt", prefix + [21, 22], max_tokens=8, cache_salt="tenant-b"))
    steps(4)  # first has read its prompt
    llama.enqueue(add("late", prefix + [31, 32, 33], max_tokens=60))
    steps(1)
    running = llama._running
    assert {"first", "late"} <= set(running)
    shares = {"late": 120, "early": 120}  # the cells each shares with first, held by first too
    physical = sum(state.cells() - shares.get(request_id, 0) for request_id, state in running.items())
    assert llama._held_cells() == physical + llama.prefix_cache.tokens, "shared cells counted once"
    assert llama.load().running_tokens == physical, "the load reports the running requests' cells once"
    while "first" in llama._running:
        steps(1)
    late = llama._running["late"]
    assert llama.prefix_cache.holds(late.shared_from), "first's cells went to the cache, late still shares them"
    assert llama._held_cells() == late.cells() - 120 + llama.prefix_cache.tokens
    assert llama.load().running_tokens == late.cells(), "cells shared with the cache: the request holds them"
    while not llama.idle:
        steps(1)
    for request_id in ("first", "early", "other-salt", "late"):
        finish = outputs[(request_id, 0)]["finish"]
        assert finish is not None and finish.finish == C.ENGINE_FINISH_LENGTH, request_id
    cached = {request_id: event.cached_prompt_tokens for request_id, event in first_events.items()}
    assert cached == {"first": 0, "early": 120, "other-salt": 0, "late": 120}, cached
    assert llama._held_cells() == llama.prefix_cache.tokens, "nothing counted for the ended requests"
    for request_id, prompt in (("late", prefix + [31, 32, 33]), ("early", prefix + [21, 22])):
        beyond = first_beyond_near_tie(reference, prompt, outputs[(request_id, 0)]["ids"], ignore_eos=True)
        assert beyond is None, f"{request_id}: not a greedy continuation at {beyond}"


def test_requests_sent_together_with_one_prefix_read_it_once(reference):
    llama = cached_engine(context_size=448)
    prefix = SYSTEM[:120]
    prompts = {"a": prefix + [11, 12, 13], "b": prefix + [21, 22], "c": prefix + [31], "own": SYSTEM[120:180]}
    for request_id, prompt in prompts.items():
        llama.enqueue(add(request_id, prompt, max_tokens=12))
    outputs: dict = {}
    cached, read = {}, 0
    while not llama.idle:
        for event in record(outputs, step(llama)):
            if event.first:
                cached[event.request_id] = event.cached_prompt_tokens
        read += llama.prefilled_tokens
    assert cached == {"a": 0, "b": 120, "c": 120, "own": 0}, cached
    assert read == 123 + 2 + 1 + 60, "the prefix read once"
    for request_id, prompt in prompts.items():
        beyond = first_beyond_near_tie(reference, prompt, outputs[(request_id, 0)]["ids"], ignore_eos=True)
        assert beyond is None, f"{request_id}: not a greedy continuation at {beyond}"


def test_a_request_sharing_a_running_ones_cells_holds_them_alone_once_that_one_frees_them():
    # room for one of two's outputs in the cache: the first kept is evicted when the second ends
    llama = cached_engine(context_size=448, prefix_cache_tokens=130)
    prefix = SYSTEM[:120]
    llama.enqueue(add("two", prefix + [11], max_tokens=6, num_sequences=2))
    while not llama._running or llama._running["two"].leader.cached < 120:
        step(llama)
    llama.enqueue(add("sharer", prefix + [21], max_tokens=30))
    while "two" in llama._running or "sharer" not in llama._running:
        step(llama)
    sharer = llama._running["sharer"]
    assert sharer.cached_prompt_tokens == 120 and len(llama.prefix_cache) == 1
    assert sharer.shared_from == -1, "the sequence it shared from is gone"
    assert llama._held_cells() == sharer.cells() + llama.prefix_cache.tokens
    run(llama)


def test_cache_salts_never_share_and_the_cache_is_bounded():
    llama = cached_engine(prefix_cache_tokens=450)
    served(llama, add("a", SYSTEM + [1], max_tokens=4, cache_salt="tenant-a"))
    assert served(llama, add("b", SYSTEM + [1], max_tokens=4, cache_salt="tenant-b"))[3] == 0
    assert served(llama, add("a2", SYSTEM + [1], max_tokens=4, cache_salt="tenant-a"))[3] == 200
    assert llama.prefix_cache.tokens <= 450 and len(llama.prefix_cache) == 2, "a2's entry replaced a's"
    served(llama, add("c", list(range(5000, 5300)), max_tokens=4))
    assert llama.prefix_cache.tokens <= 450, "the least recently used entries went"


def test_running_requests_take_the_cells_back_from_the_cache():
    llama = cached_engine(context_size=512, prefix_cache_tokens=512)
    served(llama, add("old", SYSTEM + [1], max_tokens=100))
    assert llama.prefix_cache.tokens == 300
    fresh = served(llama, add("fresh", list(range(6000, 6300)), max_tokens=100))
    assert len(fresh[0]) == 100 and fresh[3] == 0, "it ran whole: the cache gave its cells back"
    assert (len(llama.prefix_cache), llama.prefix_cache.tokens) == (1, 399), "fresh's 399 cells, old's given back"
    assert served(llama, add("old-again", SYSTEM + [1], max_tokens=1))[3] == 0, "nothing of old's is left"


def test_a_second_key_takes_its_share_of_the_batch_back_and_the_preempted_go_on_unchanged():
    """Key a fills the batch; key b's two requests preempt a's last two (b's share: 2 of 4), which resume by
    reading their prompt and output again: each output comes whole, what was streamed before the preemption is
    not sent again. (Their later tokens may differ from a0's where two logits nearly tie: the rows are computed
    in another batch; docs/engines.md, batch invariance.)"""
    llama = engine(max_batch=4)
    outputs: dict = {}
    for i in range(4):
        llama.enqueue(add(f"a{i}", max_tokens=30, owner="a"))
    record(outputs, step(llama))
    record(outputs, step(llama))
    for i in range(2):
        llama.enqueue(add(f"b{i}", max_tokens=5, owner="b"))
    record(outputs, step(llama))
    assert sorted(llama._running) == ["a0", "a1", "b0", "b1"]
    run(llama, outputs)
    llama.close()
    reference = outputs[("a0", 0)]["ids"]
    for name, length in (("a0", 30), ("a1", 30), ("a2", 30), ("a3", 30), ("b0", 5), ("b1", 5)):
        out = outputs[(name, 0)]
        assert len(out["ids"]) == length and out["finish"].finish == C.ENGINE_FINISH_LENGTH, (name, out)
        assert out["ids"][:2] == reference[:2], "streamed before the preemption, and the same greedy start"
