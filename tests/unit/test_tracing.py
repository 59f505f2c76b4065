"""Tracing is off (and OpenTelemetry never imported) without an OTLP endpoint; the parent context rules."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from openengine_serve.common import tracing
from openengine_serve.frontend.inference import REFUSAL_CODES, refusal_reason
from openengine_serve.frontend.refusal import DuplicateRequest, InvalidRequest
from openengine_serve.frontend.request_trace import NO_TRACE, RequestTrace

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_off_without_an_endpoint_imports_no_opentelemetry():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = (
        "import sys; import openengine_serve.frontend.server, openengine_serve.node.server, "
        "openengine_serve.coordinator.server; from openengine_serve.common import tracing; "
        "assert tracing.setup_tracing('frontend') is False; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("variable", tracing.ENDPOINT_VARIABLES)
def test_either_endpoint_variable_turns_it_on(variable):
    assert tracing.tracing_configured({variable: "http://127.0.0.1:4317"})
    assert not tracing.tracing_configured({variable: ""})
    assert not tracing.tracing_configured({})


@pytest.fixture(scope="module")
def exported():
    """Spans exported through OpenTelemetry's global provider, as setup_tracing installs it (with an in-memory
    exporter instead of OTLP): whatever the code would record while tracing is off would show here too."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first test module to ask sets the process's provider
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def one_call(forwarded: tuple[tuple[str, str], ...]) -> tuple[RequestTrace, tuple[tuple[str, str], ...]]:
    """What the frontend does with the trace of one Generate call; returns it and the Reserve call's metadata."""
    trace = RequestTrace.start((("traceparent", TRACEPARENT),), "grpcio")
    with trace.call(tracing.RESERVE_SPAN, forwarded) as metadata:
        pass
    trace.event("queued")
    trace.set_key_name("team-a")
    trace.end(status="finished", code="OK", completion_tokens=3)
    return trace, metadata


def test_no_trace_forwards_the_clients_context_and_records_nothing(exported):
    assert not tracing.enabled()
    exported.clear()
    forwarded = (("traceparent", TRACEPARENT),)
    trace, metadata = one_call(forwarded)
    assert trace is NO_TRACE
    assert metadata is forwarded
    assert exported.get_finished_spans() == ()
    assert NO_TRACE.span is None and NO_TRACE.forward == ()  # shared by every call: nothing stuck to it


def test_tracing_on_records_the_call_and_its_internal_call(exported, monkeypatch):
    """The counterpart of the test above: the same calls with a tracer record both spans."""
    from opentelemetry import trace

    monkeypatch.setattr(tracing, "_tracer", trace.get_tracer("openengine_serve"))
    exported.clear()
    _, metadata = one_call((("traceparent", TRACEPARENT),))
    reserve, generate = exported.get_finished_spans()
    assert (generate.name, reserve.name) == ("openengine.v1.Inference/Generate", tracing.RESERVE_SPAN)
    assert f"{generate.context.trace_id:032x}" == TRACEPARENT.split("-")[1]  # the client's trace continues
    assert reserve.parent.span_id == generate.context.span_id
    assert dict(metadata)["traceparent"].split("-")[2] == f"{reserve.context.span_id:016x}"
    assert [event.name for event in generate.events] == ["queued"]
    assert generate.attributes["openengine.key_name"] == "team-a"
    assert generate.attributes["openengine.status"] == "finished"
    assert generate.attributes["gen_ai.usage.output_tokens"] == 3


def test_parent_is_the_single_traceparent_with_its_tracestates():
    from opentelemetry import trace

    context = tracing._parent_context((("traceparent", TRACEPARENT), ("tracestate", "a=1"), ("tracestate", "b=2")))
    parent = trace.get_current_span(context).get_span_context()
    assert f"{parent.trace_id:032x}" == TRACEPARENT.split("-")[1]
    assert f"{parent.span_id:016x}" == TRACEPARENT.split("-")[2]
    assert dict(parent.trace_state) == {"a": "1", "b": "2"}
    # repeated or absent: no parent, as the frontend's metadata validation drops it
    assert tracing._parent_context((("traceparent", TRACEPARENT), ("traceparent", TRACEPARENT))) is None
    assert tracing._parent_context((("tracestate", "a=1"),)) is None


def test_refusal_reasons_are_snake_case_kinds():
    assert refusal_reason(DuplicateRequest) == "duplicate_request"
    assert refusal_reason(InvalidRequest) == "invalid_request"
    assert len({refusal_reason(kind) for kind in REFUSAL_CODES}) == len(REFUSAL_CODES)
