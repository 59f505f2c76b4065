"""Prometheus metrics on each component's own port move with traffic; several frontend workers share one scrape."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openengine_serve.api.openengine.v1 import generation_pb2
from openengine_serve.client import Client

from . import processes
from .processes import Deployment, wait_for
from .test_generate import request


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def with_metrics(component: processes.Component) -> tuple[processes.Component, int]:
    port = processes.free_port()
    component.args[component.args.index("--metrics-port") + 1] = str(port)
    return component, port


@pytest.fixture
def deployment():
    d = Deployment()
    yield d
    d.close()


@pytest.mark.parametrize("workers", [1, 2], ids=["one-worker", "two-workers"])
def test_metrics_move_with_traffic(deployment, workers):
    coord, coord_metrics = with_metrics(processes.coordinator())
    deployment.add(coord)
    node, node_metrics = with_metrics(processes.node(coord.target, 0))
    deployment.add(node)
    fe, fe_metrics = with_metrics(processes.frontend(coord.target, "pygrpc-native", "--workers", str(workers)))
    deployment.add(fe)

    before = scrape(fe_metrics)
    assert value(before, "openengine_frontend_grpc_server_info", implementation="pygrpc-native",
                 version="0.5.0") == 1
    for _ in range(6):  # a fresh connection each, so two workers both take traffic
        with Client(fe.target) as client:
            assert list(client.generate(request(max_tokens=20), timeout=30))[-1].HasField("usage")
    with Client(fe.target) as client, pytest.raises(grpc.RpcError):
        list(client.generate(generation_pb2.GenerateRequest(request_id="", model="x"), timeout=10))
    after = scrape(fe_metrics)
    ok = "openengine_frontend_requests_total"
    assert value(after, ok, status="finished", code="OK", key="-") - \
        value(before, ok, status="finished", code="OK", key="-") == 6
    assert value(after, ok, status="rejected", code="INVALID_ARGUMENT", key="-") >= 1
    assert value(after, "openengine_frontend_generated_tokens_total") - \
        value(before, "openengine_frontend_generated_tokens_total") == 120
    assert value(after, "openengine_frontend_prompt_tokens_total") >= 6 * 4
    assert value(after, "openengine_frontend_time_to_first_token_seconds_count") >= 6
    assert value(after, "openengine_frontend_inter_token_latency_seconds_count") >= 6 * 19
    assert value(after, "openengine_frontend_request_duration_seconds_count") >= 6
    assert value(after, "openengine_frontend_in_flight_requests") == 0

    node_samples = scrape(node_metrics)
    assert value(node_samples, "openengine_node_step_duration_seconds_count") >= 20
    assert ("openengine_node_running_requests", ()) in node_samples
    assert ("openengine_node_worker_restarts", ()) in node_samples

    coord_samples = wait_for(lambda: (s := scrape(coord_metrics)) and
                             value(s, "openengine_coordinator_nodes", state="ready") == 1 and s, 5,
                             "the coordinator's node gauge")
    assert value(coord_samples, "openengine_coordinator_frontends", state="live") == workers
    assert value(coord_samples, "openengine_coordinator_routing_decisions_total", reason="least_loaded") >= 6
    assert ("openengine_coordinator_live_reservations", ()) in coord_samples
