"""The features benchmark's pure parts: workloads, window statistics, Prometheus arithmetic, mask summaries,
verdicts and the report, on fake inputs. No stack is started."""

from __future__ import annotations

import json

import pytest

from openengine_bench import features as f

# ---------------------------------------------------------------- workloads


def test_chat_is_smollm2s_template_with_and_without_a_system_message():
    assert f.chat("Hi?") == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert f.chat("Hi?", "Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_questions_are_distinct():
    asks = f.questions()
    assert len(asks) == 72 and len(set(asks)) == 72


def words(text: str) -> int:
    return len(text.split())


def test_grow_text_stops_at_the_first_length_reaching_the_target():
    text = f.grow_text("Head.", ["one two three"], words, 10)
    assert words(text) >= 10
    assert words(text.rsplit(" Rule ", 1)[0]) < 10  # one sentence fewer was not enough
    assert text.startswith("Head. Rule 1: one two three Rule 2:")


def test_grow_text_needs_sentences():
    assert f.grow_text("a b c", [], words, 2) == "a b c"  # already long enough: no sentence needed
    with pytest.raises(ValueError):
        f.grow_text("a", [], words, 5)


def test_system_prompts_differ_from_their_first_words():
    prompts = f.system_prompts(4, words, 200)
    assert len({p.split(".")[0] for p in prompts}) == 4
    assert all(words(p) >= 200 for p in prompts)
    assert f.system_prompts(4, words, 200) == prompts  # the same every run
    with pytest.raises(ValueError):
        f.system_prompts(len(f.ORGANIZATIONS) + 1, words, 10)


def test_system_prompts_after_a_shared_preamble_share_their_first_words_only():
    prompts = f.system_prompts(4, words, 200, preamble_tokens=80)
    first = [p.split()[:80] for p in prompts]
    assert all(head == first[0] for head in first), "the same first 80 words: one first-tokens key for all"
    assert len({p.split("You are the help desk assistant of ")[1].split(".")[0] for p in prompts}) == 4
    assert all(words(p) >= 280 for p in prompts)


def test_routing_workloads_parse_from_the_command_line():
    assert f.RoutingWorkload.parse("8x8+200") == f.RoutingWorkload(8, 8, 200)
    assert f.RoutingWorkload.parse(" 4x16") == f.RoutingWorkload(4, 16, 0)
    assert str(f.RoutingWorkload(8, 8, 200)) == "8x8+200" and str(f.RoutingWorkload(4, 16)) == "4x16"
    assert f.RoutingWorkload(8, 8, 200).name == "K=8 x R=8, after a shared 200-token preamble"
    with pytest.raises(ValueError, match="KxR or KxR"):
        f.RoutingWorkload.parse("8 by 8")
    assert f.build_parser().parse_args(["--routing-workloads", "8x8+200"]).routing_workloads == "8x8+200"


def test_routing_plan_gives_each_prompt_its_distinct_questions_in_a_fixed_shuffle():
    plan = f.routing_plan(3, 5)
    assert sorted(plan) == [(p, q) for p in range(3) for q in range(5)]
    assert plan == f.routing_plan(3, 5)
    assert plan != sorted(plan)
    assert f.routing_plan(3, 5, seed=2) != plan
    with pytest.raises(ValueError):
        f.routing_plan(1, len(f.questions()) + 1)


def test_huge_schema_fills_the_limit_with_closed_objects():
    schema = f.huge_schema(20000)
    size = len(json.dumps(schema).encode())
    assert 20000 - 2000 < size <= 20000
    assert all(v["additionalProperties"] is False and len(v["properties"]) == 6 for v in schema["anyOf"])
    assert len(f.huge_schema(40000)["anyOf"]) > len(schema["anyOf"])
    with pytest.raises(ValueError):
        f.huge_schema(100)


def test_make_request_sets_the_guide_the_cache_fields_and_ignore_eos():
    req = f.make_request("m", "p", max_tokens=7, ignore_eos=True, schema='{"type": "object"}', salt="s", bypass=True)
    assert req.model == "m" and req.prompt == "p" and req.stopping.max_tokens == 7 and req.stopping.ignore_eos
    assert req.guided.json_schema == '{"type": "object"}'
    assert req.kv.cache_salt == "s" and req.kv.bypass_prefix_cache
    assert req.sampling.temperature == 0
    plain = f.make_request("m", "p", max_tokens=7)
    assert not plain.HasField("guided") and not plain.HasField("kv") and not plain.stopping.ignore_eos
    assert plain.request_id != req.request_id


# ---------------------------------------------------------------- window statistics


def record(sent, arrivals, counts=None, ended=None, finish="stop", error=""):
    return f.Record(
        sent=sent,
        arrivals=list(arrivals),
        counts=list(counts or [1] * len(arrivals)),
        ended=ended,
        finish=finish,
        error=error,
    )


def test_window_stats_counts_only_what_happened_in_the_window():
    records = [
        record(0.0, [0.5, 1.5, 2.0, 3.5], ended=3.6),  # TTFT before the window; gaps 1.0 (in), 0.5, 1.5
        record(1.2, [1.4, 1.6, 2.2], counts=[1, 2, 1], ended=2.3, finish="length"),  # all in: TTFT 0.2
        record(2.5, [2.9, 3.1], ended=None),  # still running when the window closed
        record(2.0, [], ended=2.5, error="StreamError: boom"),  # failed in the window
    ]
    s = f.window_stats(records, 1.0, 3.0)
    # tokens arriving in [1, 3): 1.5, 2.0 (first); 1.4, 1.6 (x2), 2.2 (second); 2.9 (third)
    assert s["tokens"] == 1 + 1 + 1 + 2 + 1 + 1
    assert s["tok_s"] == pytest.approx(7 / 2)
    assert s["ttft_n"] == 2 and s["ttft_p50_ms"] == pytest.approx((200 + 400) / 2)
    # gaps ending in the window: 1.0, 0.5 (first); 0.2, 0.6 (second)
    assert s["itl_n"] == 4
    assert s["itl_max_ms"] == pytest.approx(1000)
    assert s["itl_p50_ms"] == pytest.approx(550)
    assert s["multi_token_responses"] == 1
    assert s["completed"] == 1 and s["finish"] == {"length": 1} and s["mean_output_tokens"] == 4
    assert s["errors"] == 1 and s["error_samples"] == ["StreamError: boom"]


def test_window_stats_of_nothing():
    s = f.window_stats([], 0.0, 2.0)
    assert s["tokens"] == 0 and s["tok_s"] == 0 and s["itl_p99_ms"] is None and s["mean_output_tokens"] is None


def test_record_ttft():
    assert record(1.0, [1.25, 2.0]).ttft == pytest.approx(0.25)
    assert record(1.0, []).ttft is None


# ---------------------------------------------------------------- Prometheus arithmetic

METRICS_BEFORE = """# HELP openengine_node_prefill_tokens_total x
# TYPE openengine_node_prefill_tokens_total counter
openengine_node_prefill_tokens_total 100.0
# HELP openengine_node_prefix_cache_hit_tokens_total x
# TYPE openengine_node_prefix_cache_hit_tokens_total counter
openengine_node_prefix_cache_hit_tokens_total 0.0
# HELP openengine_node_step_duration_seconds x
# TYPE openengine_node_step_duration_seconds histogram
openengine_node_step_duration_seconds_bucket{le="+Inf"} 10.0
openengine_node_step_duration_seconds_count 10.0
openengine_node_step_duration_seconds_sum 0.5
# HELP openengine_node_request_queue_time_seconds x
# TYPE openengine_node_request_queue_time_seconds histogram
openengine_node_request_queue_time_seconds_count 3.0
openengine_node_request_queue_time_seconds_sum 0.1
# HELP openengine_coordinator_routing_decisions requests routed, by reason
# TYPE openengine_coordinator_routing_decisions counter
openengine_coordinator_routing_decisions_total{reason="prefix"} 2.0
openengine_coordinator_routing_decisions_total{reason="affinity"} 0.0
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace("prefill_tokens_total 100.0", "prefill_tokens_total 400.0")
    .replace("hit_tokens_total 0.0", "hit_tokens_total 900.0")
    .replace("seconds_count 10.0", "seconds_count 30.0")
    .replace("seconds_sum 0.5", "seconds_sum 1.5")
    .replace("queue_time_seconds_count 3.0", "queue_time_seconds_count 8.0")
    .replace('reason="prefix"} 2.0', 'reason="prefix"} 12.0')
    .replace('reason="affinity"} 0.0', 'reason="affinity"} 3.0')
)


def test_parse_metrics_and_deltas():
    before, after = f.parse_metrics(METRICS_BEFORE), f.parse_metrics(METRICS_AFTER)
    assert f.metric(before, f.PREFILL) == 100
    assert f.metric(before, "no_such_metric") == 0
    assert f.delta(before, after, f.HITS) == 900
    assert f.by_label(after, f.ROUTING, "reason") == {"prefix": 12, "affinity": 3}
    assert f.metric(after, f.ROUTING, reason="affinity") == 3
    assert f.histogram_mean(before, after, f.STEP) == pytest.approx(1.0 / 20)
    assert f.histogram_mean(before, before, f.STEP) is None


def test_node_deltas_and_hit_rate():
    before, after = f.parse_metrics(METRICS_BEFORE), f.parse_metrics(METRICS_AFTER)
    [node] = f.node_deltas([before], [after])
    assert node == {"prefilled": 300, "hits": 900, "requests": 5, "steps": 20, "step_ms": pytest.approx(50)}
    assert f.hit_rate(node["hits"], node["prefilled"]) == pytest.approx(0.75)
    assert f.hit_rate(0, 0) is None


def test_spread_is_the_busiest_nodes_share():
    assert f.spread([5, 5]) == 0.5
    assert f.spread([0, 8]) == 1.0
    assert f.spread([3, 1]) == 0.75
    assert f.spread([0, 0]) is None


# ---------------------------------------------------------------- mask cost


def test_mask_summary_in_microseconds():
    s = f.mask_summary(
        compute_ns=[10_000, 30_000],
        apply_ns=[5_000, 5_000],
        consume_ns=[2_000, 4_000],
        choose_guided_ns=[60_000, 80_000],
        choose_plain_ns=[20_000, 20_000],
    )
    assert s["tokens"] == 2
    assert s["compute_us"] == 20 and s["apply_us"] == 5
    assert s["mask_us"] == 25 and s["mask_max_us"] == 35 and s["mask_p50_us"] == 25
    assert s["consume_us"] == 3 and s["per_token_us"] == 28
    assert s["choose_delta_us"] == 50
    empty = f.mask_summary([], [], [], [], [])
    assert empty["mask_us"] is None and empty["per_token_us"] is None and empty["choose_delta_us"] is None


def test_step_share():
    assert f.step_share(100.0, 8, 40.0) == pytest.approx(0.02)  # 8 x 100 µs = 0.8 ms of 40 ms
    assert f.step_share(None, 8, 40.0) is None
    assert f.step_share(100.0, 8, 0.0) is None


# ---------------------------------------------------------------- summaries over rounds


def cell(**values):
    base = {
        "tok_s": None,
        "ttft_p50_ms": None,
        "itl_p50_ms": None,
        "mean_output_tokens": None,
        "step_ms": None,
        "running_mean": None,
        "queued_mean": None,
        "completed": 0,
        "errors": 0,
    }
    return {**base, **values}


def guided_rounds():
    return [
        {
            "round": 1,
            "levels": {
                "8": {"guided": cell(tok_s=90.0, completed=10), "unguided": cell(tok_s=100.0)},
                "32": {"guided": cell(tok_s=60.0), "unguided": cell(tok_s=120.0, errors=1)},
            },
        },
        {
            "round": 2,
            "levels": {
                "8": {"guided": cell(tok_s=110.0, completed=12), "unguided": cell(tok_s=100.0)},
                "32": {"guided": cell(tok_s=80.0), "unguided": cell(tok_s=120.0)},
            },
        },
    ]


def test_guided_summary_takes_medians_and_the_ratio():
    s = f.guided_summary(guided_rounds())
    assert list(s) == ["8", "32"]
    assert s["8"]["guided"]["tok_s"] == 100 and s["8"]["guided"]["requests"] == 22
    assert s["8"]["ratio"] == pytest.approx(1.0)
    assert s["32"]["ratio"] == pytest.approx(70 / 120)
    assert s["32"]["unguided"]["errors"] == 1


def window(itl_p99, **extra):
    return {
        "groups": {"ordinary": {**cell(itl_p99_ms=itl_p99, itl_max_ms=itl_p99, itl_n=100), **extra}},
        "step_ms": 50.0,
    }


def isolation_rounds():
    extra = {
        "completed": 3,
        "errors": 1,
        "error_samples": ["x"],
        "ttft_p50_ms": 300.0,
        "mean_output_tokens": 40.0,
        "finish": {"stop": 3},
    }
    with_huge, plain = window(90.0), window(72.0)
    with_huge["groups"]["extra"] = extra
    plain["groups"]["extra"] = {**extra, "errors": 0, "error_samples": [], "finish": {"length": 3}}
    return [
        {"round": 1, "order": ["without", "plain", "with"], "without": window(60.0), "plain": plain, "with": with_huge}
    ]


def test_isolation_summary_ratios_and_the_extra_streams():
    s = f.isolation_summary(isolation_rounds())
    assert s["ratio"] == pytest.approx(1.5)
    assert s["plain_ratio"] == pytest.approx(1.2)
    assert s["ratio_to_plain"] == pytest.approx(1.25)
    assert s["without"]["gaps"] == 100
    assert s["with_extra"]["requests"] == 3 and s["with_extra"]["errors"] == 1
    assert s["with_extra"]["finish"] == {"stop": 3} and s["plain_extra"]["finish"] == {"length": 3}


def test_isolation_summary_without_the_control():
    rounds = isolation_rounds()
    del rounds[0]["plain"]
    s = f.isolation_summary(rounds)
    assert "plain" not in s and "plain_extra" not in s
    assert s["ratio"] == pytest.approx(1.5) and s["plain_ratio"] is None


# ---------------------------------------------------------------- verdicts, problems, the report


def fake_doc():
    doc = {
        "machine": {
            "cpu": "Test CPU",
            "cores": 2,
            "date": "2026-01-01T00:00:00+00:00",
            "python": "3.11",
            "llama_cpp_python": "0.3",
            "llguidance": "1.0",
            "openengine": "0.1.0 (abc)",
        },
        "settings": {
            "quick": True,
            "rounds": 1,
            "window_s": 6.0,
            "warmup_s": 2.0,
            "model_file": "m.gguf",
            "command": "python -m openengine_bench.features --quick",
            "stack": "openengine-serve up",
            "max_guided_sequences": 16,
            "cache_system_tokens": 1000,
            "routing_system_tokens": 500,
            "routing_concurrency": 4,
        },
        "guided": {
            "schema": f.PERSON_SCHEMA,
            "calibration": {"mean_length": 30.0},
            "unguided_tokens": 30,
            "rounds": guided_rounds(),
            "summary": f.guided_summary(guided_rounds()),
            "mask": {
                "person (small)": {
                    **f.mask_summary([40_000], [30_000], [5_000], [90_000], [20_000]),
                    "grammar_bytes": 500,
                    "check_ms": 1.0,
                    "compile_ms": 1.5,
                    "problems": [],
                }
            },
            "step_shares": [
                {
                    "streams": 8,
                    "guided_per_step": 8.0,
                    "per_token_us": 75.0,
                    "mask_ms_per_step": 0.6,
                    "step_ms": 60.0,
                    "share": 0.01,
                    "unguided_step_ms": 58.0,
                }
            ],
        },
        "prefix_cache": {
            "summary": {
                "cached": {
                    "ttft_p50_ms": 40.0,
                    "ttft_p99_ms": 50.0,
                    "requests": 5,
                    "prompt_tokens_mean": 1010.0,
                    "cached_prompt_tokens_mean": 995.0,
                    "prefilled": 75.0,
                    "hits": 4975.0,
                },
                "bypass": {
                    "ttft_p50_ms": 400.0,
                    "ttft_p99_ms": 420.0,
                    "requests": 5,
                    "prompt_tokens_mean": 1010.0,
                    "cached_prompt_tokens_mean": 0.0,
                    "prefilled": 5050.0,
                    "hits": 0.0,
                },
            },
            "speedup": 10.0,
            "counters_before": {"prefill": 0.0, "hits": 0.0},
            "counters_after": {"prefill": 6000.0, "hits": 5000.0},
            "burst": {
                "requests": 8,
                "together": {
                    "prefilled": 1150.0,
                    "hits": 6930.0,
                    "prompt_tokens": 8080,
                    "ttft_p50_ms": 900.0,
                    "ttft_max_ms": 950.0,
                    "wall_s": 1.5,
                    "errors": 0,
                },
                "bypass": {
                    "prefilled": 8080.0,
                    "hits": 0.0,
                    "prompt_tokens": 8080,
                    "ttft_p50_ms": 3000.0,
                    "ttft_max_ms": 5600.0,
                    "wall_s": 6.0,
                    "errors": 0,
                },
            },
        },
        "isolation": {
            "huge_guide": {"bytes": 62000, "objects": 38},
            "rounds": isolation_rounds(),
            "summary": f.isolation_summary(isolation_rounds()),
        },
        "routing": {
            "stacks": {
                "kv-events": "OPENENGINE_PREFIX_ROUTING=kv-events openengine-serve up --nodes 2",
                "first-tokens": "OPENENGINE_PREFIX_ROUTING=first-tokens openengine-serve up --nodes 2",
            },
            "notes": ["a routing note"],
            "workloads": [
                {
                    "name": "K=4 x R=16",
                    "variants": {
                        "by kv-events": {
                            "requests": 64,
                            "errors": 0,
                            "hit_rate": 0.9,
                            "client_hit_rate": 0.89,
                            "nodes": [{"requests": 30.0, "prefilled": 1000.0}, {"requests": 34.0, "prefilled": 2000.0}],
                            "spread": 34 / 64,
                            "routing_decisions": {"prefix": 64.0},
                            "ttft_p50_ms": 50.0,
                            "requests_per_s": 3.0,
                            "foreign_cpus": 0.5,
                            "foreign_busiest": ["pytest (1)"],
                        },
                        "random key": {
                            "requests": 64,
                            "errors": 2,
                            "error_samples": ["StreamError: x"],
                            "hit_rate": 0.8,
                            "client_hit_rate": 0.79,
                            "nodes": [{"requests": 32.0}, {"requests": 32.0}],
                            "spread": 0.5,
                            "routing_decisions": {"affinity": 64.0},
                            "ttft_p50_ms": 80.0,
                            "requests_per_s": 2.0,
                            "foreign_cpus": 0.0,
                        },
                    },
                }
            ],
        },
        "errors": [],
        "notes": ["a note"],
    }
    doc["verdicts"] = f.verdicts(doc)
    doc["problems"] = f.problems(doc)
    return doc


def test_verdicts_judge_each_target():
    by_goal = {v["goal"].split(":")[0]: v for v in fake_doc()["verdicts"]}
    assert by_goal["guided decoding at 8 streams"]["met"] is True  # 1.0x >= 0.8x
    assert by_goal["guided decoding at 32 streams"]["met"] is False  # 0.58x
    assert by_goal["prefix cache"]["met"] is True  # 10x >= 3x
    assert by_goal["isolation"]["met"] is True  # 1.5x <= 1.5x
    assert "1.50x" in by_goal["isolation"]["figures"]


def test_verdicts_miss_and_lack_figures():
    doc = fake_doc()
    doc["prefix_cache"]["speedup"] = 2.0
    doc["isolation"]["summary"]["ratio"] = 1.6
    doc["guided"]["summary"]["8"]["ratio"] = None
    by_goal = {v["goal"].split(":")[0]: v["met"] for v in f.verdicts(doc)}
    assert by_goal["prefix cache"] is False and by_goal["isolation"] is False
    assert by_goal["guided decoding at 8 streams"] is None
    assert f.verdicts({}) == []


def test_problems_name_errors_and_foreign_load():
    found = fake_doc()["problems"]
    assert any("isolation, round 1, with extra: 1 errors" in p for p in found)
    assert not any("round 1, plain" in p for p in found)
    assert any("random key: 2 errors, e.g. StreamError: x" in p for p in found)
    assert any("by kv-events: processes this benchmark did not start kept 0.50 CPUs busy" in p for p in found)
    assert any("guided cost, round 1, 32 streams unguided: 1 errors" in p for p in found)
    assert not any("round 2, 32 streams unguided" in p for p in found)


def test_report_has_every_section_and_the_verdicts():
    report = f.render_report(fake_doc())
    assert report.startswith("# Guided decoding and the prefix cache on the llama.cpp engine (quick run)")
    assert "Machine: Test CPU, 2 cores" in report
    assert "| 8 | guided | 100.0 |" in report and "1.00x" in report
    assert "| 32 | guided | 70.0 |" in report and "0.58x" in report
    assert "| person (small) | 500 | 1 | 40.0 | 30.0 | 70.0 |" in report
    assert "8.0 guided outputs per step × 75.0 µs" in report and "(1.0 %)" in report
    assert "| with the cache | 40.0 | 50.0 | 995.0 | 75 | 4975 |" in report
    assert "| bypass_prefix_cache | 400.0 | 420.0 | 0.0 | 5050 | 0 |" in report
    assert "With the cache 10.0x faster" in report
    assert "8 requests sent at once" in report
    assert "| with the cache | 8080 | 1150 | 6930 | 900.0 | 950.0 | 1.50 | 0 |" in report
    assert "| bypass_prefix_cache | 8080 | 8080 | 0 | 3000.0 | 5600.0 | 6.00 | 0 |" in report
    assert "| alone | – | 60.0 | 60.0 | 100 |" in report
    assert "| with a plain ninth stream | – | 72.0 |" in report
    assert "ITL p99 with the huge-guide stream / alone: 1.50x; with a plain ninth stream / alone: 1.20x" in report
    assert "The huge-guide stream: 3 requests completed in the windows (stop 3), 1 errors" in report
    assert "| K=4 x R=16 | by kv-events | 64 | 0.900 | 0.890 | 30 / 34 | 1000 / 2000 | 0.53 | prefix 64 |" in report
    assert "| K=4 x R=16 | random key | 64 | 0.800 |" in report
    assert "`OPENENGINE_PREFIX_ROUTING=kv-events openengine-serve up --nodes 2`; `OPENENGINE_PREFIX" in report
    assert "- a routing note" in report and "- a note" in report
    assert "**met**" in report and "**missed**" in report
    assert "## Problems" in report


def test_report_leaves_out_what_did_not_run():
    doc = fake_doc()
    for key in ("guided", "prefix_cache", "isolation", "routing"):
        del doc[key]
    doc["verdicts"], doc["problems"] = f.verdicts(doc), f.problems(doc)
    report = f.render_report(doc)
    assert "## 1." not in report and "## 2." not in report and "## 3." not in report and "## 4." not in report
    assert "(no measurement ran)" in report and "## Problems" not in report


def test_lora_summary_takes_medians_over_rounds_relative_to_the_base_model():
    def cell(tok_s: float, errors: int = 0) -> dict:
        return {"tok_s": tok_s, "step_ms": 100.0, "itl_p50_ms": 90.0, "itl_p99_ms": 150.0, "errors": errors}

    rounds = [{name: cell(100.0 * (1 + r) / (1 + n)) for n, name in enumerate(f.LORA_MIXES)} for r in range(3)]
    rounds[1]["four adapters"]["errors"] = 2
    summary = f.lora_summary(rounds)
    assert summary["base model only"]["tok_s"] == 200.0 and summary["base model only"]["vs_base"] == 1.0
    assert summary["one adapter"]["vs_base"] == pytest.approx(0.5)
    assert summary["four adapters"]["errors"] == 2
    assert [f.LORA_MIXES[name](i) for name in f.LORA_MIXES for i in range(4)] == [
        *[""] * 4,
        *["a0"] * 4,
        "",
        "a0",
        "",
        "a0",
        "a0",
        "a1",
        "a2",
        "a3",
    ]
