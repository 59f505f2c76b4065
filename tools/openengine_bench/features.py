"""Guided decoding and the prefix cache of the llama.cpp engine behind the whole stack: what they cost, what they save.

    python -m openengine_bench.features [--quick] [--output DIR]

The stack is what `openengine-serve up --engine llama.cpp --grpc-server grpcio [--nodes 2]` runs (coordinator,
node(s), grpcio frontend, each `python -m openengine_serve <role>` as local.py starts them), started here
component by component so that each serves its metrics on a free port (`up --metrics` takes fixed ones). The
load comes from this process (AsyncClient, greedy requests). Four measurements:

1. Guided decoding cost: output tokens/s of N streams sending requests back to back for a window, each
   request guided by a small JSON schema (the grammar ends it) or unguided (end of generation ignored, as many
   tokens as the guided outputs average), at 8 and 32 streams; and the mask's cost per token measured here,
   in-process, with llguidance on the model's vocabulary over the tokens the stack generated (compute the mask,
   unpack and apply it as sampling.py does), related to the engine's step time.
2. Prefix cache TTFT: one request at a time, a ~1,000-token system prompt and a short distinct question, with
   the prefix cache (after one warm-up request) and with kv.bypass_prefix_cache, alternated; the node's
   prefill and prefix-cache-hit counters around each. Then a burst: BURST such requests sent at once under a
   fresh salt, with the cache (the node reads the system prompt once) and bypassing it.
3. Isolation: inter-token latency p99 of 8 ordinary streams alone and next to one stream sending requests
   whose JSON schema is close to the frontend's 64 KiB limit (an anyOf of many closed objects of enums).
4. Prefix routing with 2 nodes: K system prompts of ~500 tokens each shared by many requests, sent with some
   concurrency, routed by the coordinator's rule for prefixes (no routing key; one stack per rule: the nodes' KV
   events, or a hash of the first tokens) or by a random routing key per request (which takes precedence and
   places requests without regard to their prefix); the prefix cache hit rate from both nodes' counters and how
   the requests spread.
5. LoRA mixing: output tokens/s of 16 streams (64 tokens each, end of generation ignored) with no adapter, all
   with one adapter, half with one and half without, and spread over four adapters (tools/make_test_lora.py
   adapters for the model): a step decodes each adapter's outputs apart, so mixing costs decodes.

Results: DIR/features.json and DIR/report.md (also printed); the components' logs in --logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from openengine_bench.children import unwind_on_sigterm
from openengine_bench.engines import (
    HOST,
    PROMPTS,
    ForeignLoad,
    cpu_model,
    default_threads,
    descendants,
    fmt,
    git_commit,
    http_get,
    median,
    percentile,
    ratio,
    version,
    wait_quiet,
    write_json,
)
from openengine_serve.common.net import free_port
from openengine_serve.local import stop_with_parent

if TYPE_CHECKING:
    from openengine_serve.client import AsyncClient

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = REPO / "docs" / "bench" / "features"
DEFAULT_LOGS = REPO / "bench-results" / "features-logs"

PARTS = ("guided", "cache", "isolation", "routing", "lora")

# The targets (judged on the medians over the rounds).
GUIDED_SHARE = 0.8  # guided tok/s >= 0.8x unguided (this bench's bar: no figure was set for it)
GUIDED_AT = (8, 32)
CACHE_SPEEDUP = 3.0  # "several times faster": TTFT p50 without the cache >= 3x with it
ISOLATION_FACTOR = 1.5  # ITL p99 with the huge-guide stream <= 1.5x without
ISOLATION_STREAMS = 8

MAX_GUIDE_BYTES = 65536  # the frontend's OPENENGINE_MAX_GUIDE_BYTES default
HUGE_GUIDE_MARGIN = 2048  # the huge schema stays this far below it
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0
FOREIGN_CPUS_NOTED = 0.1


@dataclass(frozen=True)
class RoutingWorkload:
    """K system prompts, each with `per_prompt` requests (a question of their own), all starting with one shared
    preamble of about `preamble_tokens` tokens (0: none; 64 or more: their first 64 tokens are the same)."""

    k: int
    per_prompt: int
    preamble_tokens: int = 0

    @classmethod
    def parse(cls, text: str) -> RoutingWorkload:
        """ "KxR" or "KxR+P" (P: the shared preamble's tokens)."""
        match = re.fullmatch(r"(\d+)x(\d+)(?:\+(\d+))?", text.strip())
        if not match:
            raise ValueError(f"a routing workload is KxR or KxR+P (e.g. 8x8+200), got {text!r}")
        return cls(int(match[1]), int(match[2]), int(match[3] or 0))

    def __str__(self) -> str:
        return f"{self.k}x{self.per_prompt}" + (f"+{self.preamble_tokens}" if self.preamble_tokens else "")

    @property
    def name(self) -> str:
        shared = f", after a shared {self.preamble_tokens}-token preamble" if self.preamble_tokens else ""
        return f"K={self.k} x R={self.per_prompt}{shared}"


@dataclass(frozen=True)
class Mode:
    rounds: int  # guided and isolation levels are run this many times, order alternated
    warmup_s: float  # uncounted load before each window; the streams' starts are spread over it
    window_s: float  # the measured window
    cache_pairs: int  # prefix cache: requests with the cache and without it, each
    routing: tuple[RoutingWorkload, ...]
    routing_concurrency: int
    mask_repeats: int  # in-process mask timing: passes over the generated outputs


FULL = Mode(
    rounds=2,
    warmup_s=5.0,
    window_s=25.0,
    cache_pairs=15,
    routing=(RoutingWorkload(4, 16), RoutingWorkload(8, 8), RoutingWorkload(8, 8, 200)),
    routing_concurrency=4,
    mask_repeats=30,
)
QUICK = Mode(
    rounds=1,
    warmup_s=2.0,
    window_s=6.0,
    cache_pairs=5,
    routing=(RoutingWorkload(4, 6),),
    routing_concurrency=4,
    mask_repeats=5,
)


# ---------------------------------------------------------------- workloads


def chat(user: str, system: str | None = None) -> str:
    """SmolLM2's chat template as text (the frontend takes the prompt as it is)."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


PERSONS = (
    "a famous scientist",
    "a retired football player",
    "a young jazz musician",
    "a medieval king",
    "a travelling chef",
    "a mountain guide",
    "a children's book author",
    "a startup founder",
)
GUIDED_PROMPTS = tuple(
    chat(f"Describe {p} as a JSON object with a name, an age and up to three tags.") for p in PERSONS
)
TAGS = ["science", "art", "sports", "music", "politics", "business", "history", "travel"]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": TAGS}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
GUIDED_MAX_TOKENS = 128  # a ceiling: the grammar ends the object well before
ORDINARY_MAX_TOKENS = 128
HUGE_MAX_TOKENS = 64
HUGE_PROMPT = chat("Fill in one record of the catalogue as a JSON object.")

RULES = (
    "Greet every visitor politely and answer in plain, friendly language.",
    "Members may borrow up to ten items at a time for three weeks each.",
    "Reference books, rare manuscripts and the newspaper archive never leave the reading room.",
    "A loan can be renewed twice online unless another member has reserved the item.",
    "Late returns cost ten cents a day per item, capped at the price of the item.",
    "Lost or damaged items are replaced at cost plus a small processing fee.",
    "Children under twelve need a parent or guardian to sign their membership form.",
    "The quiet floor is for silent study; phone calls are taken in the lobby.",
    "Group study rooms hold six people and can be booked for two hours a day.",
    "Printing costs five cents a page in black and white and twenty cents in colour.",
    "Interlibrary loans usually arrive within ten working days and cost nothing.",
    "E-books and audiobooks are lent through the library's app for fourteen days.",
    "Lockers on the ground floor are free; bring your own padlock.",
    "Food is allowed in the cafe only; covered drinks are welcome everywhere except the archive.",
    "Lost membership cards are replaced at the front desk for two dollars.",
    "Volunteers shelve returns every morning between eight and ten.",
    "Tell members which branch holds an item and whether it is on the shelf right now.",
    "Never share one member's loans, fines or address with anyone else.",
    "For legal, medical or financial questions, point to the right reference section instead of advising.",
    "Story time for toddlers is on Tuesday and Thursday mornings at ten.",
    "The makerspace has two 3D printers, a laser cutter and sewing machines; a safety course is required.",
    "Laptops and tablets can be borrowed for use inside the building for four hours.",
    "Donations of books in good condition are accepted on the first Saturday of each month.",
    "The local history room keeps maps, photographs and parish records back to 1820.",
    "Accessible entrances are on the north and east sides, with lifts to every floor.",
    "Exhibition spaces can be booked by local artists three months ahead.",
    "When you do not know an answer, say so and offer to ask a librarian.",
    "Keep answers short: two or three sentences unless the member asks for more.",
)
ORGANIZATIONS = (
    "the Riverside Public Library",
    "the Northgate University Library",
    "the Harbour Town Archive",
    "the Lakeside Children's Library",
    "the Central Music Library",
    "the Old Mill Community Library",
    "the Hillcrest Law Library",
    "the Westbrook Medical Library",
    "the Maple Street Branch Library",
    "the Seaview Maritime Museum Library",
    "the Summit Engineering Library",
    "the Greenfield Agricultural Library",
    "the Starlight Observatory Library",
    "the Castle Hill Heritage Library",
    "the Pinewood School Library",
    "the Eastside Film Library",
    "the Redwood Botanical Library",
    "the Silver Lake Art Library",
    "the Kingsbridge Business Library",
    "the Foxglove Poetry Library",
)
QUESTION_FORMS = (
    "Can I borrow {}?",
    "Where do I find {}?",
    "How long may I keep {}?",
    "Is there a fee for {}?",
    "Who can help me with {}?",
    "Can I reserve {} online?",
)
QUESTION_ITEMS = (
    "a novel",
    "a travel guide",
    "a cookbook",
    "a children's book",
    "a history atlas",
    "a poetry collection",
    "a science magazine",
    "a music score",
    "a film on DVD",
    "a language course",
    "a board game",
    "a laptop",
)


BURST = 8  # requests sent at once in the prefix cache's burst


def questions() -> list[str]:
    """72 distinct short questions."""
    return [form.format(item) for item in QUESTION_ITEMS for form in QUESTION_FORMS]


def grow_text(head: str, sentences: Sequence[str], count_tokens: Callable[[str], int], target: int) -> str:
    """`head` and then numbered sentences taken in turn until the text has at least `target` tokens."""
    text, n = head, 0
    while count_tokens(text) < target:
        if not sentences:
            raise ValueError("no sentences to grow the text with")
        text += f" Rule {n + 1}: {sentences[n % len(sentences)]}"
        n += 1
    return text


def system_prompts(
    k: int, count_tokens: Callable[[str], int], target: int, seed: int = 0, preamble_tokens: int = 0
) -> list[str]:
    """k distinct system prompts of about `target` tokens: each names its own organization first (so their
    first tokens, which route a request, differ) and takes the rules in an order of its own. With
    `preamble_tokens`, each starts with the same preamble of about that many tokens (the rules in their order)
    and then its own part, of about `target` tokens too."""
    if k > len(ORGANIZATIONS):
        raise ValueError(f"at most {len(ORGANIZATIONS)} distinct system prompts, asked for {k}")
    preamble = (
        grow_text("Read the house rules first.", RULES, count_tokens, preamble_tokens) + " " if preamble_tokens else ""
    )
    out = []
    for i in range(k):
        rules = list(RULES)
        random.Random(seed + i).shuffle(rules)
        own = grow_text(f"You are the help desk assistant of {ORGANIZATIONS[i]}.", rules, count_tokens, target)
        out.append(preamble + own)
    return out


def routing_plan(k: int, per_prompt: int, seed: int = 1) -> list[tuple[int, int]]:
    """(system prompt index, question index) of every request: each prompt with `per_prompt` distinct questions,
    in a shuffled order fixed by `seed` (the same for every variant)."""
    if per_prompt > len(questions()):
        raise ValueError(f"at most {len(questions())} questions per system prompt, asked for {per_prompt}")
    plan = [(p, q) for p in range(k) for q in range(per_prompt)]
    random.Random(seed).shuffle(plan)
    return plan


def huge_schema(limit: int, seed: int = 7, fields: int = 6, values: int = 20) -> dict:
    """A JSON schema whose text stays within `limit` bytes: an anyOf of as many closed objects as fit, each with
    `fields` enum properties of `values` made-up words (a large grammar whose mask is costly where many
    alternatives are open)."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(5, 10)))

    variants: list[dict] = []
    while True:
        props = {f"{word()}_{j}": {"enum": [word() for _ in range(values)]} for j in range(fields)}
        variant = {"type": "object", "properties": props, "required": list(props)[:2], "additionalProperties": False}
        candidate = {"anyOf": variants + [variant]}
        if len(json.dumps(candidate).encode()) > limit:
            break
        variants.append(variant)
    if not variants:
        raise ValueError(f"not even one object fits in {limit} bytes")
    return {"anyOf": variants}


# ---------------------------------------------------------------- one request, as streamed


@dataclass
class Record:
    """One request as the client saw it: when it was sent, when each token response came (and how many tokens
    it carried), when and how it ended, and the final usage."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    ended: float | None = None
    finish: str = ""
    error: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_prompt_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None


class StreamError(Exception):
    """The server reported an error inside the stream."""


def make_request(
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    ignore_eos: bool = False,
    schema: str = "",
    salt: str | None = None,
    bypass: bool = False,
    lora: str = "",
):
    from openengine_serve.api.openengine.v1 import generation_pb2 as g

    request = g.GenerateRequest(
        request_id=uuid.uuid4().hex,
        model=model,
        prompt=prompt,
        sampling=g.SamplingParams(temperature=0),
        stopping=g.StoppingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )
    if schema:
        request.guided.json_schema = schema
    if salt is not None:
        request.kv.cache_salt = salt
    if bypass:
        request.kv.bypass_prefix_cache = True
    request.lora_name = lora
    return request


async def run_request(client, request, record: Record, metadata: Sequence[tuple[str, str]] = ()) -> Record:
    """Streams the request into `record` (filled as responses come, so a cancelled one keeps what arrived)."""
    from openengine_serve.api.openengine.v1 import generation_pb2 as g

    async for response in client.generate(request, timeout=REQUEST_TIMEOUT_S, metadata=tuple(metadata)):
        kind = response.WhichOneof("event")
        if kind == "token":
            record.arrivals.append(time.perf_counter())
            record.counts.append(len(response.token.tokens))
            record.token_ids.extend(t.token_id for t in response.token.tokens)
        elif kind == "finished":
            record.finish = g.FinishReason.Name(response.finished.reason).removeprefix("FINISH_REASON_").lower()
        elif kind == "error":
            raise StreamError(str(response.error).strip().replace("\n", " ")[:300])
        if response.HasField("usage") and response.usage.prompt_tokens:
            record.prompt_tokens = response.usage.prompt_tokens
            record.completion_tokens = response.usage.completion_tokens
            record.cached_prompt_tokens = response.usage.cached_prompt_tokens
    record.ended = time.perf_counter()
    return record


# ---------------------------------------------------------------- window statistics (pure)


def window_stats(records: Iterable[Record], t0: float, t1: float) -> dict[str, Any]:
    """What a group of streams did in the window [t0, t1): output tokens that arrived then (and per second), the
    TTFT of the requests whose first token came then, the inter-token latencies (the gaps between successive
    token responses of a request) that ended then, and the requests that completed or failed then."""
    seconds = t1 - t0
    tokens, ttft, gaps, multi = 0, [], [], 0
    completed, errors, lengths = 0, 0, []
    samples: list[str] = []
    finishes: dict[str, int] = {}
    for r in records:
        for i, (at, n) in enumerate(zip(r.arrivals, r.counts)):
            if not t0 <= at < t1:
                continue
            tokens += n
            if i == 0:
                ttft.append(at - r.sent)
            else:
                gaps.append(at - r.arrivals[i - 1])
                multi += n > 1
        if r.error and r.ended is not None and t0 <= r.ended < t1:
            errors += 1
            if len(samples) < 5:
                samples.append(r.error)
        elif r.ended is not None and t0 <= r.ended < t1:
            completed += 1
            lengths.append(sum(r.counts))
            finishes[r.finish or "?"] = finishes.get(r.finish or "?", 0) + 1
    ms = lambda values, q: None if not values else percentile([v * 1000 for v in values], q)
    return {
        "window_s": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds if seconds > 0 else None,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "ttft_n": len(ttft),
        "itl_p50_ms": ms(gaps, 50),
        "itl_p99_ms": ms(gaps, 99),
        "itl_max_ms": ms(gaps, 100),
        "itl_n": len(gaps),
        "multi_token_responses": multi,
        "completed": completed,
        "mean_output_tokens": sum(lengths) / len(lengths) if lengths else None,
        "finish": finishes,
        "errors": errors,
        "error_samples": samples,
    }


# ---------------------------------------------------------------- Prometheus samples (pure)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: value for (n, labels), value in samples.items() if n == name and label in dict(labels)}


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def histogram_mean(before: Samples, after: Samples, name: str) -> float | None:
    """The mean of what a histogram observed between two scrapes (None when it observed nothing)."""
    count = delta(before, after, f"{name}_count")
    return delta(before, after, f"{name}_sum") / count if count > 0 else None


PREFILL = "openengine_node_prefill_tokens_total"
HITS = "openengine_node_prefix_cache_hit_tokens_total"
STEP = "openengine_node_step_duration_seconds"
QUEUE_TIME = "openengine_node_request_queue_time_seconds"
RUNNING = "openengine_node_running_requests"
QUEUED = "openengine_node_queued_requests"
ROUTING = "openengine_coordinator_routing_decisions_total"
ROUTING_RULES = ("kv-events", "first-tokens")  # OPENENGINE_PREFIX_ROUTING of the coordinator


def hit_rate(hits: float, prefilled: float) -> float | None:
    """Prompt tokens taken from the prefix cache / all prompt tokens the engines placed (read or taken)."""
    total = hits + prefilled
    return hits / total if total > 0 else None


def node_deltas(before: Sequence[Samples], after: Sequence[Samples]) -> list[dict[str, float | None]]:
    """Per node: prompt tokens read, taken from the prefix cache, requests started (their first token), steps and
    the mean step time, between two scrapes."""
    out = []
    for b, a in zip(before, after):
        step_ms = histogram_mean(b, a, STEP)
        out.append(
            {
                "prefilled": delta(b, a, PREFILL),
                "hits": delta(b, a, HITS),
                "requests": delta(b, a, f"{QUEUE_TIME}_count"),
                "steps": delta(b, a, f"{STEP}_count"),
                "step_ms": None if step_ms is None else step_ms * 1000,
            }
        )
    return out


# ---------------------------------------------------------------- mask cost (pure summary)


def mask_summary(
    compute_ns: Sequence[int],
    apply_ns: Sequence[int],
    consume_ns: Sequence[int],
    choose_guided_ns: Sequence[int],
    choose_plain_ns: Sequence[int],
) -> dict[str, Any]:
    """µs per token: the mask computed (llguidance), unpacked and applied to the logits row (sampling.py), the
    token consumed by the matcher; and OutputSampler.choose with the guide and without it, whose difference is
    the guide's cost in the engine's own code."""
    us = lambda values, q: None if not values else percentile([v / 1000 for v in values], q)
    mean = lambda values: None if not values else sum(values) / len(values) / 1000
    masked = [c + a for c, a in zip(compute_ns, apply_ns)]
    guided, plain = mean(choose_guided_ns), mean(choose_plain_ns)
    return {
        "tokens": len(compute_ns),
        "compute_us": mean(compute_ns),
        "apply_us": mean(apply_ns),
        "mask_us": mean(masked),
        "mask_p50_us": us(masked, 50),
        "mask_p99_us": us(masked, 99),
        "mask_max_us": us(masked, 100),
        "consume_us": mean(consume_ns),
        "per_token_us": None if not masked else (mean(masked) or 0.0) + (mean(consume_ns) or 0.0),
        "choose_guided_us": guided,
        "choose_plain_us": plain,
        "choose_delta_us": None if guided is None or plain is None else guided - plain,
    }


def step_share(per_token_us: float | None, guided_per_step: float | None, step_ms: float | None) -> float | None:
    """The share of an engine step spent on guides: one mask and one consume per running guided output."""
    if per_token_us is None or guided_per_step is None or not step_ms:
        return None
    return per_token_us * guided_per_step / 1000 / step_ms


# ---------------------------------------------------------------- the stack


class Stack:
    """What `openengine-serve up --engine llama.cpp --grpc-server grpcio --nodes N` runs (local.py's plan), each
    component started here with a metrics port of its own; stopped in up's order (frontend, nodes, coordinator)."""

    def __init__(self, nodes: int, node_env: dict[str, str], logdir: Path, name: str) -> None:
        self.nodes, self.node_env, self.logdir, self.name = nodes, node_env, logdir, name
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.port = 0
        self.coordinator_metrics = 0
        self.node_metrics: list[int] = []
        self.client: AsyncClient | None = None
        self.model = ""
        self.model_extra: dict[str, Any] = {}
        self._log: IO[bytes] | None = None

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in sorted(self.node_env.items()))
        nodes = f" --nodes {self.nodes}" if self.nodes != 1 else ""
        return f"{env} openengine-serve up --engine llama.cpp --grpc-server grpcio{nodes}"

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        command = [sys.executable, "-m", "openengine_serve", *args]
        assert self._log is not None, "opened by start"
        self._log.write(
            f"\n==== {datetime.datetime.now().isoformat(timespec='seconds')} {name}: {' '.join(command)}\n".encode()
        )
        self._log.flush()
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=stop_with_parent,
        )
        self.procs.append((name, proc))

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for _, p in self.procs)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            text = (self.logdir / f"{self.name}.log").read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    async def start(self) -> None:
        from openengine_serve.client import AsyncClient, Client, is_serving, served_model

        self.logdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.logdir / f"{self.name}.log", "ab")
        env = dict(os.environ, **self.node_env)
        coordinator_port, self.coordinator_metrics = free_port(HOST), free_port(HOST)
        coordinator = f"{HOST}:{coordinator_port}"
        common = ["--host", HOST]
        self._spawn(
            "coordinator",
            ["coordinator", *common, "--port", str(coordinator_port), "--metrics-port", str(self.coordinator_metrics)],
            env,
        )
        for i in range(self.nodes):
            metrics_port = free_port(HOST)
            self.node_metrics.append(metrics_port)
            self._spawn(
                f"node-{i}",
                [
                    "node",
                    *common,
                    "--port",
                    str(free_port(HOST)),
                    "--node-rank",
                    str(i),
                    "--coordinator-address",
                    coordinator,
                    "--metrics-port",
                    str(metrics_port),
                    "--engine",
                    "llama.cpp",
                ],
                env,
            )
        self.port = free_port(HOST)
        self._spawn(
            "frontend",
            [
                "frontend",
                *common,
                "--port",
                str(self.port),
                "--coordinator-address",
                coordinator,
                "--metrics-port",
                str(free_port(HOST)),
                "--grpc-server",
                "grpcio",
            ],
            env,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if not self.alive():
                dead = [f"{n} (exit {p.returncode})" for n, p in self.procs if p.poll() is not None]
                raise RuntimeError(f"{', '.join(dead)} exited while starting; the log ends:\n{self.log_tail()}")
            with contextlib.suppress(Exception):
                if await self.ready_nodes() >= self.nodes and await asyncio.to_thread(is_serving, self.target):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the stack was not ready within {START_TIMEOUT_S:g} s; the log ends:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.5)

        def model_info():
            with Client(self.target) as client:
                return served_model(client)

        from google.protobuf.json_format import MessageToDict

        info = await asyncio.to_thread(model_info)
        self.model = info.served_model_name
        self.model_extra = MessageToDict(info.extra)
        self.client = AsyncClient(self.target)

    async def scrape(self, port: int) -> Samples:
        status, body = await http_get(HOST, port, "/metrics", timeout=5.0)
        if status != 200:
            raise RuntimeError(f"metrics on port {port}: HTTP {status}")
        return parse_metrics(body)

    async def ready_nodes(self) -> int:
        return int(metric(await self.scrape(self.coordinator_metrics), "openengine_coordinator_nodes", state="ready"))

    async def nodes_samples(self) -> list[Samples]:
        return [await self.scrape(port) for port in self.node_metrics]

    async def coordinator_samples(self) -> Samples:
        return await self.scrape(self.coordinator_metrics)

    async def drain(self) -> bool:
        """Waits until no node runs or queues a request (what a window cut short left behind has ended)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline and self.alive():
            with contextlib.suppress(Exception):
                samples = await self.nodes_samples()
                if all(metric(s, RUNNING) == 0 and metric(s, QUEUED) == 0 for s in samples):
                    return True
            await asyncio.sleep(0.5)
        return False

    async def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
            self.client = None
        order = (
            [p for n, p in self.procs if n == "frontend"],
            [p for n, p in self.procs if n.startswith("node-")],
            [p for n, p in self.procs if n == "coordinator"],
        )
        for group in order:
            running = [p for p in group if p.poll() is None]
            trees = {p.pid: descendants(p.pid) for p in running}
            for p in running:
                p.send_signal(signal.SIGTERM)
            for p in running:
                try:
                    await asyncio.to_thread(p.wait, STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    for pid in trees[p.pid]:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(pid, signal.SIGKILL)
                    await asyncio.to_thread(p.wait)
        self.procs = []
        if self._log is not None:
            self._log.close()
            self._log = None


# ---------------------------------------------------------------- load


@dataclass
class Group:
    """Streams of one kind: each sends `request(i, k)` (stream i, its k-th request) back to back."""

    name: str
    streams: int
    request: Callable[[int, int], Any]
    records: list[Record] = field(default_factory=list)
    metadata: Callable[[], Sequence[tuple[str, str]]] = lambda: ()


async def run_window(stack: Stack, groups: Sequence[Group], mode: Mode) -> dict[str, Any]:
    """Runs the groups' streams for a warm-up and a window; per group the window's statistics, and the nodes'
    step time and running/queued requests (sampled each second) during the window."""
    closing = False

    async def stream(group: Group, i: int, total: int, offset: int) -> None:
        await asyncio.sleep(mode.warmup_s * (offset + i) / max(1, total))
        k = 0
        while not closing:
            record = Record(sent=time.perf_counter())
            group.records.append(record)
            try:
                await run_request(stack.client, group.request(i, k), record, group.metadata())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - counted and sampled
                record.error, record.ended = f"{type(exc).__name__}: {str(exc)[:300]}", time.perf_counter()
                await asyncio.sleep(0.5)
            k += 1

    total = sum(g.streams for g in groups)
    tasks, offset = [], 0
    for group in groups:
        tasks += [asyncio.create_task(stream(group, i, total, offset)) for i in range(group.streams)]
        offset += group.streams
    running, queued = [], []
    try:
        await asyncio.sleep(mode.warmup_s)
        before = await stack.nodes_samples()
        foreign = ForeignLoad()
        t0 = time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < mode.window_s and stack.alive():
            await asyncio.sleep(min(1.0, max(0.0, mode.window_s - elapsed)))
            with contextlib.suppress(Exception):
                samples = await stack.nodes_samples()
                running.append(sum(metric(s, RUNNING) for s in samples))
                queued.append(sum(metric(s, QUEUED) for s in samples))
        t1 = time.perf_counter()
        foreign_cpus, busiest = foreign.measure()
        after = await stack.nodes_samples()
    finally:
        closing = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    nodes = node_deltas(before, after)
    result: dict[str, Any] = {
        "groups": {g.name: window_stats(g.records, t0, t1) for g in groups},
        "step_ms": nodes[0]["step_ms"] if len(nodes) == 1 else None,
        "steps": sum(n["steps"] for n in nodes),
        "running_mean": sum(running) / len(running) if running else None,
        "queued_mean": sum(queued) / len(queued) if queued else None,
        "foreign_cpus": foreign_cpus,
        "foreign_busiest": busiest,
        "stack_alive": stack.alive(),
    }
    if not await stack.drain():
        result["not_drained"] = True
    return result


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- 1. guided decoding cost


async def calibrate_guided(stack: Stack, schema: str) -> dict[str, Any]:
    """Each guided prompt once, alone: the outputs (their tokens feed the in-process mask timing) and their mean
    length (the unguided requests' length)."""
    outputs = []
    for prompt in GUIDED_PROMPTS:
        record = await run_request(
            stack.client,
            make_request(stack.model, prompt, max_tokens=GUIDED_MAX_TOKENS, schema=schema),
            Record(sent=time.perf_counter()),
        )
        outputs.append({"token_ids": record.token_ids, "finish": record.finish})
    lengths = [len(o["token_ids"]) for o in outputs]
    return {"outputs": outputs, "lengths": lengths, "mean_length": sum(lengths) / len(lengths)}


async def guided_levels(stack: Stack, schema: str, unguided_tokens: int, mode: Mode) -> list[dict[str, Any]]:
    rounds = []
    for r in range(mode.rounds):
        rnd: dict[str, Any] = {"round": r + 1, "levels": {}}
        for n in GUIDED_AT:
            order = ("guided", "unguided") if (r + GUIDED_AT.index(n)) % 2 == 0 else ("unguided", "guided")
            level: dict[str, Any] = {"order": list(order)}
            for kind in order:
                await wait_quiet_note(level, kind)
                if kind == "guided":
                    group = Group(
                        "guided",
                        n,
                        lambda i, k: make_request(
                            stack.model,
                            GUIDED_PROMPTS[(i + k) % len(GUIDED_PROMPTS)],
                            max_tokens=GUIDED_MAX_TOKENS,
                            schema=schema,
                        ),
                    )
                else:
                    group = Group(
                        "unguided",
                        n,
                        lambda i, k: make_request(
                            stack.model,
                            GUIDED_PROMPTS[(i + k) % len(GUIDED_PROMPTS)],
                            max_tokens=unguided_tokens,
                            ignore_eos=True,
                        ),
                    )
                say(f"  guided cost, round {r + 1}: {n} streams {kind}...")
                window = await run_window(stack, [group], mode)
                stats = window["groups"][kind]
                level[kind] = {**stats, **{k: v for k, v in window.items() if k != "groups"}}
                say(
                    f"  guided cost, round {r + 1}: {n} streams {kind}: {fmt(stats['tok_s'])} tok/s, "
                    f"{stats['completed']} requests, {fmt(stats['mean_output_tokens'])} tokens each, "
                    f"step {fmt(window['step_ms'])} ms, running {fmt(window['running_mean'])}, {stats['errors']} errors"
                )
            rnd["levels"][str(n)] = level
        rounds.append(rnd)
    return rounds


# ---------------------------------------------------------------- 5. LoRA mixing

LORA_STREAMS = 16
LORA_MAX_TOKENS = 64
LORA_ADAPTERS = 4
# each mix: the adapter of stream i ("" the base model)
LORA_MIXES: dict[str, Callable[[int], str]] = {
    "base model only": lambda i: "",
    "one adapter": lambda i: "a0",
    "half base, half one adapter": lambda i: "a0" if i % 2 else "",
    "four adapters": lambda i: f"a{i % LORA_ADAPTERS}",
}


def write_adapters(model: str, directory: Path) -> None:
    """LORA_ADAPTERS deterministic adapters a0.gguf... for the model (tools/make_test_lora.py, seeds 0...)."""
    sys.path.insert(0, str(REPO / "tools"))
    from make_test_lora import write_adapter

    directory.mkdir(parents=True, exist_ok=True)
    for n in range(LORA_ADAPTERS):
        write_adapter(Path(model), directory / f"a{n}.gguf", seed=n)


async def lora_mixes(stack: Stack, mode: Mode) -> dict[str, Any]:
    """Loads the adapters, then runs each mix for a window per round (the order reversed every other round)."""
    from openengine_serve.api.openengine.v1 import lora_pb2

    assert stack.client is not None, "started"
    for n in range(LORA_ADAPTERS):
        adapter = lora_pb2.LoraAdapter(lora_name=f"a{n}", source_path=f"a{n}.gguf")
        await stack.client.control.LoadLora(lora_pb2.LoadLoraRequest(adapter=adapter), timeout=120)
    rounds = []
    for r in range(mode.rounds):
        names = list(LORA_MIXES) if r % 2 == 0 else list(reversed(LORA_MIXES))
        rnd: dict[str, Any] = {"round": r + 1, "order": names}
        for name in names:
            await wait_quiet_note(rnd, name)
            group = Group("lora", LORA_STREAMS, functools.partial(lora_request, stack.model, LORA_MIXES[name]))
            say(f"  LoRA mixing, round {r + 1}: {name}...")
            window = await run_window(stack, [group], mode)
            stats = window["groups"]["lora"]
            rnd[name] = {**stats, **{k: v for k, v in window.items() if k != "groups"}}
            say(
                f"  LoRA mixing, round {r + 1}: {name}: {fmt(stats['tok_s'])} tok/s, step {fmt(window['step_ms'])} "
                f"ms, ITL p50 {fmt(stats['itl_p50_ms'])} ms, {stats['errors']} errors"
            )
        rounds.append(rnd)
    return {"rounds": rounds, "summary": lora_summary(rounds)}


def lora_request(model: str, choose: Callable[[int], str], i: int, k: int):
    """Stream i's k-th request of a mix: a greedy 64-token request with the adapter the mix gives stream i."""
    prompt = PROMPTS[(i + k) % len(PROMPTS)]
    return make_request(model, prompt, max_tokens=LORA_MAX_TOKENS, ignore_eos=True, lora=choose(i))


def lora_summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mix: the medians over rounds of tok/s, step and ITL p50, and tok/s relative to the base model only."""
    summary: dict[str, dict[str, Any]] = {}
    for name in LORA_MIXES:
        cells = [rnd[name] for rnd in rounds if name in rnd]
        summary[name] = {
            key: median([c[key] for c in cells if c.get(key) is not None])
            for key in ("tok_s", "step_ms", "itl_p50_ms", "itl_p99_ms")
        }
        summary[name]["errors"] = sum(c.get("errors", 0) for c in cells)
    base = summary.get("base model only", {}).get("tok_s")
    for cell in summary.values():
        cell["vs_base"] = ratio(cell["tok_s"], base)
    return summary


QUIET_LIMIT_S = [0.0]  # set by main from --quiet-wait


async def wait_quiet_note(target: dict[str, Any], key: str) -> None:
    if QUIET_LIMIT_S[0] > 0:
        target.setdefault("foreign_cpus_before", {})[key] = await wait_quiet(QUIET_LIMIT_S[0])


def guided_summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per stream count: medians over the rounds of guided and unguided tok/s, step time and running requests;
    their ratio."""
    out: dict[str, dict[str, Any]] = {}
    for n in {n for rnd in rounds for n in rnd["levels"]}:
        levels = [rnd["levels"][n] for rnd in rounds if n in rnd["levels"]]
        entry: dict[str, Any] = {}
        for kind in ("guided", "unguided"):
            cells = [lv[kind] for lv in levels if kind in lv]
            entry[kind] = {
                key: median([c.get(key) for c in cells])
                for key in (
                    "tok_s",
                    "ttft_p50_ms",
                    "itl_p50_ms",
                    "mean_output_tokens",
                    "step_ms",
                    "running_mean",
                    "queued_mean",
                )
            }
            entry[kind]["requests"] = sum(c.get("completed", 0) for c in cells)
            entry[kind]["errors"] = sum(c.get("errors", 0) for c in cells)
        entry["ratio"] = ratio(entry["guided"]["tok_s"], entry["unguided"]["tok_s"])
        out[n] = entry
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


def measure_mask(
    grammar: str,
    sequences: Sequence[Sequence[int]],
    tokenizer,
    vocab_size: int,
    end_of_generation: Sequence[int],
    repeats: int,
) -> dict[str, Any]:
    """Times, per token of each sequence (a real output of the grammar) and one more step (where the end is
    chosen): the mask computed, unpacked and applied as sampling.py does, and the token consumed; and
    OutputSampler.choose with this guide and without a guide. Also the guide's compilation: the frontend's check
    and the engine's matcher."""
    import numpy as np

    from openengine_serve.api.openengine_internal.v1 import cluster_pb2
    from openengine_serve.common import guides
    from openengine_serve.engine.llamacpp.sampling import OutputSampler

    limits = guides.Limits()
    mask = np.zeros((vocab_size + 31) // 32, np.int32)  # as the engine allocates it
    base = np.random.default_rng(0).standard_normal(vocab_size).astype(np.float32)
    row = np.empty_like(base)
    eog = np.asarray(end_of_generation, np.int64)
    compute, apply, consume = [], [], []
    choose_guided: list[int] = []
    choose_plain: list[int] = []
    check_s, compile_s = [], []
    problems: list[str] = []
    clock = time.perf_counter_ns
    for _ in range(max(1, repeats)):
        for sequence in sequences:
            t = time.perf_counter()
            guides.check("json_schema", grammar, tokenizer, limits)
            check_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            matcher = guides.matcher(grammar, tokenizer, limits)
            compile_s.append(time.perf_counter() - t)
            for position in range(len(sequence) + 1):
                np.copyto(row, base)
                t0 = clock()
                matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                t1 = clock()
                allowed = np.unpackbits(mask.view(np.uint8), count=vocab_size, bitorder="little")
                row[allowed == 0] = -np.inf
                t2 = clock()
                compute.append(t1 - t0)
                apply.append(t2 - t1)
                if position == len(sequence):
                    break
                token = int(sequence[position])
                if not allowed[token] and len(problems) < 3:
                    problems.append(f"token {token} at {position} is not in the mask")
                t3 = clock()
                ok = matcher.consume_token(token)
                consume.append(clock() - t3)
                if not ok:
                    problems.append(f"the matcher refused token {token} at {position}: {matcher.get_error()[:200]}")
                    break
            # The engine's own code: greedy OutputSampler.choose with the guide, and without one.
            request = cluster_pb2.EngineRequest(temperature=0, max_tokens=len(sequence) + 1)
            guided = OutputSampler(request, 0, vocab_size, eog)
            guided.guide = guides.matcher(grammar, tokenizer, limits)
            plain = OutputSampler(request, 0, vocab_size, eog)
            for position, token in enumerate(sequence):
                for sampler, sink in ((guided, choose_guided), (plain, choose_plain)):
                    np.copyto(row, base)
                    t0 = clock()
                    sampler.choose(None, 0, row, position, mask)
                    sink.append(clock() - t0)
                if guided.accept(int(token)):
                    break
                plain.accept(int(token))
            guided.close()
            plain.close()
    out = mask_summary(compute, apply, consume, choose_guided, choose_plain)
    out.update(
        {
            "sequences": len(sequences),
            "repeats": repeats,
            "grammar_bytes": len(grammar.encode()),
            "check_ms": 1000 * sum(check_s) / len(check_s) if check_s else None,
            "compile_ms": 1000 * sum(compile_s) / len(compile_s) if compile_s else None,
            "problems": sorted(set(problems)),
        }
    )
    return out


# ---------------------------------------------------------------- 2. prefix cache TTFT


async def prefix_cache_ttft(stack: Stack, system: str, pairs: int) -> dict[str, Any]:
    """One request at a time: a warm-up with the cache, then `pairs` with the cache and `pairs` bypassing it,
    alternated, each with a question of its own; the node's counters around every request."""
    salt = f"features-{uuid.uuid4().hex[:8]}"  # nothing cached before this run is reused
    asks = questions()
    if 2 * pairs + 2 > len(asks):
        raise ValueError(f"at most {(len(asks) - 2) // 2} pairs, asked for {pairs}")
    results: dict[str, list[dict[str, Any]]] = {"cached": [], "bypass": []}
    counters: dict[str, dict[str, float]] = {k: {"prefilled": 0.0, "hits": 0.0} for k in results}
    first = await stack.nodes_samples()

    async def one(question: str, bypass: bool) -> dict[str, Any]:
        before = await stack.nodes_samples()
        record = await run_request(
            stack.client,
            make_request(stack.model, chat(question, system), max_tokens=8, salt=salt, bypass=bypass),
            Record(time.perf_counter()),
        )
        after = await stack.nodes_samples()
        node = node_deltas(before, after)[0]
        return {
            "ttft_ms": None if record.ttft is None else record.ttft * 1000,
            "prompt_tokens": record.prompt_tokens,
            "cached_prompt_tokens": record.cached_prompt_tokens,
            "prefilled": node["prefilled"],
            "hits": node["hits"],
            "question": question,
        }

    warmup = await one(asks[0], False)
    warmup_bypass = await one(asks[1], True)
    for p in range(pairs):
        order = (False, True) if p % 2 == 0 else (True, False)
        for bypass in order:
            kind = "bypass" if bypass else "cached"
            result = await one(asks[2 + 2 * p + bypass], bypass)
            results[kind].append(result)
            counters[kind]["prefilled"] += result["prefilled"]
            counters[kind]["hits"] += result["hits"]
    last = await stack.nodes_samples()
    summary = {
        kind: {
            "ttft_p50_ms": percentile([r["ttft_ms"] for r in rs if r["ttft_ms"] is not None], 50),
            "ttft_p99_ms": percentile([r["ttft_ms"] for r in rs if r["ttft_ms"] is not None], 99),
            "requests": len(rs),
            "prompt_tokens_mean": mean_of(r["prompt_tokens"] for r in rs),
            "cached_prompt_tokens_mean": mean_of(r["cached_prompt_tokens"] for r in rs),
            **counters[kind],
        }
        for kind, rs in results.items()
    }
    return {
        "salt": salt,
        "warmup": [warmup, warmup_bypass],
        "requests": results,
        "summary": summary,
        "speedup": ratio(summary["bypass"]["ttft_p50_ms"], summary["cached"]["ttft_p50_ms"]),
        "counters_before": {"prefill": metric(first[0], PREFILL), "hits": metric(first[0], HITS)},
        "counters_after": {"prefill": metric(last[0], PREFILL), "hits": metric(last[0], HITS)},
    }


async def prefix_burst(stack: Stack, system: str, size: int) -> dict[str, Any]:
    """`size` requests sent at once, each the system prompt and a question of its own, under a salt no request
    used before: bypassing the cache (each reads its whole prompt), then with it (the node reads the system
    prompt once: the others share the cells the first reads while it runs)."""
    asks = questions()
    result: dict[str, Any] = {"requests": size}
    for kind, bypass in (("bypass", True), ("together", False)):
        salt = f"features-burst-{uuid.uuid4().hex[:8]}"
        before = await stack.nodes_samples()
        started = time.perf_counter()
        records = await asyncio.gather(
            *(
                run_request(
                    stack.client,
                    make_request(stack.model, chat(asks[i], system), max_tokens=8, salt=salt, bypass=bypass),
                    Record(time.perf_counter()),
                )
                for i in range(size)
            )
        )
        wall = time.perf_counter() - started
        node = node_deltas(before, await stack.nodes_samples())[0]
        ttfts = [r.ttft * 1000 for r in records if r.ttft is not None]
        result[kind] = {
            "prefilled": node["prefilled"],
            "hits": node["hits"],
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in records),
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_max_ms": max(ttfts, default=None),
            "wall_s": wall,
            "errors": sum(1 for r in records if r.error),
        }
    return result


def mean_of(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


# ---------------------------------------------------------------- 3. isolation

ISOLATION_KINDS = ("without", "plain", "with")


async def isolation_levels(stack: Stack, huge: str, mode: Mode) -> tuple[list[dict[str, Any]], list[int]]:
    """Per round: 8 ordinary streams alone ("without"), with one more stream of plain requests ("plain": the
    huge-guide requests' prompt and length without a guide, what a ninth stream costs anyway) and with one
    stream of huge-guide requests ("with"), the order reversed every other round. Also the tokens of one
    huge-guide output (for the in-process mask timing)."""
    rounds: list[dict[str, Any]] = []
    huge_output: list[int] = []
    for r in range(mode.rounds):
        order = list(ISOLATION_KINDS) if r % 2 == 0 else list(reversed(ISOLATION_KINDS))
        rnd: dict[str, Any] = {"round": r + 1, "order": order}
        for kind in order:
            await wait_quiet_note(rnd, kind)
            groups = [
                Group(
                    "ordinary",
                    ISOLATION_STREAMS,
                    lambda i, k: make_request(
                        stack.model, PROMPTS[(i + k) % len(PROMPTS)], max_tokens=ORDINARY_MAX_TOKENS, ignore_eos=True
                    ),
                )
            ]
            if kind == "with":
                groups.append(
                    Group(
                        "extra",
                        1,
                        lambda i, k: make_request(stack.model, HUGE_PROMPT, max_tokens=HUGE_MAX_TOKENS, schema=huge),
                    )
                )
            elif kind == "plain":
                groups.append(
                    Group(
                        "extra",
                        1,
                        lambda i, k: make_request(
                            stack.model, HUGE_PROMPT, max_tokens=HUGE_MAX_TOKENS, ignore_eos=True
                        ),
                    )
                )
            say(f"  isolation, round {r + 1}: 8 ordinary streams, {ISOLATION_LABELS[kind]}...")
            window = await run_window(stack, groups, mode)
            rnd[kind] = window
            ordinary = window["groups"]["ordinary"]
            extra = ""
            if kind != "without":
                h = window["groups"]["extra"]
                extra = (
                    f"; the extra stream: {h['completed']} requests, {h['errors']} errors, TTFT p50 "
                    f"{fmt(h['ttft_p50_ms'])} ms"
                )
            if kind == "with" and not huge_output:
                done = [rec for rec in groups[1].records if rec.ended and not rec.error and rec.token_ids]
                if done:
                    huge_output = list(done[0].token_ids)
            say(
                f"  isolation, round {r + 1}: {kind}: ITL p50 {fmt(ordinary['itl_p50_ms'])} ms, p99 "
                f"{fmt(ordinary['itl_p99_ms'])} ms, {fmt(ordinary['tok_s'])} tok/s{extra}"
            )
        rounds.append(rnd)
    return rounds, huge_output


ISOLATION_LABELS = {"without": "alone", "plain": "with a plain ninth stream", "with": "with the huge-guide stream"}


def isolation_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ISOLATION_KINDS:
        cells = [rnd[kind]["groups"]["ordinary"] for rnd in rounds if kind in rnd]
        if not cells:
            continue
        out[kind] = {
            key: median([c.get(key) for c in cells])
            for key in ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "tok_s", "ttft_p50_ms")
        }
        out[kind]["gaps"] = sum(c.get("itl_n", 0) for c in cells)
        out[kind]["step_ms"] = median([rnd[kind].get("step_ms") for rnd in rounds if kind in rnd])
    for kind in ("plain", "with"):
        extra = [rnd[kind]["groups"]["extra"] for rnd in rounds if kind in rnd and "extra" in rnd[kind]["groups"]]
        if extra:
            out[f"{kind}_extra"] = {
                "requests": sum(h["completed"] for h in extra),
                "errors": sum(h["errors"] for h in extra),
                "error_samples": [e for h in extra for e in h["error_samples"]][:3],
                "ttft_p50_ms": median([h["ttft_p50_ms"] for h in extra]),
                "mean_output_tokens": median([h["mean_output_tokens"] for h in extra]),
                "finish": merge_counts(h["finish"] for h in extra),
            }
    p99 = lambda kind: out.get(kind, {}).get("itl_p99_ms")  # noqa: E731
    out["ratio"] = ratio(p99("with"), p99("without"))
    out["ratio_to_plain"] = ratio(p99("with"), p99("plain"))
    out["plain_ratio"] = ratio(p99("plain"), p99("without"))
    return out


def merge_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for key, value in c.items():
            out[key] = out.get(key, 0) + value
    return out


# ---------------------------------------------------------------- 4. prefix routing with 2 nodes


async def routing_run(
    stack: Stack, prompts: Sequence[str], plan: Sequence[tuple[int, int]], concurrency: int, random_key: bool
) -> dict[str, Any]:
    """Sends the plan's requests with `concurrency` at once (under a salt of this run's own, so nothing an earlier
    run cached is reused); the nodes' and coordinator's counters around it."""
    salt = f"routing-{uuid.uuid4().hex[:8]}"
    asks = questions()
    queue = list(plan)
    records: list[Record] = []
    nodes_before, coordinator_before = await stack.nodes_samples(), await stack.coordinator_samples()
    foreign = ForeignLoad()
    started = time.perf_counter()

    async def worker() -> None:
        while queue:
            p, q = queue.pop(0)
            record = Record(sent=time.perf_counter())
            records.append(record)
            metadata = (("openengine-routing-key", uuid.uuid4().hex),) if random_key else ()
            try:
                await run_request(
                    stack.client,
                    make_request(stack.model, chat(asks[q], prompts[p]), max_tokens=8, salt=salt),
                    record,
                    metadata,
                )
            except Exception as exc:  # noqa: BLE001 - counted and sampled
                record.error, record.ended = f"{type(exc).__name__}: {str(exc)[:300]}", time.perf_counter()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    foreign_cpus, busiest = foreign.measure()
    nodes_after, coordinator_after = await stack.nodes_samples(), await stack.coordinator_samples()
    nodes = node_deltas(nodes_before, nodes_after)
    decisions = {
        reason: value - by_label(coordinator_before, ROUTING, "reason").get(reason, 0.0)
        for reason, value in by_label(coordinator_after, ROUTING, "reason").items()
    }
    errors = [r.error for r in records if r.error]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in records)
    return {
        "requests": len(records),
        "errors": len(errors),
        "error_samples": errors[:3],
        "seconds": seconds,
        "requests_per_s": len(records) / seconds if seconds > 0 else None,
        "ttft_p50_ms": percentile([r.ttft * 1000 for r in records if r.ttft is not None], 50),
        "nodes": nodes,
        "routing_decisions": {k: v for k, v in decisions.items() if v},
        "hit_rate": hit_rate(sum(n["hits"] or 0.0 for n in nodes), sum(n["prefilled"] or 0.0 for n in nodes)),
        "client_hit_rate": (
            sum(r.cached_prompt_tokens or 0 for r in records) / prompt_tokens if prompt_tokens else None
        ),
        "spread": spread([n["requests"] or 0.0 for n in nodes]),
        "foreign_cpus": foreign_cpus,
        "foreign_busiest": busiest,
        "salt": salt,
    }


ROUTING_NOTES = [
    "Why a random routing key: it takes precedence over the prefix (frontend/requests.py prefix_key is empty with "
    "a key) and rendezvous hashing of a fresh key places each request on either node regardless of its prompt, as a "
    "router blind to prefixes would. kv.bypass_prefix_cache or a random cache_salt would not compare routing: both "
    "also turn the cache itself off (the salt is part of what is cached), and target_rank round robin is the same "
    "blind placement made deterministic.",
    "Both nodes' prefix caches (OPENENGINE_PREFIX_CACHE_TOKENS 8192 cells each, at most 64 entries) hold every system "
    "prompt of a K=4 workload: there blind placement costs only the cold misses (each prompt read once per node "
    "instead of once). A request sent while another of its prompt runs on the same node shares the cells that one "
    "has read, and waits while it reads their common prefix (engine.py _catch_up).",
    "The cache's budget counts every entry's tokens in full, the system prompt cells it shares with other entries "
    "too (prefix_cache.py keep: tokens += len(entry.tokens)), and each ended request adds an entry (its prompt and "
    "output; one with another question does not cover it): 8192 cells hold about 15 entries of a ~520-token "
    "request whatever they share. With K=8 prompts a node that sees all of them (blind placement) cycles through "
    "more prompts than its cache holds entries for; a node that sees its half keeps them.",
]


def spread(handled: Sequence[float]) -> float | None:
    """The busiest node's share of the requests (0.5 with two nodes evenly loaded, 1.0 when one took all)."""
    total = sum(handled)
    return max(handled) / total if total > 0 else None


# ---------------------------------------------------------------- verdicts and the report (pure)


def verdicts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each stated target: met (True/False), or None when its figures are missing."""
    out = []
    guided = doc.get("guided", {}).get("summary", {})
    for n in GUIDED_AT:
        cell = guided.get(str(n))
        if cell is None:
            continue
        r = cell.get("ratio")
        out.append(
            {
                "goal": f"guided decoding at {n} streams: output tok/s >= {GUIDED_SHARE:g}x unguided "
                f"(this bench's bar)",
                "met": None if r is None else r >= GUIDED_SHARE,
                "figures": f"{fmt(cell['guided']['tok_s'])} vs {fmt(cell['unguided']['tok_s'])} tok/s = {fmt(r, 2)}x",
            }
        )
    cache = doc.get("prefix_cache")
    if cache and "summary" in cache:
        s = cache["summary"]
        out.append(
            {
                "goal": f"prefix cache: TTFT p50 several times faster with the cache (>= {CACHE_SPEEDUP:g}x)",
                "met": None if cache.get("speedup") is None else cache["speedup"] >= CACHE_SPEEDUP,
                "figures": f"{fmt(s['cached']['ttft_p50_ms'])} ms with, {fmt(s['bypass']['ttft_p50_ms'])} ms "
                f"without = {fmt(cache.get('speedup'), 1)}x faster",
            }
        )
    isolation = doc.get("isolation", {}).get("summary")
    if isolation:
        r = isolation.get("ratio")
        out.append(
            {
                "goal": f"isolation: ITL p99 of {ISOLATION_STREAMS} ordinary streams with a huge-guide stream "
                f"<= {ISOLATION_FACTOR:g}x without",
                "met": None if r is None else r <= ISOLATION_FACTOR,
                "figures": f"{fmt(isolation['with']['itl_p99_ms'])} vs {fmt(isolation['without']['itl_p99_ms'])} "
                f"ms = {fmt(r, 2)}x",
            }
        )
    return out


def problems(doc: dict[str, Any]) -> list[str]:
    """Errors, stacks that died, windows other processes disturbed, guides that misbehaved."""
    out = list(doc.get("errors", []))

    def window(where: str, w: dict[str, Any]) -> None:
        for name, g in w.get("groups", {"": w}).items():
            if g.get("errors"):
                out.append(
                    f"{where}{' ' + name if name else ''}: {g['errors']} errors, e.g. "
                    f"{(g.get('error_samples') or ['?'])[0]}"
                )
        if (w.get("foreign_cpus") or 0) > FOREIGN_CPUS_NOTED:
            out.append(
                f"{where}: processes this benchmark did not start kept {w['foreign_cpus']:.2f} CPUs busy "
                f"({'; '.join(w.get('foreign_busiest') or []) or '?'})"
            )
        if w.get("stack_alive") is False:
            out.append(f"{where}: a component of the stack exited during the window")
        if w.get("not_drained"):
            out.append(f"{where}: the node still ran or queued requests {DRAIN_TIMEOUT_S:g} s after the window")

    for rnd in doc.get("guided", {}).get("rounds", []):
        for n, level in rnd["levels"].items():
            for kind in ("guided", "unguided"):
                if kind in level:
                    window(f"guided cost, round {rnd['round']}, {n} streams {kind}", level[kind])
    for rnd in doc.get("isolation", {}).get("rounds", []):
        for kind in ISOLATION_KINDS:
            if kind in rnd:
                window(f"isolation, round {rnd['round']}, {kind}", rnd[kind])
    for name, mask in doc.get("guided", {}).get("mask", {}).items():
        for p in mask.get("problems", []):
            out.append(f"mask timing ({name} guide): {p}")
    for workload in doc.get("routing", {}).get("workloads", []):
        for variant, run in workload.get("variants", {}).items():
            window(f"routing, {workload['name']}, {variant}", run)
    return out


def render_report(doc: dict[str, Any]) -> str:
    machine, settings = doc["machine"], doc["settings"]
    lines = [
        f"# Guided decoding and the prefix cache on the llama.cpp engine ({'quick' if settings['quick'] else 'full'}"
        f" run)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['date']}; llama-cpp-python "
        f"{machine['llama_cpp_python']}, llguidance {machine['llguidance']}; Python {machine['python']}; "
        f"openengine-serve {machine['openengine']}.",
        "",
        f"Stack: `{settings['stack']}` (grpcio frontend; components started one by one as `up` starts them, "
        f"each with a metrics port of its own); model {settings['model_file']}; greedy requests from this "
        f"process (AsyncClient). {settings['rounds']} round(s); windows of {settings['window_s']:g} s after "
        f"{settings['warmup_s']:g} s of warm-up; figures over rounds are medians.",
        "",
        f"Command: `{settings['command']}`",
        "",
    ]

    lines += ["## Targets", ""]
    for v in doc.get("verdicts", []):
        state = {True: "**met**", False: "**missed**", None: "n/a"}[v["met"]]
        lines.append(f"- {v['goal']}: {state} ({v['figures']})")
    if not doc.get("verdicts"):
        lines.append("- (no measurement ran)")
    lines.append("")

    guided = doc.get("guided")
    if guided:
        cal = guided.get("calibration", {})
        lines += [
            "## 1. Guided decoding cost",
            "",
            f"N streams each sending requests back to back for the window; the {len(GUIDED_PROMPTS)} chat "
            f"prompts asking for a person as JSON, rotated. "
            f"Guided: `guided.json_schema` = {json.dumps(guided['schema'])} "
            f"(max_tokens {GUIDED_MAX_TOKENS}; the grammar ends the object: {fmt(cal.get('mean_length'))} tokens "
            f"on average alone). Unguided: the same prompts, end of generation ignored, "
            f"{guided.get('unguided_tokens')} tokens (the guided outputs' mean), so that prompt reading weighs "
            f"the same. tok/s: output tokens streamed in the window / the window; step: the node's mean engine "
            f"step in the window; running/queued: the node's gauges sampled each second (the node runs at "
            f"most {settings.get('max_guided_sequences', '?')} guided outputs at once: "
            f"OPENENGINE_MAX_GUIDED_SEQUENCES).",
            "",
            "| streams | requests | tok/s | tokens/request | TTFT p50 (ms) | step (ms) | running | queued | "
            "requests done | errors | guided/unguided |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for n, cell in guided.get("summary", {}).items():
            for kind in ("unguided", "guided"):
                c = cell[kind]
                lines.append(
                    f"| {n} | {kind} | {fmt(c['tok_s'])} | {fmt(c['mean_output_tokens'])} | "
                    f"{fmt(c['ttft_p50_ms'])} | {fmt(c['step_ms'])} | {fmt(c['running_mean'])} | "
                    f"{fmt(c['queued_mean'])} | {c['requests']} | {c['errors']} | "
                    f"{fmt(cell['ratio'], 2) + 'x' if kind == 'guided' and cell['ratio'] is not None else ''} |"
                )
        lines.append("")
        masks = guided.get("mask", {})
        if masks:
            lines += [
                "### The mask's cost per token (in-process)",
                "",
                "llguidance on the model's vocabulary (`guides.vocabulary`), over the tokens the stack generated "
                "for each guide (plus the step that chooses the end), repeated: `unsafe_compute_mask_ptr`, then "
                "`np.unpackbits` and the assignment of -inf as sampling.py does (mask), and `consume_token` "
                "(consume); and the engine's own `OutputSampler.choose` (greedy) with the guide minus without "
                "(choose Δ). check / compile: the frontend's `guides.check` and the engine's `guides.matcher` "
                "of the guide, each time a request comes.",
                "",
                "| guide | grammar (bytes) | tokens timed | compute (µs) | apply (µs) | mask mean (µs) | "
                "mask p99 (µs) | mask max (µs) | consume (µs) | choose Δ (µs) | check (ms) | compile (ms) |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for name, m in masks.items():
                lines.append(
                    f"| {name} | {m['grammar_bytes']} | {m['tokens']} | {fmt(m['compute_us'])} | "
                    f"{fmt(m['apply_us'])} | {fmt(m['mask_us'])} | {fmt(m['mask_p99_us'])} | "
                    f"{fmt(m['mask_max_us'])} | {fmt(m['consume_us'])} | {fmt(m['choose_delta_us'])} | "
                    f"{fmt(m['check_ms'], 2)} | {fmt(m['compile_ms'], 2)} |"
                )
            lines.append("")
            for share in guided.get("step_shares", []):
                lines.append(
                    f"- {share['streams']} guided streams: {fmt(share['guided_per_step'])} guided outputs "
                    f"per step × {fmt(share['per_token_us'])} µs (mask + consume) = "
                    f"{fmt(share['mask_ms_per_step'], 2)} ms of a {fmt(share['step_ms'])} ms step "
                    f"({fmt(100 * share['share'] if share['share'] is not None else None)} %); the unguided "
                    f"step at the same streams: {fmt(share['unguided_step_ms'])} ms."
                )
            lines.append("")

    cache = doc.get("prefix_cache")
    if cache and "summary" in cache:
        s = cache["summary"]
        lines += [
            "## 2. Prefix cache: time to first token",
            "",
            f"One request at a time: a system prompt of {fmt(s['cached']['prompt_tokens_mean'], 0)} prompt "
            f"tokens in all (a ~{settings['cache_system_tokens']}-token system message and a short question of "
            f"its own, chat template), 8 output tokens, under a salt of this run; one warm-up request with the "
            f"cache, then {s['cached']['requests']} with it and {s['bypass']['requests']} with "
            f"`kv.bypass_prefix_cache`, alternated. prefilled / hit: the node's "
            f"`openengine_node_prefill_tokens_total` and `openengine_node_prefix_cache_hit_tokens_total` "
            f"summed over those requests.",
            "",
            "| requests | TTFT p50 (ms) | TTFT p99 (ms) | cached_prompt_tokens (mean) | prefilled | hit |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for kind, label in (("cached", "with the cache"), ("bypass", "bypass_prefix_cache")):
            c = s[kind]
            lines.append(
                f"| {label} | {fmt(c['ttft_p50_ms'])} | {fmt(c['ttft_p99_ms'])} | "
                f"{fmt(c['cached_prompt_tokens_mean'])} | {c['prefilled']:.0f} | {c['hits']:.0f} |"
            )
        b, a = cache["counters_before"], cache["counters_after"]
        lines += [
            "",
            f"With the cache {fmt(cache['speedup'], 1)}x faster. Node counters before → after the whole "
            f"measurement (warm-ups included): prefill {b['prefill']:.0f} → {a['prefill']:.0f}, prefix cache "
            f"hits {b['hits']:.0f} → {a['hits']:.0f}.",
            "",
        ]
        burst = cache.get("burst")
        if burst:
            lines += [
                f"{burst['requests']} requests sent at once, the same system prompt and a question each, under a "
                f"salt no request used before (nothing cached): the node's prompt tokens read and reused for the "
                f"burst, its TTFT, and the time until the last request ended.",
                "",
                "| burst | prompt tokens | prefilled | hit | TTFT p50 (ms) | TTFT max (ms) | all ended (s) | errors |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for kind, label in (("together", "with the cache"), ("bypass", "bypass_prefix_cache")):
                c = burst[kind]
                lines.append(
                    f"| {label} | {c['prompt_tokens']} | {c['prefilled']:.0f} | {c['hits']:.0f} | "
                    f"{fmt(c['ttft_p50_ms'])} | {fmt(c['ttft_max_ms'])} | {fmt(c['wall_s'], 2)} | {c['errors']} |"
                )
            lines.append("")

    isolation = doc.get("isolation")
    if isolation and "summary" in isolation:
        s = isolation["summary"]
        huge = isolation.get("huge_guide", {})
        lines += [
            "## 3. Isolation from a huge guide",
            "",
            f"{ISOLATION_STREAMS} ordinary streams (greedy, {ORDINARY_MAX_TOKENS} tokens, end of generation "
            f"ignored): alone; with a ninth stream sending, back to back, requests guided by a JSON schema of "
            f"{huge.get('bytes', '?')} bytes (an anyOf of {huge.get('objects', '?')} closed objects of 6 enum "
            f"fields of 20 words; the frontend's limit is {MAX_GUIDE_BYTES} bytes; max_tokens {HUGE_MAX_TOKENS}); "
            f"and, as a control, with a ninth stream of the same prompt unguided ({HUGE_MAX_TOKENS} tokens, end "
            f"of generation ignored): what any ninth stream costs. ITL: the gaps between successive token "
            f"responses of the ordinary streams that ended in the window.",
            "",
            "| ordinary streams | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) | gaps | tok/s | step (ms) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for kind in ISOLATION_KINDS:
            c = s.get(kind)
            if c is None:
                continue
            lines.append(
                f"| {ISOLATION_LABELS[kind]} | {fmt(c['itl_p50_ms'])} | {fmt(c['itl_p99_ms'])} | "
                f"{fmt(c['itl_max_ms'])} | {c['gaps']} | {fmt(c['tok_s'])} | {fmt(c['step_ms'])} |"
            )
        lines += [
            "",
            f"ITL p99 with the huge-guide stream / alone: {fmt(s['ratio'], 2)}x; with a plain ninth stream / "
            f"alone: {fmt(s.get('plain_ratio'), 2)}x; huge-guide / plain ninth stream: "
            f"{fmt(s.get('ratio_to_plain'), 2)}x.",
        ]
        for kind, label in (("with_extra", "The huge-guide stream"), ("plain_extra", "The plain ninth stream")):
            h = s.get(kind)
            if h:
                lines.append(
                    f"{label}: {h['requests']} requests completed in the windows "
                    f"({', '.join(f'{k} {v}' for k, v in h['finish'].items()) or '–'}), {h['errors']} errors, "
                    f"TTFT p50 {fmt(h['ttft_p50_ms'])} ms, {fmt(h['mean_output_tokens'])} tokens each."
                )
        lines.append("")
        rows = []
        for rnd in isolation.get("rounds", []):
            for kind in rnd.get("order", []):
                c = rnd[kind]["groups"]["ordinary"]
                rows.append(
                    f"| {rnd['round']} | {ISOLATION_LABELS[kind]} | {fmt(c['itl_p50_ms'])} | "
                    f"{fmt(c['itl_p99_ms'])} | {fmt(c['tok_s'])} | {fmt(rnd[kind].get('foreign_cpus'), 2)} |"
                )
        if rows:
            lines += [
                "| round | ordinary streams | ITL p50 (ms) | ITL p99 (ms) | tok/s | other CPUs |",
                "| ---: | --- | ---: | ---: | ---: | ---: |",
                *rows,
                "",
            ]

    routing = doc.get("routing")
    if routing and routing.get("workloads"):
        stacks = "`; `".join(routing.get("stacks", {}).values()) or routing.get("stack", "")
        lines += [
            "## 4. Prefix routing with 2 nodes",
            "",
            f"`{stacks}`. Each workload: K system prompts of ~{settings['routing_system_tokens']} "
            f"tokens (each names its own organization first: their first 64 tokens, which name a prefix for "
            f"routing, differ; after a shared preamble, the preamble's first 64 tokens are the same for all), "
            f"each shared by R requests with distinct short questions (8 output tokens), in "
            f"one shuffled order, {settings['routing_concurrency']} at a time, under a salt of each run's own. "
            f"by kv-events: no routing key, the coordinator sends a request to the node whose prefix cache holds "
            f"the longest run of its first KV blocks (of several, the one a hash of the run names; it follows the "
            f"nodes' KV events, and counts the blocks of a "
            f"request it has just routed as on that node until they are cached); a prompt no node holds goes to "
            f"the node holding the fewest distinct blocks; "
            f"by first-tokens: no routing key, the node a hash of its first 64 "
            f"tokens names; random key: an `openengine-routing-key` of its own per request, which takes "
            f"precedence and places each request without regard to its prefix. Hit rate: hit / (hit + "
            f"prefilled) prompt tokens over both nodes' counters.",
            "",
            "| workload | routing | requests | hit rate | client hit rate | requests per node | prefilled per node | "
            "busiest share | routing decisions | TTFT p50 (ms) | requests/s | errors |",
            "| --- | --- | ---: | ---: | ---: | --- | --- | ---: | --- | ---: | ---: | ---: |",
        ]
        for workload in routing["workloads"]:
            for variant, run in workload.get("variants", {}).items():
                per_node = " / ".join(f"{n['requests']:.0f}" for n in run["nodes"])
                prefilled = " / ".join(f"{n.get('prefilled', 0):.0f}" for n in run["nodes"])
                decisions = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run["routing_decisions"].items()))
                lines.append(
                    f"| {workload['name']} | {variant} | {run['requests']} | {fmt(run['hit_rate'], 3)} | "
                    f"{fmt(run['client_hit_rate'], 3)} | {per_node} | {prefilled} | {fmt(run['spread'], 2)} | "
                    f"{decisions} | "
                    f"{fmt(run['ttft_p50_ms'])} | {fmt(run['requests_per_s'], 2)} | {run['errors']} |"
                )
        lines.append("")
        for note in routing.get("notes", []):
            lines.append(f"- {note}")
        lines.append("")

    lora = doc.get("lora")
    if lora and lora.get("summary"):
        lines += [
            "## 5. LoRA mixing",
            "",
            f"`{lora['stack']}`, {LORA_ADAPTERS} adapters loaded (tools/make_test_lora.py, rank 8 on attn_q and "
            f"attn_v). {LORA_STREAMS} streams sending requests back to back ({LORA_MAX_TOKENS} output tokens, end "
            f"of generation ignored), each with the adapter its mix gives it. A step decodes the outputs of each "
            f"adapter (the base model counting as one) in a batch of their own.",
            "",
            "| mix | tok/s | vs base model only | step (ms) | ITL p50 (ms) | ITL p99 (ms) | errors |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, cell in lora["summary"].items():
            lines.append(
                f"| {name} | {fmt(cell['tok_s'])} | {fmt(cell['vs_base'], 2)} | {fmt(cell['step_ms'], 1)} | "
                f"{fmt(cell['itl_p50_ms'])} | {fmt(cell['itl_p99_ms'])} | {cell['errors']} |"
            )
        lines.append("")

    found = doc.get("problems", [])
    if found:
        lines += ["## Problems", "", *[f"- {p}" for p in found], ""]
    if doc.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in doc["notes"]], ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- orchestration


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m openengine_bench.features",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"one round of {QUICK.window_s:g} s windows, fewer requests "
        f"(default: {FULL.rounds} rounds of {FULL.window_s:g} s)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="where features.json and report.md go (default docs/bench/features)",
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=DEFAULT_LOGS,
        help="the stacks' logs, appended (default bench-results/features-logs)",
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)} (default: all)")
    p.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="OPENENGINE_THREADS of the one node (default: this process's CPUs); with 2 nodes each gets half",
    )
    p.add_argument(
        "--cache-system-tokens",
        type=int,
        default=1000,
        help="the prefix cache TTFT's system prompt (tokens, default 1000)",
    )
    p.add_argument(
        "--routing-system-tokens", type=int, default=500, help="each routing system prompt (tokens, default 500)"
    )
    p.add_argument(
        "--routing-rules",
        default=",".join(ROUTING_RULES),
        help=f"the coordinator rules to compare, each on its own stack, random keys on the first "
        f"(default {','.join(ROUTING_RULES)})",
    )
    p.add_argument(
        "--routing-workloads",
        default="",
        help="the routing workloads, comma list of KxR (K system prompts, R requests each) or KxR+P (after a "
        f"shared P-token preamble) (default {','.join(map(str, FULL.routing))}; --quick "
        f"{','.join(map(str, QUICK.routing))})",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="before each measurement, wait up to this many minutes while processes this benchmark did "
        "not start keep more than 0.25 CPU busy (default 20; 0: do not wait)",
    )
    return p


def node_env(threads: int) -> dict[str, str]:
    """The node settings, explicit (the defaults of OPENENGINE_* but the threads)."""
    return {
        "OPENENGINE_ENGINE": "llama.cpp",
        "OPENENGINE_THREADS": str(threads),
        "OPENENGINE_MAX_BATCH": "32",
        "OPENENGINE_CONTEXT_SIZE": "16384",
        "OPENENGINE_PREFILL_CHUNK": "256",
        "OPENENGINE_PREFIX_CACHE_TOKENS": "8192",
        "OPENENGINE_MAX_GUIDED_SEQUENCES": "32",
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mode = QUICK if args.quick else FULL
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"unknown part(s) {', '.join(unknown) or '(none)'}; known: {', '.join(PARTS)}")
    rules = [r.strip() for r in args.routing_rules.split(",") if r.strip()]
    if not rules or set(rules) - set(ROUTING_RULES):
        raise SystemExit(f"--routing-rules: one or more of {', '.join(ROUTING_RULES)}, got {args.routing_rules!r}")
    try:
        routing_workloads = (
            [RoutingWorkload.parse(w) for w in args.routing_workloads.split(",") if w.strip()]
            if args.routing_workloads
            else list(mode.routing)
        )
    except ValueError as exc:
        raise SystemExit(f"--routing-workloads: {exc}") from None
    QUIET_LIMIT_S[0] = args.quiet_wait * 60
    unwind_on_sigterm()

    import numpy as np  # noqa: F401 - fail early when missing

    from openengine_serve.common import guides
    from openengine_serve.common.tokenizers import GgufTokenizer, tokenizer_for
    from openengine_serve.engine.model_card import default_model_path, gguf_card

    model = str(default_model_path())
    say("loading the model's vocabulary (llama.cpp, llguidance)...")
    tokenizer = tokenizer_for(gguf_card(model, 4096))
    assert isinstance(tokenizer, GgufTokenizer)  # a GGUF card's
    ll_tokenizer = guides.vocabulary(tokenizer._vocab)
    count = lambda text: len(tokenizer.encode(text))

    schema = json.dumps(PERSON_SCHEMA)
    small_grammar = guides.grammar_of("json_schema", schema)
    huge = huge_schema(MAX_GUIDE_BYTES - HUGE_GUIDE_MARGIN)
    huge_text = json.dumps(huge)
    huge_grammar = guides.grammar_of("json_schema", huge_text)
    guides.check("json_schema", huge_grammar, ll_tokenizer, guides.Limits())  # the frontend would refuse it else
    cache_system = grow_text(
        "You are the help desk assistant of the Riverside Public Library.", RULES, count, args.cache_system_tokens
    )

    one_node = node_env(args.threads)
    two_nodes = node_env(max(1, args.threads // 2))
    command = (
        "python -m openengine_bench.features"
        + (" --quick" if args.quick else "")
        + (f" --output {args.output}" if args.output != DEFAULT_OUTPUT else "")
        + (f" --parts {args.parts}" if parts != list(PARTS) else "")
        + (f" --routing-rules {','.join(rules)}" if rules != list(ROUTING_RULES) else "")
    )
    doc: dict[str, Any] = {
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "cpus_allowed": len(os.sched_getaffinity(0)),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "llama_cpp_python": version("llama_cpp_python"),
            "llguidance": version("llguidance"),
            "grpcio": version("grpcio"),
            "openengine": f"{version('openengine-serve')} ({git_commit()})",
        },
        "settings": {
            "quick": args.quick,
            "parts": parts,
            **asdict(mode),
            "model_file": Path(model).name,
            "command": command,
            "stack": Stack(1, one_node, args.logs, "").describe(),
            "stack_two_nodes": Stack(2, two_nodes, args.logs, "").describe(),
            "max_guided_sequences": int(one_node["OPENENGINE_MAX_GUIDED_SEQUENCES"]),
            "cache_system_tokens": args.cache_system_tokens,
            "routing_system_tokens": args.routing_system_tokens,
            "routing_concurrency": mode.routing_concurrency,
        },
        "errors": [],
        "notes": [],
    }
    output = args.output
    output.mkdir(parents=True, exist_ok=True)
    say(f"features bench: {', '.join(parts)} -> {output}")

    async def single_node() -> tuple[list[list[int]], list[int]]:
        stack = Stack(1, one_node, args.logs, "one-node")
        calibration_outputs: list[list[int]] = []
        huge_output: list[int] = []
        try:
            say("starting the stack (1 node)...")
            await stack.start()
            doc["settings"]["served_model"] = stack.model
            for _ in range(2):  # warm-up: page-in, first-request paths, the guide path
                await run_request(
                    stack.client, make_request(stack.model, PROMPTS[0], max_tokens=16), Record(time.perf_counter())
                )
                await run_request(
                    stack.client,
                    make_request(stack.model, GUIDED_PROMPTS[0], max_tokens=32, schema=schema),
                    Record(time.perf_counter()),
                )
            if "guided" in parts:
                calibration = await calibrate_guided(stack, schema)
                calibration_outputs = [o["token_ids"] for o in calibration["outputs"] if o["token_ids"]]
                unguided_tokens = max(1, round(calibration["mean_length"]))
                doc["guided"] = {
                    "schema": PERSON_SCHEMA,
                    "calibration": {
                        "lengths": calibration["lengths"],
                        "mean_length": calibration["mean_length"],
                        "finish": [o["finish"] for o in calibration["outputs"]],
                        "texts": [
                            tokenizer.decode_bytes(o["token_ids"]).decode("utf-8", "replace")
                            for o in calibration["outputs"]
                        ],
                    },
                    "unguided_tokens": unguided_tokens,
                }
                doc["guided"]["rounds"] = await guided_levels(stack, schema, unguided_tokens, mode)
                doc["guided"]["summary"] = guided_summary(doc["guided"]["rounds"])
                write_json(output / "features.json", doc)
            if "cache" in parts:
                await wait_quiet_note(doc.setdefault("quiet", {}), "cache")
                say("prefix cache TTFT...")
                doc["prefix_cache"] = await prefix_cache_ttft(stack, cache_system, mode.cache_pairs)
                doc["prefix_cache"]["burst"] = await prefix_burst(stack, cache_system, BURST)
                s = doc["prefix_cache"]["summary"]
                say(
                    f"  prefix cache: TTFT p50 {fmt(s['cached']['ttft_p50_ms'])} ms with, "
                    f"{fmt(s['bypass']['ttft_p50_ms'])} ms without ({fmt(doc['prefix_cache']['speedup'], 1)}x)"
                )
                write_json(output / "features.json", doc)
            if "isolation" in parts:
                rounds, huge_output = await isolation_levels(stack, huge_text, mode)
                doc["isolation"] = {
                    "huge_guide": {"bytes": len(huge_text.encode()), "objects": len(huge["anyOf"])},
                    "rounds": rounds,
                    "summary": isolation_summary(rounds),
                }
                write_json(output / "features.json", doc)
        except Exception as exc:  # noqa: BLE001 - reported; the other parts still run
            doc["errors"].append(f"one-node stack: {type(exc).__name__}: {exc}")
            say(f"FAILED: {doc['errors'][-1]}")
        finally:
            say("stopping the stack (1 node)...")
            await stack.stop()
        return calibration_outputs, huge_output

    async def two_node() -> None:
        """The routing workloads on one 2-node stack per coordinator rule (OPENENGINE_PREFIX_ROUTING); the blind
        placement (a random key per request) on the first."""
        doc["routing"] = {"stacks": {}, "workloads": [], "notes": []}
        workloads: dict[RoutingWorkload, dict[str, Any]] = {}
        for rule in rules:
            env = {**two_nodes, "OPENENGINE_PREFIX_ROUTING": rule}
            stack = Stack(2, env, args.logs, f"two-nodes-{rule}")
            doc["routing"]["stacks"][rule] = stack.describe()
            variants = [f"by {rule}"] + (["random key"] if rule == rules[0] else [])
            try:
                say(f"starting the stack (2 nodes, routing by {rule})...")
                await stack.start()
                for _ in range(2):
                    await run_request(
                        stack.client, make_request(stack.model, PROMPTS[0], max_tokens=8), Record(time.perf_counter())
                    )
                for spec in routing_workloads:
                    prompts = system_prompts(
                        spec.k, count, args.routing_system_tokens, preamble_tokens=spec.preamble_tokens
                    )
                    plan = routing_plan(spec.k, spec.per_prompt)
                    workload = workloads.get(spec)
                    if workload is None:
                        workload = workloads[spec] = {
                            "name": spec.name,
                            "k": spec.k,
                            "per_prompt": spec.per_prompt,
                            "preamble_tokens": spec.preamble_tokens,
                            "prompt_tokens": [count(chat(questions()[0], p)) for p in prompts],
                            "variants": {},
                        }
                        doc["routing"]["workloads"].append(workload)
                    for variant in variants:
                        await wait_quiet_note(workload, variant)
                        say(f"  routing {workload['name']}: {variant}...")
                        random_key = variant == "random key"
                        run = await routing_run(stack, prompts, plan, mode.routing_concurrency, random_key)
                        workload["variants"][variant] = run
                        say(
                            f"  routing {workload['name']}: {variant}: hit rate {fmt(run['hit_rate'], 3)}, per "
                            f"node {[n['requests'] for n in run['nodes']]}, {run['routing_decisions']}, "
                            f"{run['errors']} errors"
                        )
                        await stack.drain()
                    write_json(output / "features.json", doc)
            except Exception as exc:  # noqa: BLE001
                doc["errors"].append(f"two-node stack ({rule}): {type(exc).__name__}: {exc}")
                say(f"FAILED: {doc['errors'][-1]}")
            finally:
                say("stopping the stack (2 nodes)...")
                await stack.stop()
        doc["routing"]["notes"] += ROUTING_NOTES

    async def lora_node() -> None:
        lora_dir = args.logs / "loras"
        write_adapters(model, lora_dir)
        env = {**one_node, "OPENENGINE_LORA_DIR": str(lora_dir), "OPENENGINE_MAX_LORAS": str(LORA_ADAPTERS)}
        stack = Stack(1, env, args.logs, "lora")
        doc["lora"] = {"stack": stack.describe()}
        try:
            say("starting the stack (1 node, LoRA)...")
            await stack.start()
            await run_request(
                stack.client, make_request(stack.model, PROMPTS[0], max_tokens=8), Record(time.perf_counter())
            )
            doc["lora"].update(await lora_mixes(stack, mode))
            write_json(output / "features.json", doc)
        except Exception as exc:  # noqa: BLE001
            doc["errors"].append(f"LoRA stack: {type(exc).__name__}: {exc}")
            say(f"FAILED: {doc['errors'][-1]}")
        finally:
            say("stopping the stack (LoRA)...")
            await stack.stop()

    async def run_all() -> None:
        if QUIET_LIMIT_S[0] > 0:
            doc["foreign_cpus_at_start"] = await wait_quiet(QUIET_LIMIT_S[0])
        calibration_outputs: list[list[int]] = []
        huge_output: list[int] = []
        if {"guided", "cache", "isolation"} & set(parts):
            calibration_outputs, huge_output = await single_node()
        if "guided" in parts and "guided" in doc:
            say("timing the mask in-process...")
            masks = {}
            if calibration_outputs:
                masks["person (small)"] = measure_mask(
                    small_grammar,
                    calibration_outputs,
                    ll_tokenizer,
                    tokenizer.n_vocab,
                    tokenizer.end_of_generation,
                    mode.mask_repeats,
                )
            if huge_output:
                masks["huge (anyOf)"] = measure_mask(
                    huge_grammar,
                    [huge_output],
                    ll_tokenizer,
                    tokenizer.n_vocab,
                    tokenizer.end_of_generation,
                    mode.mask_repeats * 4,
                )
            doc["guided"]["mask"] = masks
            small = masks.get("person (small)")
            shares = []
            for n, cell in doc["guided"].get("summary", {}).items():
                g = cell["guided"]
                guided_per_step = (
                    None
                    if g["running_mean"] is None
                    else min(g["running_mean"], doc["settings"]["max_guided_sequences"])
                )
                per_token = small["per_token_us"] if small else None
                share = step_share(per_token, guided_per_step, g["step_ms"])
                shares.append(
                    {
                        "streams": int(n),
                        "guided_per_step": guided_per_step,
                        "per_token_us": per_token,
                        "mask_ms_per_step": None
                        if per_token is None or guided_per_step is None
                        else per_token * guided_per_step / 1000,
                        "step_ms": g["step_ms"],
                        "share": share,
                        "unguided_step_ms": cell["unguided"]["step_ms"],
                    }
                )
            doc["guided"]["step_shares"] = shares
            write_json(output / "features.json", doc)
        if "routing" in parts:
            await two_node()
        if "lora" in parts:
            await lora_node()

    from openengine_serve.common.lifecycle import run

    try:
        run(run_all())
    except KeyboardInterrupt:
        doc["errors"].append("interrupted")
    doc["verdicts"] = verdicts(doc)
    doc["problems"] = problems(doc)
    doc["notes"] += [
        "Guided requests are compiled twice per request, as served: the frontend checks the guide before reserving "
        "(guides.check), the engine builds its matcher in a worker thread (guides.matcher); llguidance builds its "
        "lexer lazily, so most of a large guide's cost lands in the first masks rather than in compilation.",
        "The in-process mask timing runs in this process after the one-node stack stopped (a quiet machine), one "
        "token at a time: in the engine it runs inside every step, once per running guided output.",
    ]
    write_json(output / "features.json", doc)
    report = render_report(doc)
    (output / "report.md").write_text(report)
    print(report)
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
