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


def test_no_trace_forwards_the_clients_context_and_records_nothing():
    assert not tracing.enabled()
    trace = RequestTrace.start((("traceparent", TRACEPARENT),), "grpcio")
    assert trace is NO_TRACE
    forwarded = (("traceparent", TRACEPARENT),)
    with trace.call(tracing.RESERVE_SPAN, forwarded) as metadata:
        assert metadata is forwarded
    trace.event("queued")
    trace.set_key_name("team-a")
    trace.end(status="finished", code="OK")


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
