"""Guided decoding with llguidance: a request's `guided` field as one llguidance grammar, and its compilation.

The frontend turns the protocol's guide into an llguidance grammar (a JSON string) and compiles it once
against the model's tokenizer before any reservation, so an invalid guide is refused with the compiler's
message; the engine compiles the same string again into the matcher that masks each step's logits.

Accepted forms of each guide:
- `json_schema`: a JSON Schema (draft 2020-12 subset of llguidance); `json_object`: any JSON object; both
  compact (", " and ": " between items, no other whitespace: a small model cannot loop on whitespace);
- `regex`: a regular expression, the whole output must match it;
- `ebnf_grammar`: llguidance's Lark-like syntax (`start: ...`), or GBNF (llama.cpp's, `root ::= ...`),
  converted to Lark;
- `choice`: one of the listed strings, exactly;
- `structural_tag`: vLLM's form, a JSON object `{"structures": [{"begin": ..., "schema": {...}, "end": ...}],
  "triggers": [...]}`: free text in which each structure, once its trigger appears, follows its schema.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # llguidance itself is imported where a guide is compiled
    from llguidance._lib import JsonCompileOptions

GUIDE_KINDS = ("json_schema", "regex", "ebnf_grammar", "structural_tag", "choice", "json_object")
_GBNF_RULE = re.compile(r"^\s*[A-Za-z][\w-]*\s*::=", re.MULTILINE)
_COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False}


class GuideError(ValueError):
    """The guide is not valid; the message names the field and says what is wrong."""


@dataclass(frozen=True)
class Limits:
    """Bounds on one guide's compilation (llguidance's own fuel limits, deterministic)."""

    max_grammar_size: int = 500_000  # llguidance's grammar size units (about the grammar's symbols)
    initial_lexer_fuel: int = 1_000_000  # work to build the lexer of the first token
    step_lexer_fuel: int = 200_000  # work per token


def vocabulary(llama_vocab):
    """llguidance's view of a llama.cpp vocabulary (llama_vocab pointer), to compile guides against; about a
    third of a second. llguidance reads each token's attributes with a call llama-cpp-python marks deprecated
    (one warning per token): silenced here."""
    import warnings

    from llguidance.llamacpp import lltokenizer_from_vocab

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return lltokenizer_from_vocab(llama_vocab)


def parser_limits(limits: Limits):
    from llguidance import LLParserLimits

    return LLParserLimits(
        max_grammar_size=limits.max_grammar_size,
        initial_lexer_fuel=limits.initial_lexer_fuel,
        step_lexer_fuel=limits.step_lexer_fuel,
    )


def grammar_of(kind: str, value) -> str:
    """The llguidance grammar of a protocol guide (`value`: the field's value; for `choice` its strings).
    GuideError names the field when the guide cannot even be read (bad JSON, an empty choice)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    field = f"guided.{kind}"
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_COMPACT_JSON)
    if kind == "json_schema":
        schema = _json(field, value)
        if not isinstance(schema, dict):
            raise GuideError(f"{field} must be a JSON Schema object, got {type(schema).__name__}")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT_JSON)
        except ValueError as exc:
            raise GuideError(f"{field} is not valid: {exc}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "ebnf_grammar":
        if _GBNF_RULE.search(value) and "::=" in value:
            try:
                value = gbnf_to_lark(value)
            except Exception as exc:  # noqa: BLE001 - the converter's message is the answer
                raise GuideError(f"{field} is not valid GBNF: {exc}") from None
        return LLMatcher.grammar_from_lark(value)
    if kind == "choice":
        choices = list(value)
        if not choices:
            raise GuideError("guided.choice.choices must list at least one string")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "structural_tag":
        return _structural_tag(field, value)
    raise GuideError(f"guided: unknown guide {kind!r}; one of {', '.join(GUIDE_KINDS)}")


def _json(field: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GuideError(f"{field} is not valid JSON: {exc}") from None


def _structural_tag(field: str, text: str) -> str:
    from llguidance import LLMatcher, StructTag

    spec = _json(field, text)
    structures = spec.get("structures") if isinstance(spec, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise GuideError(
            f'{field} must be a JSON object with non-empty "structures" (each with "begin", '
            f'"schema", "end") and "triggers" lists'
        )
    tags = []
    for index, structure in enumerate(structures):
        if not isinstance(structure, dict) or not {"begin", "schema", "end"} <= structure.keys():
            raise GuideError(f'{field}: structures[{index}] needs "begin", "schema" and "end"')
        trigger = next((t for t in triggers if isinstance(t, str) and t and structure["begin"].startswith(t)), None)
        if trigger is None:
            raise GuideError(
                f"{field}: structures[{index}].begin {structure['begin']!r} starts with none of the triggers"
            )
        tags.append(
            StructTag(trigger=trigger, begin=structure["begin"], grammar=structure["schema"], end=structure["end"])
        )
    return LLMatcher.grammar_from_lark(StructTag.to_grammar(tags))


def check(kind: str, grammar: str, tokenizer, limits: Limits) -> None:
    """Compiles the grammar against the model's tokenizer (llguidance LLTokenizer); GuideError with the
    compiler's message when it is invalid or past the limits. Drops the GIL while it compiles."""
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits(limits))
    if error:
        raise GuideError(f"guided.{kind} is not valid: {error}")


def matcher(grammar: str, tokenizer, limits: Limits):
    """The llguidance matcher of a grammar (compiling it, without the GIL); GuideError when it failed."""
    from llguidance import LLMatcher

    compiled = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits(limits))
    if compiled.is_error():
        raise GuideError(f"the guide does not compile: {compiled.get_error()}")
    return compiled


COMPILE_NICENESS = 19  # compile threads run only on CPU time the event loop and the engine leave


def compile_pool(threads: int) -> ThreadPoolExecutor:
    """A pool of compile threads at the lowest scheduling priority (Linux schedules each thread on its own, so
    only these threads are niced): one key's flood of costly guides takes CPU time left over, not the serving
    threads'."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="guide-compile", initializer=_lower_priority)


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except OSError:  # not Linux: the pool's bound alone
        pass


class GuideTimeout(GuideError):
    """The guide's compile did not end within the caller's time."""


COMPILE_THREADS = 2  # compiles at once, in a pool of their own (not the default executor, which tokenizes)
CACHED_OUTCOMES = 4096  # guides whose compile outcome is remembered (a 16-byte digest and a message each)


class CompiledGuides:
    """The outcome of compiling each guide against one tokenizer, by content: a repeated guide compiles once,
    and concurrent requests with the same guide wait for one compile. Compiles run in a bounded pool of their
    own; each is bounded by llguidance's own limits (`Limits`: grammar size and lexer fuel), which end it. When
    the last caller waiting for a compile stops (its timeout, or it was cancelled), a compile not started yet
    is dropped, and one already running ends within those limits, its outcome kept for the next request."""

    def __init__(self, threads: int = COMPILE_THREADS, entries: int = CACHED_OUTCOMES) -> None:
        self.entries = entries
        self._pool = compile_pool(threads)
        self._outcomes: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # "" valid, else why not
        self._running: dict[bytes, tuple[concurrent.futures.Future[str], asyncio.Future[str]]] = {}
        self._waiting: collections.Counter[bytes] = collections.Counter()
        self._tokenizer: object = None

    async def check(self, kind: str, grammar: str, tokenizer, limits: Limits, timeout_s: float) -> None:
        """GuideError with the compiler's message when the guide is invalid, GuideTimeout when its compile did
        not end within `timeout_s`."""
        if tokenizer is not self._tokenizer:  # another model: what was compiled against the last one is moot
            self._tokenizer = tokenizer
            self._outcomes.clear()
        key = hashlib.blake2b(f"{kind}\0{grammar}".encode(), digest_size=16).digest()
        outcome = self._outcomes.get(key)
        if outcome is None:
            running = self._running.get(key) or self._start(key, kind, grammar, tokenizer, limits)
            self._waiting[key] += 1
            try:
                async with asyncio.timeout(timeout_s):
                    outcome = await asyncio.shield(running[1])
            except TimeoutError:
                raise GuideTimeout(f"guided.{kind} took longer than {timeout_s:g} s to compile") from None
            finally:
                self._waiting[key] -= 1
                if not self._waiting[key]:
                    del self._waiting[key]
                    running[0].cancel()  # no one waits: dropped unless it runs already
        else:
            self._outcomes.move_to_end(key)
        if outcome:
            raise GuideError(outcome)

    def _start(self, key: bytes, kind: str, grammar: str, tokenizer, limits: Limits):
        work = self._pool.submit(_outcome, kind, grammar, tokenizer, limits)
        running = self._running[key] = (work, asyncio.wrap_future(work))

        def done(finished: asyncio.Future[str]) -> None:
            if self._running.get(key) is running:
                del self._running[key]
            if not finished.cancelled() and finished.exception() is None and tokenizer is self._tokenizer:
                self._outcomes[key] = finished.result()
                while len(self._outcomes) > self.entries:
                    self._outcomes.popitem(last=False)

        running[1].add_done_callback(done)
        return running


def _outcome(kind: str, grammar: str, tokenizer, limits: Limits) -> str:
    try:
        check(kind, grammar, tokenizer, limits)
    except GuideError as exc:
        return str(exc)
    return ""


CACHED_MATCHERS = 64  # compiled matchers an engine keeps (each holds its grammar's lexer: up to a few MB)


class GuideMatchers:
    """The engine's compiled matchers, by grammar: a repeated guide compiles once, and requests with the same
    guide wait for one compile, in a bounded pool of its own off the step loop. The matcher a caller gets is
    shared: each output samples with a `deep_copy()` of it. When every request waiting for a compile has left (`leave`),
    a compile not started yet is dropped; one already running ends within llguidance's limits, its matcher kept."""

    def __init__(self, tokenizer, limits: Limits, threads: int = 1, entries: int = CACHED_MATCHERS) -> None:
        self.tokenizer, self.limits, self.entries = tokenizer, limits, entries
        self._pool = compile_pool(threads)
        self._compiled: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._running: dict[str, concurrent.futures.Future] = {}
        self._waiting: collections.Counter[str] = collections.Counter()
        self._orphans: list[str] = []  # running compiles no one waits for any more

    def join(self, grammar: str) -> concurrent.futures.Future:
        """The compile of `grammar` (done at once when it is kept); the caller waits for it until `leave`."""
        self._settle_orphans()
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        running = self._running.get(grammar)
        if running is None:
            running = self._running[grammar] = self._pool.submit(matcher, grammar, self.tokenizer, self.limits)
        self._waiting[grammar] += 1
        return running

    def leave(self, grammar: str, compile: concurrent.futures.Future) -> None:
        """A caller of `join` stops waiting: its compile ended (kept when it succeeded) or its request left."""
        self._settle_orphans()
        if self._running.get(grammar) is not compile:
            return  # a kept matcher, or a compile another caller settled
        if compile.done():
            self._settle(grammar)
            return
        self._waiting[grammar] -= 1
        if self._waiting[grammar]:
            return
        del self._waiting[grammar]
        if compile.cancel():
            del self._running[grammar]
        else:
            self._orphans.append(grammar)  # running: kept once it ends, for the next request with this guide

    def _settle(self, grammar: str) -> None:
        compile = self._running.pop(grammar)
        self._waiting.pop(grammar, None)
        if not compile.cancelled() and compile.exception() is None:
            self._compiled[grammar] = compile
            while len(self._compiled) > self.entries:
                self._compiled.popitem(last=False)

    def _settle_orphans(self) -> None:
        if not self._orphans:
            return
        still = []
        for grammar in self._orphans:
            compile = self._running.get(grammar)
            if compile is not None and compile.done() and not self._waiting[grammar]:
                self._settle(grammar)
            elif compile is not None and not compile.done():
                still.append(grammar)
        self._orphans = still

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
