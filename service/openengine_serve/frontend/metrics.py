"""Frontend metrics (Prometheus, prefix openengine_frontend_).

With several worker processes the supervisor points PROMETHEUS_MULTIPROC_DIR
at a shared directory before the workers start, and serves one scrape that
aggregates all of them.
"""

from __future__ import annotations

import asyncio
import bisect
import functools

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_DURATION = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter(
    "openengine_frontend_requests",
    "Generate calls by final status, gRPC code and API key name (`-` when keys are off)",
    ["status", "code", "key"],
)
TTFT = Histogram("openengine_frontend_time_to_first_token_seconds", "time to first token", buckets=_LATENCY)
ITL = Histogram(
    "openengine_frontend_inter_token_latency_seconds", "time between token deltas of a stream", buckets=_LATENCY
)
E2E = Histogram("openengine_frontend_request_duration_seconds", "Generate call duration", buckets=_DURATION)
PROMPT_TOKENS = Counter("openengine_frontend_prompt_tokens", "prompt tokens of accepted requests")
GENERATED_TOKENS = Counter("openengine_frontend_generated_tokens", "tokens streamed to clients")
IN_FLIGHT = Gauge("openengine_frontend_in_flight_requests", "Generate streams open", multiprocess_mode="livesum")
# Per worker process (label: its frontend id, <frontend>-w<i> with --workers), to see one worker saturated;
# counts from the reservation on, so a request stuck reserving or submitting shows too.
WORKER_IN_FLIGHT = Gauge(
    "openengine_frontend_worker_in_flight_requests",
    "Generate requests open in this worker (reserving, submitting or streaming)",
    ["worker"],
    multiprocess_mode="livesum",
)
REFUSALS = Counter("openengine_frontend_refusals", "Generate calls refused before acceptance, by reason", ["reason"])
AUTH_FAILURES = Counter(
    "openengine_frontend_auth_failures",
    "calls refused by the API key check: no_key, unknown_key (UNAUTHENTICATED) or wrong_role (PERMISSION_DENIED)",
    ["reason"],
)
SERVER_INFO = Gauge(
    "openengine_frontend_grpc_server_info",
    "the public gRPC server implementation",
    ["implementation", "version"],
    multiprocess_mode="max",
)
CLIENT_STALLS = Counter(
    "openengine_frontend_client_stalls",
    "streams ended because their client accepted no output for the client stall timeout",
)
CLIENT_PAUSES = Counter(
    "openengine_frontend_client_pauses",
    "requests paused on their node because their client took no output for "
    "OPENENGINE_CLIENT_PAUSE_AFTER_S (resumed once it takes output again)",
)
PAUSED_STREAMS = Gauge(
    "openengine_frontend_paused_streams", "streams whose request is paused on its node now", multiprocess_mode="livesum"
)
IN_FLIGHT_REFUSALS = Counter(
    "openengine_frontend_in_flight_refusals",
    "Generate calls refused because the worker had its maximum of streams open",
)
CONNECTIONS_MOVED = Counter(
    "openengine_frontend_connections_moved",
    "client connections closed at OPENENGINE_MAX_CONNECTION_AGE_S so that their client "
    "reconnects (pygrpc-native; grpcio's GOAWAYs are not counted here)",
)
CONNECTION_AGE_REFUSALS = Counter(
    "openengine_frontend_connection_age_refusals",
    "calls refused (UNAVAILABLE, not started) on a connection past "
    "OPENENGINE_MAX_CONNECTION_AGE_S while it waits to be closed (pygrpc-native)",
)
EVENT_LOOP_LAG = Gauge(
    "openengine_frontend_event_loop_lag_seconds",
    "how late the event loop woke a periodic timer, last measurement (the worst worker)",
    multiprocess_mode="livemax",
)


# What an inference gateway's endpoint picker reads to choose a frontend (docs/kubernetes.md): the load of the
# ready nodes this frontend routes to, from its node table (every worker holds the same table: livemax).
NODES_QUEUED = Gauge(
    "openengine_frontend_nodes_queued_requests",
    "requests queued on the ready nodes this frontend routes to",
    multiprocess_mode="livemax",
)
NODES_RUNNING = Gauge(
    "openengine_frontend_nodes_running_requests",
    "requests running on the ready nodes this frontend routes to",
    multiprocess_mode="livemax",
)
NODES_KV_CACHE_USAGE = Gauge(
    "openengine_frontend_nodes_kv_cache_usage_ratio",
    "KV cache in use on the ready nodes this frontend routes to: the tokens their running requests hold over "
    "their context length (0 to 1)",
    multiprocess_mode="livemax",
)


def observe_node_load(nodes) -> None:
    """The gateway gauges from a node table (cluster_pb2.NodeEntry values); only READY nodes take requests."""
    from ..api.openengine_internal.v1 import cluster_pb2

    ready = [n for n in nodes if n.state == cluster_pb2.NODE_STATE_READY]
    NODES_QUEUED.set(sum(n.load.queued_requests for n in ready))
    NODES_RUNNING.set(sum(n.load.running_requests for n in ready))
    capacity = sum(n.model.context_length for n in ready)
    NODES_KV_CACHE_USAGE.set(min(1.0, sum(n.load.running_tokens for n in ready) / capacity) if capacity else 0.0)


@functools.lru_cache(maxsize=1024)
def requests_counter(status: str, code: str, key: str):
    """REQUESTS' series for these labels, looked up once (every Generate call ends by counting itself)."""
    return REQUESTS.labels(status=status, code=code, key=key)


class DeltaMetrics:
    """GENERATED_TOKENS and ITL for token deltas, added to their series once per event-loop iteration instead of
    once per delta: the lane reader hands one token to every open stream per engine step, so at 10 open streams
    this is one counter update and a few bucket updates per step instead of 10 of each.

    Histogram buckets are updated through the Histogram's own bucket and sum values (what its `observe` does
    per value); a prometheus_client without them gets one `observe` per value at the flush."""

    def __init__(self, tokens: Counter, gaps: Histogram) -> None:
        self._tokens_counter = tokens
        self._histogram = gaps
        self._bounds = list(getattr(gaps, "_upper_bounds", ()))
        self._by_bucket = (
            len(self._bounds) > 0
            and len(getattr(gaps, "_buckets", ())) == len(self._bounds)
            and hasattr(getattr(gaps, "_sum", None), "inc")
        )
        self._counts = [0] * len(self._bounds)
        self._gaps: list[float] = []  # only without bucket access
        self._gap_sum = 0.0
        self._tokens = 0
        self._pending = False

    def add(self, tokens: int, gap_s: float | None = None) -> None:
        """One delta of `tokens` tokens; `gap_s`: the time since the stream's previous delta (None for the first)."""
        self._tokens += tokens
        if gap_s is not None:
            if self._by_bucket:
                self._counts[bisect.bisect_left(self._bounds, gap_s)] += 1  # the first bucket with gap_s <= le
                self._gap_sum += gap_s
            else:
                self._gaps.append(gap_s)
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._pending = False
        if self._tokens:
            self._tokens_counter.inc(self._tokens)
            self._tokens = 0
        if self._by_bucket:
            counts = self._counts
            buckets = self._histogram._buckets
            for i, n in enumerate(counts):
                if n:
                    buckets[i].inc(n)
                    counts[i] = 0
            if self._gap_sum:
                self._histogram._sum.inc(self._gap_sum)
                self._gap_sum = 0.0
        else:
            gaps, self._gaps = self._gaps, []
            for gap in gaps:
                self._histogram.observe(gap)


DELTAS = DeltaMetrics(GENERATED_TOKENS, ITL)
