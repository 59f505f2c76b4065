"""The long-request bench's accounting and report (python -m openengine_bench.long_request)."""

from __future__ import annotations

import pytest

from openengine_bench import long_request
from openengine_bench.long_request import Phases, render_report


def test_each_phase_counts_its_own_tokens_and_first_tokens(monkeypatch):
    clock = iter([0.0, 10.0, 14.0, 34.0])
    monkeypatch.setattr(long_request.time, "perf_counter", lambda: next(clock))
    phases = Phases()
    phases.enter("alone")  # t=0
    phases.tokens["alone"] += 1600
    phases.ttft_s["alone"] += [0.2, 0.3, 0.4]
    phases.enter("prompt")  # t=10
    phases.tokens["prompt"] += 40
    phases.enter("generation")  # t=14
    phases.tokens["generation"] += 2000
    phases.enter("closed")  # t=34
    summary = phases.summary()
    assert summary["alone"] == {"seconds": 10.0, "tokens": 1600, "tok_s": 160.0, "ttft_p50_ms": 300.0, "ttft_n": 3}
    assert summary["prompt"]["tok_s"] == 10.0 and summary["prompt"]["ttft_p50_ms"] is None
    assert summary["generation"]["tok_s"] == 100.0


def test_a_phase_too_short_to_count_has_no_rate(monkeypatch):
    clock = iter([0.0, 10.0, 10.05])
    monkeypatch.setattr(long_request.time, "perf_counter", lambda: next(clock))
    phases = Phases()
    phases.enter("alone")
    phases.enter("prompt")
    phases.tokens["prompt"] += 3
    phases.enter("closed")  # the long request was refused at once
    summary = phases.summary()
    assert summary["prompt"]["tok_s"] is None and summary["generation"]["tok_s"] is None


def _short(alone: float, prompt: float | None, generation: float | None) -> dict:
    rates = {"alone": alone, "prompt": prompt, "generation": generation}
    return {p: {"tok_s": rates[p], "ttft_p50_ms": 250.0 if p == "alone" else None} for p in long_request.PHASES}


def test_the_report_says_whether_the_long_request_completed_and_what_the_short_streams_got():
    doc = {
        "machine": {"cpu": "CPU", "cores": 2, "date": "2026-12-06"},
        "settings": {
            "streams": 31,
            "max_tokens": 128,
            "window": 30.0,
            "prompt_tokens": 6000,
            "output_tokens": 1000,
            "model_file": "m.gguf",
            "threads": 2,
            "context_size": 16384,
            "max_batch": 32,
        },
        "results": {
            "ours": {
                "command": "up",
                "long": {
                    "completed": True,
                    "output_tokens": 1000,
                    "seconds": 300.0,
                    "ttft_s": 41.5,
                    "output_tok_s": 4.2,
                },
                "short": _short(150.0, 20.5, 120.0),
            },
            "theirs": {
                "command": "llama-server",
                "long": {
                    "completed": False,
                    "output_tokens": 0,
                    "seconds": 0.01,
                    "ttft_s": None,
                    "output_tok_s": None,
                    "error": "HTTP 400: exceeds the available context size (512 tokens)",
                },
                "short": _short(180.0, None, None),
            },
            "broken": {"error": "RuntimeError: did not start"},
        },
    }
    report = render_report(doc)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| ")}
    assert "completed (1,000 tokens, 300 s) | 41.5 s | 4.2 | 150.0 | 20.5 | 120.0 | 250 | – | – |" in rows["ours"]
    assert "not completed (0 tokens): HTTP 400: exceeds the available context size (512 tokens)" in rows["theirs"]
    assert "| 180.0 | – | – |" in rows["theirs"]
    assert "failed: RuntimeError: did not start" in rows["broken"]
    assert all(line.count("|") == rows["ours"].count("|") for line in rows.values()), "every row has every column"


@pytest.mark.timeout(120)
def test_the_long_prompt_has_the_asked_length_in_the_models_own_tokens():
    from llama_cpp import Llama

    from openengine_serve.engine.model_card import default_model_path

    model = str(default_model_path())
    text = long_request.long_prompt(model, 1500)
    vocab = Llama(model_path=model, vocab_only=True, verbose=False)
    assert abs(len(vocab.tokenize(text.encode(), add_bos=False)) - 1500) <= 2
