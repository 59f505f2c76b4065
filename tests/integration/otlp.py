"""A real OTLP/gRPC trace receiver: the collector's TraceService (opentelemetry-proto) on a loopback port."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def attributes(self) -> dict:
        return {kv.key: _value(kv.value) for kv in self.span.attributes}

    @property
    def events(self) -> list[str]:
        return [event.name for event in self.span.events]


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment that points a component's exporter here, exporting every 100 ms."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            **extra,
        }

    def __enter__(self) -> Receiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        received = []
        for resource_spans in request.resource_spans:
            service = next(
                (kv.value.string_value for kv in resource_spans.resource.attributes if kv.key == "service.name"), ""
            )
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(service, span) for span in scope_spans.spans]
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def all_spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def spans(self, trace_id: bytes) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if s.span.trace_id == trace_id]

    def wait_for(self, trace_id: bytes, count: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.spans(trace_id)
            if len(spans) >= count:
                time.sleep(0.3)  # nothing more should come: let a stray extra span show
                return self.spans(trace_id)
            time.sleep(0.05)
        raise AssertionError(
            f"{count} spans of trace {trace_id.hex()} not received within {timeout}s: "
            f"{[(s.service, s.name) for s in self.spans(trace_id)]}"
        )
