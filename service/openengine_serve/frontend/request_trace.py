"""The span of one Generate call: a SERVER span, CLIENT children for its internal calls, a few events.

Tracing off (common/tracing.py): `RequestTrace.start` returns `NO_TRACE`, whose
methods do nothing, and the internal calls forward the client's own
traceparent/tracestate unchanged. Nothing here runs per token: the stream adds
one event at its first token and ends the span once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from ..api.openengine.v1 import generation_pb2
from ..common import tracing

GENERATE_SPAN = "openengine.v1.Inference/Generate"

FAILED_STATUSES = ("rejected", "failed", "error")  # a client's cancel is no failure of the call

Metadata = tuple[tuple[str, str], ...]


class RequestTrace:
    """`span` is None while tracing is off and for a call the sampler left out; such a call still passes
    its unsampled context (`forward`) on, so the coordinator and node leave it out too."""

    __slots__ = ("span", "forward")

    def __init__(self, span, forward: Metadata = ()) -> None:
        self.span = span
        self.forward = forward

    @classmethod
    def start(cls, metadata: Sequence[tuple[str, str | bytes]], server_implementation: str) -> RequestTrace:
        span = tracing.start_server_span(
            GENERATE_SPAN,
            metadata,
            {
                "rpc.system": "grpc",
                "rpc.service": "openengine.v1.Inference",
                "rpc.method": "Generate",
                "openengine.grpc_server": server_implementation,
            },
        )
        if span is None:
            return NO_TRACE
        if not span.is_recording():  # not sampled: no span work at all, only its context goes on
            return cls(None, tracing.inject(span))
        return cls(span)

    def set_attributes(self, **attributes) -> None:
        if self.span is not None:
            self.span.set_attributes(attributes)

    def set_key_name(self, key_name: str | None) -> None:
        """The name of the API key the caller authenticated with (absent when keys are off)."""
        if self.span is not None and key_name:
            self.span.set_attribute("openengine.key_name", key_name)

    def event(self, name: str, **attributes) -> None:
        if self.span is not None:
            self.span.add_event(name, attributes)

    def call(self, name: str, untraced: Metadata, **attributes) -> contextlib.AbstractContextManager[Metadata]:
        """A CLIENT span around one internal call; yields the metadata that carries it (`untraced`, the
        client's own trace context, while tracing is off: then a plain context, cheaper than a generator's, for a
        call made twice per request)."""
        if self.span is None:
            return contextlib.nullcontext(self.forward or untraced)
        return self._traced_call(name, **attributes)

    @contextlib.contextmanager
    def _traced_call(self, name: str, **attributes) -> Iterator[Metadata]:
        child = tracing.start_child_span(self.span, name, {"rpc.system": "grpc", **attributes})
        try:
            yield tracing.inject(child)
        except BaseException as exc:
            tracing.end_span(child, exc)
            raise
        tracing.end_span(child)

    def end(
        self,
        *,
        status: str,
        code: str,
        completion_tokens: int | None = None,
        finish_reasons: Sequence[int] = (),
        error: BaseException | str | None = None,
    ) -> None:
        """Ends the span once (later calls do nothing)."""
        span = self.span
        if span is None:
            return
        self.span = None
        span.set_attribute("openengine.status", status)
        span.set_attribute("rpc.grpc.status_code", code)
        if completion_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if finish_reasons:
            span.set_attribute(
                "gen_ai.response.finish_reasons",
                [generation_pb2.FinishReason.Name(r).removeprefix("FINISH_REASON_").lower() for r in finish_reasons],
            )
        if error is None and status in FAILED_STATUSES:
            error = f"{status} ({code})"
        tracing.end_span(span, error)


NO_TRACE = RequestTrace(None)
