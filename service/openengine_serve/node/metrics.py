"""Node metrics (Prometheus, prefix openengine_node_)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from ..api.openengine_internal.v1 import cluster_pb2

RUNNING = Gauge("openengine_node_running_requests", "requests in the engine batch")
QUEUED = Gauge("openengine_node_queued_requests", "requests waiting for a batch slot")
BATCH_SIZE = Gauge("openengine_node_batch_size", "sequences stepped in the last engine step")
STEP_SECONDS = Histogram("openengine_node_step_duration_seconds", "engine step duration",
                         buckets=(0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25))
LANE_BACKLOG = Gauge("openengine_node_lane_backlog_steps",
                     "engine steps waiting on a result lane, merged into one message (the largest of the lanes)")
LANE_SHED_REQUESTS = Counter("openengine_node_lane_shed_requests",
                             "requests ended with a retryable error because their frontend fell behind on its lane")
WORKER_RESTARTS = Gauge("openengine_node_worker_restarts", "times the engine worker was respawned")


def observe_step(step: cluster_pb2.EngineStep) -> None:
    RUNNING.set(step.running)
    QUEUED.set(step.queued)
    if step.events:  # idle heartbeats are not steps
        BATCH_SIZE.set(step.running)
        STEP_SECONDS.observe(step.step_seconds)
