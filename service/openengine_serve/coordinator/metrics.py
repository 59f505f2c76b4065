"""Coordinator metrics (Prometheus, prefix openengine_coordinator_), published from the state's snapshot."""

from __future__ import annotations

from prometheus_client import Gauge

NODES = Gauge("openengine_coordinator_nodes", "nodes by state", ["state"])
FRONTENDS = Gauge("openengine_coordinator_frontends", "frontends by state", ["state"])
ROUTING = Gauge("openengine_coordinator_routing_decisions", "requests routed since start, by reason", ["reason"])
REFUSALS = Gauge("openengine_coordinator_refusals", "reservations refused since start, by reason", ["reason"])
LIVE_RESERVATIONS = Gauge("openengine_coordinator_live_reservations", "request ids currently owned")


def publish(snapshot: dict) -> None:
    for state, count in snapshot["nodes_by_state"].items():
        NODES.labels(state=state).set(count)
    for state, count in snapshot["frontends_by_state"].items():
        FRONTENDS.labels(state=state).set(count)
    for reason, count in snapshot["routing_decisions"].items():
        ROUTING.labels(reason=reason).set(count)
    for reason, count in snapshot["refusals"].items():
        REFUSALS.labels(reason=reason).set(count)
    LIVE_RESERVATIONS.set(snapshot["live_reservations"])
