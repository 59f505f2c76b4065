"""Guide compiles on the frontend (common/guides.py CompiledGuides): once per guide, in a bounded pool of their own,
and a caller that stops waiting leaves its compile to end within llguidance's limits."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from openengine_serve.common import guides

LIMITS = guides.Limits()


class SlowCompiler:
    """guides.check's stand-in: takes `seconds`, counts its runs and the most that ran at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.runs: list[str] = []
        self.running = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, kind: str, grammar: str, tokenizer, limits) -> None:
        with self.lock:
            self.runs.append(grammar)
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        if grammar.startswith("bad"):
            raise guides.GuideError(f"guided.{kind} is not valid: {grammar}")


@pytest.fixture
def compiler(monkeypatch) -> SlowCompiler:
    slow = SlowCompiler(0.05)
    monkeypatch.setattr(guides, "check", slow)
    return slow


async def test_a_repeated_guide_compiles_once_and_concurrent_ones_share_the_compile(compiler):
    compiled = guides.CompiledGuides()
    tokenizer = object()
    await asyncio.gather(*(compiled.check("regex", "a+", tokenizer, LIMITS, 5) for _ in range(20)))
    await compiled.check("regex", "a+", tokenizer, LIMITS, 5)
    for _ in range(3):
        with pytest.raises(guides.GuideError, match="guided.regex is not valid: bad"):
            await compiled.check("regex", "bad(", tokenizer, LIMITS, 5)
    assert compiler.runs == ["a+", "bad("]
    await compiled.check("regex", "a+", object(), LIMITS, 5)  # another model's tokenizer: compiled again
    assert compiler.runs == ["a+", "bad(", "a+"]


async def test_compiles_run_in_a_bounded_pool_of_their_own(compiler):
    compiled = guides.CompiledGuides(threads=2)
    tokenizer = object()
    await asyncio.gather(*(compiled.check("regex", f"g{i}", tokenizer, LIMITS, 5) for i in range(8)))
    assert len(compiler.runs) == 8 and compiler.most == 2


async def test_a_compile_no_one_waits_for_any_more_is_dropped_unless_it_runs(compiler):
    compiler.seconds = 0.2
    compiled = guides.CompiledGuides(threads=1)
    tokenizer = object()
    running = asyncio.ensure_future(compiled.check("regex", "first", tokenizer, LIMITS, 5))
    queued = [asyncio.ensure_future(compiled.check("regex", f"queued{i}", tokenizer, LIMITS, 5)) for i in range(5)]
    await asyncio.sleep(0.05)
    for waiter in queued:
        waiter.cancel()  # their clients left
    await running
    await asyncio.sleep(0.3)
    assert compiler.runs == ["first"], "the compiles of requests that left never started"


async def test_a_caller_that_stops_waiting_leaves_the_outcome_to_the_next_request(compiler):
    compiler.seconds = 0.3
    compiled = guides.CompiledGuides()
    tokenizer = object()
    with pytest.raises(guides.GuideTimeout, match="took longer than 0.05 s to compile"):
        await compiled.check("regex", "slow", tokenizer, LIMITS, 0.05)
    await compiled.check("regex", "slow", tokenizer, LIMITS, 5)  # joins the one compile, running on
    await compiled.check("regex", "slow", tokenizer, LIMITS, 0.01)  # its outcome is kept
    assert compiler.runs == ["slow"]


def test_the_cache_is_bounded(compiler):
    compiler.seconds = 0

    async def run():
        compiled = guides.CompiledGuides(entries=4)
        tokenizer = object()
        for i in range(10):
            await compiled.check("regex", f"g{i}", tokenizer, LIMITS, 5)
        await compiled.check("regex", "g0", tokenizer, LIMITS, 5)  # forgotten: compiled again
        await compiled.check("regex", "g9", tokenizer, LIMITS, 5)  # kept
        return compiled

    compiled = asyncio.run(run())
    assert len(compiled._outcomes) == 4 and compiler.runs.count("g0") == 2 and compiler.runs.count("g9") == 1


# ---------------------------------------------------------------- the engine's matchers (GuideMatchers)


class SlowMatcher(SlowCompiler):
    """guides.matcher's stand-in: a compiled matcher is the grammar's name in a list (deep_copy copies it)."""

    def __call__(self, grammar: str, tokenizer, limits):  # type: ignore[override]
        super().__call__("grammar", grammar, tokenizer, limits)
        return FakeMatcher(grammar)


class FakeMatcher:
    def __init__(self, grammar: str) -> None:
        self.grammar = grammar

    def deep_copy(self) -> FakeMatcher:
        return FakeMatcher(self.grammar)


@pytest.fixture
def matcher_compiler(monkeypatch) -> SlowMatcher:
    slow = SlowMatcher(0.05)
    monkeypatch.setattr(guides, "matcher", slow)
    return slow


def test_the_engine_compiles_a_repeated_guide_once(matcher_compiler):
    matchers = guides.GuideMatchers(object(), LIMITS)
    waits = [matchers.join("g") for _ in range(5)]
    assert all(w is waits[0] for w in waits), "concurrent requests share one compile"
    assert waits[0].result(5).grammar == "g"
    for wait in waits:
        matchers.leave("g", wait)
    again = matchers.join("g")
    assert again.done() and again.result().grammar == "g"
    matchers.leave("g", again)
    assert matcher_compiler.runs == ["g"]
    matchers.close()


def test_the_engine_drops_the_compiles_of_requests_that_left_and_keeps_the_one_running(matcher_compiler):
    matcher_compiler.seconds = 0.3
    matchers = guides.GuideMatchers(object(), LIMITS, threads=1)
    running = matchers.join("first")
    time.sleep(0.05)
    queued = [(f"q{i}", matchers.join(f"q{i}")) for i in range(5)]
    shared = matchers.join("first")  # a second request with the running guide
    for grammar, wait in queued:
        matchers.leave(grammar, wait)  # their requests were cancelled
    matchers.leave("first", running)  # the first request left; the second still waits
    assert shared.result(5).grammar == "first"
    matchers.leave("first", shared)
    time.sleep(0.35)
    assert matcher_compiler.runs == ["first"], "the compiles of requests that left never started"
    kept = matchers.join("first")
    assert kept.done(), "the running compile's matcher is kept for the next request"
    matchers.close()


def test_a_compile_whose_requests_all_left_while_it_ran_is_kept_and_nothing_leaks(matcher_compiler):
    matcher_compiler.seconds = 0.1
    matchers = guides.GuideMatchers(object(), LIMITS, threads=1, entries=2)
    for i in range(4):
        wait = matchers.join(f"g{i}")
        time.sleep(0.02)
        matchers.leave(f"g{i}", wait)  # left while it ran
        wait.result(5)
    other = matchers.join("other")
    other.result(5)
    matchers.leave("other", other)
    assert not matchers._waiting and not matchers._running and not matchers._orphans
    assert len(matchers._compiled) == 2, "the cache is bounded"
    matchers.close()


def test_compile_threads_run_at_the_lowest_priority():
    pool = guides.compile_pool(1)
    niceness = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(5)
    pool.shutdown()
    assert niceness == guides.COMPILE_NICENESS
