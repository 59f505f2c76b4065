"""Coordinator metrics (Prometheus, prefix openengine_coordinator_), read from the state at scrape time."""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .state import ClusterState


class CoordinatorCollector(Collector):
    def __init__(self, state: ClusterState, heartbeat_streams: dict[str, int]) -> None:
        self.state = state
        self.heartbeat_streams = heartbeat_streams

    def collect(self):
        snapshot = self.state.snapshot()
        nodes = GaugeMetricFamily("openengine_coordinator_nodes", "nodes by state", labels=["state"])
        for state, count in snapshot["nodes_by_state"].items():
            nodes.add_metric([state], count)
        frontends = GaugeMetricFamily("openengine_coordinator_frontends", "frontends by state", labels=["state"])
        for state, count in snapshot["frontends_by_state"].items():
            frontends.add_metric([state], count)
        routing = CounterMetricFamily(
            "openengine_coordinator_routing_decisions", "requests routed, by reason", labels=["reason"]
        )
        for reason, count in snapshot["routing_decisions"].items():
            routing.add_metric([reason], count)
        refusals = CounterMetricFamily(
            "openengine_coordinator_refusals", "reservations refused, by reason", labels=["reason"]
        )
        for reason, count in snapshot["refusals"].items():
            refusals.add_metric([reason], count)
        streams = GaugeMetricFamily(
            "openengine_coordinator_heartbeat_streams",
            "heartbeat streams open, by peer (one per node and frontend worker when all is well)",
            labels=["peer"],
        )
        for peer, count in self.heartbeat_streams.items():
            streams.add_metric([peer], count)
        kv_blocks = GaugeMetricFamily(
            "openengine_coordinator_kv_cached_blocks",
            "KV blocks each node's prefix cache holds, as the coordinator follows them (its KV events)",
            labels=["node_id"],
        )
        for entry in self.state.node_entries():  # 0 for a node whose events it does not follow
            kv_blocks.add_metric([entry.node_id], self.state.kv_index.blocks(entry.node_id))
        yield from (nodes, frontends, routing, refusals, streams, kv_blocks)
        for key, help_text in _GAUGES.items():
            yield GaugeMetricFamily(f"openengine_coordinator_{key}", help_text, value=snapshot[key])


_GAUGES = {  # snapshot key -> help; the metric is openengine_coordinator_<key>
    "live_reservations": "request ids currently owned",
    "oldest_reservation_age_s": "age of the oldest live reservation (grows without bound when a frontend leaks "
    "reservations)",
    "frontend_reported_live_requests": "live requests the frontends report in their heartbeats (compare with "
    "live_reservations)",
    "finished_remembered": "finished request ids remembered to answer a late Abort",
}


def register(state: ClusterState, heartbeat_streams: dict[str, int]) -> None:
    REGISTRY.register(CoordinatorCollector(state, heartbeat_streams))
