"""Node metrics (Prometheus, prefix openengine_node_)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

from ..api.openengine_internal.v1 import cluster_pb2

RUNNING = Gauge("openengine_node_running_requests", "requests in the engine batch")
QUEUED = Gauge("openengine_node_queued_requests", "requests waiting for a batch slot")
BATCH_SIZE = Gauge("openengine_node_batch_size", "sequences stepped in the last engine step")
STEP_SECONDS = Histogram(
    "openengine_node_step_duration_seconds",
    "engine step duration",
    buckets=(0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
PREFILL_TOKENS = Counter(
    "openengine_node_prefill_tokens",
    "prompt tokens the engine read (computed their KV cache), preempted requests' again",
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "openengine_node_prefix_cache_hit_tokens",
    "prompt tokens whose KV cache came from the prefix cache instead of being read",
)
KV_CACHED_BLOCKS = Gauge(
    "openengine_node_kv_cached_blocks",
    "KV blocks (common/kv_blocks.py) the prefix cache holds, as its engine counts them: what a KV-event subscriber's "
    "set must match",
)
LANE_BACKLOG = Gauge(
    "openengine_node_lane_backlog_steps",
    "engine steps waiting on a result lane, merged into one message (the largest of the lanes)",
)
LANE_SHED_REQUESTS = Counter(
    "openengine_node_lane_shed_requests",
    "requests ended with a retryable error because their frontend fell behind on its lane",
)
WORKER_RESTARTS = Gauge("openengine_node_worker_restarts", "times the engine worker was respawned")
QUEUE_SECONDS = Histogram(
    "openengine_node_request_queue_time_seconds",
    "from the node accepting a request to its first token (waiting for a batch slot)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
SLOT_USAGE = Gauge("openengine_node_batch_slot_usage", "running sequences / max batch (0..1) of the last step")
# vLLM's lora_requests_info, which LoRA-aware gateways read: one series, its labels the adapters of the running
# and of the queued requests (comma-separated) and the most the node holds; its value the time they last changed.
LORA_REQUESTS_INFO = Gauge(
    "openengine_node_lora_requests_info",
    "LoRA adapters of the running and the waiting requests (labels); value: when they last changed (unix time)",
    ("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
)
_lora_labels: tuple[str, str, str] | None = None


def observe_step(step: cluster_pb2.EngineStep, max_batch: int, max_loras: int = 0) -> None:
    if max_loras:
        _observe_loras(step, max_loras)
    RUNNING.set(step.running)
    SLOT_USAGE.set(step.running / max_batch)
    QUEUED.set(step.queued)
    KV_CACHED_BLOCKS.set(step.cached_blocks)
    if step.events:  # idle heartbeats are not steps
        BATCH_SIZE.set(step.running)
        STEP_SECONDS.observe(step.step_seconds)
    if step.prefilled_tokens:
        PREFILL_TOKENS.inc(step.prefilled_tokens)
    if step.cached_prompt_tokens:
        PREFIX_CACHE_HIT_TOKENS.inc(step.cached_prompt_tokens)


def _observe_loras(step: cluster_pb2.EngineStep, max_loras: int) -> None:
    global _lora_labels
    labels = (",".join(step.running_loras), ",".join(step.waiting_loras), str(max_loras))
    if labels == _lora_labels:
        return
    if _lora_labels is not None:
        LORA_REQUESTS_INFO.remove(*_lora_labels)
    LORA_REQUESTS_INFO.labels(*labels).set(time.time())
    _lora_labels = labels
