"""One long request beside many short streams: does it complete, and what does it cost them?

    python -m openengine_bench.long_request [--targets openengine-grpcio,llama-server] [--output DIR]

Each target (the engines bench's: our stack, llama-server as its users start it...) gets --streams short
streams (greedy, 128 output tokens, back to back, prompts rotated from the engines bench's set). After a warm-up
their output is measured alone for --window seconds; then one request of --prompt-tokens prompt tokens and
--output-tokens output tokens (end of generation ignored) joins them, and the short streams are measured while it
reads its prompt and while it generates, until it ends. Reported per target: whether the long request completed
(or the server's error), its time to first token and its output tokens/s, and the short streams' tokens/s and
TTFT p50 in each phase. Results: DIR/long.json and DIR/report.md (also printed).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import engines
from .children import unwind_on_sigterm
from .engines import PROMPTS, Settings, Target, fmt, make_target, percentile, write_json

DEFAULT_OUTPUT = engines.REPO / "docs" / "bench" / "long-request"
PHASES = ("alone", "prompt", "generation")
MIN_PHASE_S = 1.0  # a shorter phase (a long request refused at once) gets no tokens/s: too few steps to count
PHASE_TITLES = {
    "alone": "short streams alone",
    "prompt": "while the long request reads its prompt",
    "generation": "while it generates",
}


def long_prompt(model: str, tokens: int) -> str:
    """A text of `tokens` tokens in the model's own vocabulary (llama.cpp's tokenizer, vocabulary only): the
    engines bench's prompts, numbered, repeated until long enough, then cut at a token boundary."""
    from llama_cpp import Llama

    vocab = Llama(model_path=model, vocab_only=True, verbose=False)
    text, k = "", 0
    while len(vocab.tokenize(text.encode(), add_bos=False)) < tokens:
        text += f"{k + 1}. {PROMPTS[k % len(PROMPTS)]}\n"
        k += 1
    ids = vocab.tokenize(text.encode(), add_bos=False)[:tokens]
    return vocab.detokenize(ids).decode("utf-8", "replace")


@dataclass
class Phases:
    """What the short streams got in each phase: tokens streamed and the TTFT of requests whose first token came
    then; the phase changes when the window opens, the long request is sent and its first token arrives."""

    phase: str = "warmup"
    started: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    ttft_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        if self.phase in PHASES:
            self.ended[self.phase] = now
        self.phase = phase
        if phase in PHASES:
            self.started[phase] = now

    def summary(self) -> dict[str, dict[str, Any]]:
        out = {}
        for p in PHASES:
            seconds = self.ended.get(p, 0.0) - self.started.get(p, 0.0)
            ttft_ms = [t * 1000 for t in self.ttft_s[p]]
            out[p] = {
                "seconds": seconds,
                "tokens": self.tokens[p],
                "tok_s": self.tokens[p] / seconds if seconds >= MIN_PHASE_S else None,
                "ttft_p50_ms": percentile(ttft_ms, 50),
                "ttft_n": len(ttft_ms),
            }
        return out


async def short_stream(target: Target, i: int, max_tokens: int, phases: Phases) -> None:
    k = 0
    while phases.phase != "closed":
        sent, first = time.perf_counter(), True

        def on_tokens(n: int) -> None:
            nonlocal first
            if n <= 0:
                return
            if phases.phase in PHASES:
                phases.tokens[phases.phase] += n
                if first:
                    phases.ttft_s[phases.phase].append(time.perf_counter() - sent)
            first = False

        try:
            await target.request(PROMPTS[(i + k) % len(PROMPTS)], max_tokens, on_tokens)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - counted and sampled; the stream goes on
            if phases.phase != "closed":
                phases.errors += 1
                if len(phases.error_samples) < 5:
                    phases.error_samples.append(f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(0.5)
        k += 1


async def long_request(target: Target, prompt: str, max_tokens: int, phases: Phases) -> dict[str, Any]:
    sent = time.perf_counter()
    first_at: float | None = None
    tokens = 0

    def on_tokens(n: int) -> None:
        nonlocal first_at, tokens
        if n <= 0:
            return
        if first_at is None:
            first_at = time.perf_counter()
            phases.enter("generation")
        tokens += n

    result: dict[str, Any] = {}
    try:
        await target.request(prompt, max_tokens, on_tokens)
    except Exception as exc:  # noqa: BLE001 - the server's refusal is the result
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    ended = time.perf_counter()
    generating = ended - first_at if first_at is not None else None
    result.update(
        completed=tokens == max_tokens and "error" not in result,
        output_tokens=tokens,
        ttft_s=first_at - sent if first_at is not None else None,
        seconds=ended - sent,
        output_tok_s=(tokens - 1) / generating if generating and tokens > 1 else None,
    )
    return result


async def run_target(
    name: str, settings: Settings, logdir: Path, args: argparse.Namespace, prompt: str
) -> dict[str, Any]:
    target = make_target(name, settings, logdir)
    result: dict[str, Any] = {}
    try:
        await target.start()
        result["command"] = target.describe()
        for _ in range(2):
            await engines.settle(target, max_tokens=16)
        phases = Phases()
        tasks = [asyncio.create_task(short_stream(target, i, settings.max_tokens, phases)) for i in range(args.streams)]
        try:
            await asyncio.sleep(args.warmup)
            phases.enter("alone")
            await asyncio.sleep(args.window)
            phases.enter("prompt")
            print(f"  {name}: the long request joins {args.streams} streams", file=sys.stderr, flush=True)
            long = await asyncio.wait_for(
                long_request(target, prompt, args.output_tokens, phases), engines.REQUEST_TIMEOUT_S
            )
            phases.enter("closed")
        finally:
            phases.phase = "closed"
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        result.update(long=long, short=phases.summary(), errors=phases.errors, error_samples=phases.error_samples)
        print(f"  {name}: {describe(result)}", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - a target that fails is reported, the others still run
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  {name}: FAILED: {result['error']}", file=sys.stderr, flush=True)
    finally:
        await target.stop()
    return result


def describe(result: dict[str, Any]) -> str:
    long = result.get("long", {})
    if not long.get("completed"):
        return f"long request not completed ({long.get('output_tokens', 0)} tokens): {long.get('error', '')}"
    return f"long request completed: TTFT {fmt(long['ttft_s'], 1)} s, {fmt(long['output_tok_s'], 1)} tok/s"


def render_report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    lines = [
        "# One long request beside short streams",
        "",
        f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores, {doc['machine']['date']}. "
        f"{s['streams']} short streams (greedy, {s['max_tokens']} output tokens, back to back); after "
        f"{s['window']:g} s alone, one request of {s['prompt_tokens']:,} prompt tokens and {s['output_tokens']:,} "
        f"output tokens (end of generation ignored) joins them. Model {s['model_file']}, {s['threads']} threads, "
        f"context {s['context_size']:,}, batch {s['max_batch']}.",
        "",
        "| target | long request | its TTFT | its output tok/s | short tok/s: "
        + " | ".join(PHASE_TITLES[p] for p in PHASES)
        + " | short TTFT p50 (ms): "
        + " | ".join(PHASE_TITLES[p] for p in PHASES)
        + " |",
        "|---" * (4 + 2 * len(PHASES)) + "|",
    ]
    for name, result in doc["results"].items():
        long = result.get("long", {})
        if "error" in result and not long:
            lines.append(f"| {name} | failed: {result['error'][:200]} |" + " |" * (2 + 2 * len(PHASES)))
            continue
        verdict = (
            f"completed ({long['output_tokens']:,} tokens, {fmt(long['seconds'], 0)} s)"
            if long["completed"]
            else f"not completed ({long['output_tokens']} tokens): {long.get('error', '')[:160]}"
        )
        short = result["short"]
        lines.append(
            f"| {name} | {verdict} | {fmt(long['ttft_s'], 1)} s | {fmt(long['output_tok_s'], 1)} | "
            + " | ".join(fmt(short[p]["tok_s"], 1) for p in PHASES)
            + " | "
            + " | ".join(fmt(short[p]["ttft_p50_ms"], 0) for p in PHASES)
            + " |"
        )
    lines += ["", "Commands:", ""]
    lines += [f"- {name}: `{result['command']}`" for name, result in doc["results"].items() if result.get("command")]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m openengine_bench.long_request", description=__doc__.split("\n\n")[0].strip()
    )
    p.add_argument("--targets", default=f"{engines.GRPCIO},{engines.LLAMA_SERVER}", help="engines bench targets")
    p.add_argument("--streams", type=int, default=31, help="short streams (default 31)")
    p.add_argument("--prompt-tokens", type=int, default=6000, help="the long request's prompt (default 6000)")
    p.add_argument("--output-tokens", type=int, default=1000, help="the long request's output (default 1000)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per short request (default 128)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the short streams are measured")
    p.add_argument("--window", type=float, default=30.0, help="seconds the short streams are measured alone")
    engines.add_engine_arguments(p)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--logs", type=Path, default=engines.REPO / "bench-results" / "long-request-logs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unwind_on_sigterm()
    targets = engines.parse_targets(args.targets)
    settings = engines.settings_from(args, targets)
    prompt = long_prompt(settings.model, args.prompt_tokens)
    doc: dict[str, Any] = {
        "machine": {
            "cpu": engines.cpu_model(),
            "cores": os.cpu_count(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "openengine": f"{engines.version('openengine-serve')} ({engines.git_commit()})",
        },
        "settings": {
            **asdict(settings),
            "model_file": Path(settings.model).name,
            "streams": args.streams,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "warmup": args.warmup,
            "window": args.window,
        },
        "results": {},
    }
    args.output.mkdir(parents=True, exist_ok=True)

    async def run_all() -> None:
        for name in targets:
            print(f"{name}: {args.streams} short streams, then the long request", file=sys.stderr, flush=True)
            doc["results"][name] = await run_target(name, settings, args.logs, args, prompt)
            write_json(args.output / "long.json", doc)

    from openengine_serve.common.lifecycle import run

    run(run_all())
    report = render_report(doc)
    (args.output / "report.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
