"""OpenTelemetry tracing, off unless an OTLP endpoint is configured.

`setup_tracing(component)` runs once per process (`lifecycle.run_component`).
With neither OTEL_EXPORTER_OTLP_ENDPOINT nor OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
set, nothing of OpenTelemetry is imported and every span helper here is a no-op.
Otherwise the SDK exports spans over OTLP/gRPC in batches; the standard OTEL_*
variables apply (OTEL_SERVICE_NAME, default openengine-<component>;
OTEL_RESOURCE_ATTRIBUTES; OTEL_TRACES_SAMPLER and its _ARG; the exporter's
headers, timeout, TLS; OTEL_BSP_* for the batching).

Context travels as W3C `traceparent`/`tracestate` in gRPC metadata.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from .logging_setup import log_event

if TYPE_CHECKING:  # OpenTelemetry itself is imported only when tracing is on
    from opentelemetry.trace import Span

logger = logging.getLogger("openengine_serve.tracing")

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
INSTALL_HINT = "pip install 'openengine-serve[tracing]'"

# Span names of the internal calls (client side in the frontend, server side in the coordinator and node).
RESERVE_SPAN = "openengine_internal.v1.Coordinator/Reserve"
SUBMIT_SPAN = "openengine_internal.v1.Node/Submit"

_tracer = None  # the process's Tracer once set up; None while tracing is off


def tracing_configured(environ=os.environ) -> bool:
    return any(environ.get(name) for name in ENDPOINT_VARIABLES)


def setup_tracing(component: str) -> bool:
    """Starts exporting spans when an OTLP endpoint is set; True when tracing is on.

    Fails with the install command when an endpoint is set but the SDK is missing.
    """
    global _tracer
    if not tracing_configured():
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise SystemExit(
            f"an OTLP endpoint is set ({'/'.join(ENDPOINT_VARIABLES)}) but OpenTelemetry is not "
            f"installed ({exc.name}); install it with: {INSTALL_HINT}"
        ) from None
    service = os.environ.get("OTEL_SERVICE_NAME") or f"openengine-{component}"
    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES; the provider reads the sampler variables, the exporter
    # its endpoint, headers, timeout and TLS variables.
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("openengine_serve")
    log_event(
        logger, "tracing on", service=service, sampler=os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    )
    return True


def shutdown_tracing() -> None:
    """Exports what is still buffered (the SDK also does this at exit)."""
    if _tracer is not None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        provider = trace.get_tracer_provider()
        assert isinstance(provider, TracerProvider)  # the SDK's, as setup_tracing installed it
        provider.shutdown()


def enabled() -> bool:
    return _tracer is not None


def _parent_context(metadata: Sequence[tuple[str, str | bytes]]):
    """The caller's trace context; none (a new trace) without exactly one traceparent, as the frontend's
    metadata validation does. Repeated tracestate headers join into one list."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    traceparents = [value for key, value in metadata if key == "traceparent"]
    if len(traceparents) != 1 or not isinstance(traceparents[0], str):
        return None
    carrier = {"traceparent": traceparents[0]}
    tracestate = ",".join(value for key, value in metadata if key == "tracestate" and isinstance(value, str) and value)
    if tracestate:
        carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def inject(span) -> tuple[tuple[str, str], ...]:
    """W3C metadata naming `span` as the parent (its tracestate kept), for an outgoing call."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def start_server_span(name: str, metadata: Sequence[tuple[str, str | bytes]], attributes: dict | None = None):
    """A SERVER span whose parent is the call's traceparent (a new trace without one); None when off."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=_parent_context(metadata), kind=SpanKind.SERVER, attributes=attributes)


def start_child_span(parent, name: str, attributes: dict | None = None):
    """A CLIENT span under `parent` for an outgoing call; None when `parent` is None (tracing off)."""
    if parent is None:
        return None
    assert _tracer is not None  # a parent span exists only while tracing is on
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(
        name, context=trace.set_span_in_context(parent), kind=SpanKind.CLIENT, attributes=attributes
    )


def end_span(span, error: BaseException | str | None = None) -> None:
    """Ends `span` (None: nothing), with an ERROR status naming `error` when given."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        if isinstance(error, BaseException):
            span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


@contextlib.contextmanager
def server_span(name: str, context, **attributes) -> Iterator[Span | None]:
    """A SERVER span around an internal gRPC handler (coordinator, node), parented by the caller's
    traceparent; yields the span or None while tracing is off."""
    if _tracer is None:
        yield None
        return
    span = start_server_span(name, context.invocation_metadata() or (), {"rpc.system": "grpc", **attributes})
    try:
        yield span
    except BaseException as exc:
        # context.abort raises: the handler's refusal (its code is in the exception's text)
        end_span(span, exc)
        raise
    end_span(span)
