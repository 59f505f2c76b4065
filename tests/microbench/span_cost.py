"""CPU of the frontend's span work for one Generate call, the exporter's included (docs/benchmarks.md, "Tracing cost").

    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_TRACES_SAMPLER=always_on \
        python -m tests.microbench.span_cost 20000

Runs the calls `frontend/inference.py` and `frontend/requests.py` make on a request's `RequestTrace`
(a server span, the Reserve and Submit client spans with their metadata, three events, the end), then
shuts the provider down so that every span is exported, and prints the process CPU per request. Without
an endpoint it measures the tracing-off path.
"""

from __future__ import annotations

import sys
import time

from openengine_serve.common import tracing
from openengine_serve.frontend.request_trace import RequestTrace

TOKENS_PER_REQUEST = 128  # the benchmark's output length


def one_request(i: int) -> None:
    trace = RequestTrace.start((), "grpcio")
    if trace.span is not None:
        trace.set_attributes(**{"openengine.request_id": f"r-{i}", "gen_ai.request.model": "Qwen/Qwen3-0.6B"})
    trace.set_attributes(**{"gen_ai.usage.input_tokens": 32})
    with trace.call(tracing.RESERVE_SPAN, ()):
        pass
    with trace.call(tracing.SUBMIT_SPAN, (), **{"openengine.node_id": "node-1"}):
        pass
    trace.event("queued", **{"openengine.node_id": "node-1"})
    trace.event("first_token")
    trace.event("finished", status="finished")
    trace.end(status="finished", code="OK", completion_tokens=TOKENS_PER_REQUEST, finish_reasons=[2])


def main(argv: list[str]) -> None:
    requests = int(argv[0]) if argv else 20000
    tracing.setup_tracing("frontend")
    for i in range(500):  # warm-up
        one_request(i)
    started = time.process_time()
    for i in range(requests):
        one_request(i)
    tracing.shutdown_tracing()
    cpu = time.process_time() - started
    print(
        f"tracing {'on' if tracing.enabled() else 'off'}: {cpu / requests * 1e6:.1f} µs CPU per request, "
        f"{cpu / requests / TOKENS_PER_REQUEST * 1e6:.2f} µs per token at {TOKENS_PER_REQUEST} tokens"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
