"""Prometheus metrics on each component's own port move with traffic; several frontend workers share one scrape."""

from __future__ import annotations

import collections
import importlib.metadata
import os
import urllib.parse

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2, server_pb2
from openengine_serve.client import Client

from . import processes
from .conftest import request
from .processes import metric, scrape, wait_for, with_metrics

REQUESTS = "openengine_frontend_requests_total"


def finished_ok(samples) -> float:
    """Requests that finished normally; `key` is "-" with API keys off."""
    return metric(samples, REQUESTS, status="finished", code="OK", key="-")


def generate_on_fresh_connections(target: str, instances: int, per_instance: int) -> tuple[collections.Counter, int]:
    """Generations over fresh connections until each of `instances` frontend processes (told apart by
    ServerInfo.instance_id on the same connection) has finished `per_instance`; returns the count by process
    and the number of token deltas received."""
    served: collections.Counter = collections.Counter()
    deltas = 0
    for _ in range(60):
        with Client(target, retries=False) as client:
            instance = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5).instance_id
            if served[instance] >= per_instance:
                continue
            responses = list(client.inference.Generate(request(max_tokens=20), timeout=30))
            assert responses[-1].HasField("usage") and responses[-1].usage.completion_tokens == 20
            served[instance] += 1
            deltas += sum(r.WhichOneof("event") == "token" for r in responses)
        if len(served) == instances and min(served.values()) >= per_instance:
            return served, deltas
    raise AssertionError(f"60 fresh connections did not reach {instances} processes {per_instance} times: {served}")


@pytest.mark.parametrize("workers", [1, 2], ids=["one-worker", "two-workers"])
def test_metrics_move_with_traffic(deployment, workers):
    coord, coord_metrics = with_metrics(processes.coordinator())
    deployment.add(coord)
    node, node_metrics = with_metrics(processes.node(coord.target, 0))
    deployment.add(node)
    fe, fe_metrics = with_metrics(processes.frontend(coord.target, "pygrpc-native", "--workers", str(workers)))
    deployment.add(fe)

    # every worker serving (each registers with the coordinator once it listens), not only the first one
    wait_for(
        lambda: metric(scrape(coord_metrics), "openengine_coordinator_frontends", state="live") == workers,
        30,
        f"{workers} frontend worker(s) registered",
    )
    before = scrape(fe_metrics)
    assert (
        metric(
            before,
            "openengine_frontend_grpc_server_info",
            implementation="pygrpc-native",
            version=importlib.metadata.version("pygrpc-native"),
        )
        == 1
    )
    served, deltas = generate_on_fresh_connections(fe.target, workers, 3)
    with Client(fe.target) as client, pytest.raises(grpc.RpcError):
        list(client.generate(generation_pb2.GenerateRequest(request_id="", model="x"), timeout=10))
    after = scrape(fe_metrics)
    sent = sum(served.values())
    # one scrape counts every worker's requests: with two workers, each served some of them
    assert finished_ok(after) - finished_ok(before) == sent
    assert metric(after, REQUESTS, status="rejected", code="INVALID_ARGUMENT", key="-") == 1
    assert (
        metric(after, "openengine_frontend_generated_tokens_total")
        - metric(before, "openengine_frontend_generated_tokens_total")
        == 20 * sent
    )
    assert metric(after, "openengine_frontend_prompt_tokens_total") == sent * 4
    assert metric(after, "openengine_frontend_time_to_first_token_seconds_count") == sent
    # one interval between each two deltas of a stream (several engine steps may share a delta under load)
    assert metric(after, "openengine_frontend_inter_token_latency_seconds_count") == deltas - sent
    assert metric(after, "openengine_frontend_request_duration_seconds_count") == sent
    assert metric(after, "openengine_frontend_in_flight_requests") == 0
    # one in-flight series per worker, each back at 0; refusals by reason, every reason present from the start
    per_worker = {
        labels: value
        for (name, labels), value in after.items()
        if name == "openengine_frontend_worker_in_flight_requests"
    }
    assert len(per_worker) == workers and set(per_worker.values()) == {0}
    refusals = {
        dict(labels)["reason"]: value
        for (name, labels), value in after.items()
        if name == "openengine_frontend_refusals_total"
    }
    assert refusals == {
        "invalid_request": 1,
        "not_served": 0,
        "unsupported": 0,
        "duplicate_request": 0,
        "unavailable": 0,
        "overloaded": 0,
        "key_at_limit": 0,
        "not_permitted": 0,
    }

    node_samples = scrape(node_metrics)
    assert metric(node_samples, "openengine_node_step_duration_seconds_count") >= 20
    # each request sent reported its wait for a batch slot once
    assert metric(node_samples, "openengine_node_request_queue_time_seconds_count") >= sent
    assert metric(node_samples, "openengine_node_batch_slot_usage") == 0
    coord_samples = wait_for(
        lambda: (s := scrape(coord_metrics)) and metric(s, "openengine_coordinator_nodes", state="ready") == 1 and s,
        5,
        "the coordinator's node gauge",
    )
    assert metric(coord_samples, "openengine_coordinator_frontends", state="live") == workers
    assert metric(coord_samples, "openengine_coordinator_routing_decisions_total", reason="least_loaded") >= sent
    assert metric(coord_samples, "openengine_coordinator_finished_remembered") >= sent
    for gauge in ("oldest_reservation_age_s", "frontend_reported_live_requests"):
        assert (f"openengine_coordinator_{gauge}", ()) in coord_samples


def test_gauges_and_counters_follow_a_running_request(deployment):
    """running_requests and live_reservations rise while a request runs and fall when it is cancelled;
    the cancel, a duplicate id and an unknown rank each show in their counters."""
    coord, coord_metrics = with_metrics(processes.coordinator())
    deployment.add(coord)
    node, node_metrics = with_metrics(processes.node(coord.target, 0))
    deployment.add(node)
    fe, fe_metrics = with_metrics(processes.frontend(coord.target, "grpcio"))
    deployment.add(fe)
    refusals = "openengine_coordinator_refusals_total"
    live = "openengine_coordinator_live_reservations"
    before = scrape(fe_metrics)
    assert metric(scrape(node_metrics), "openengine_node_running_requests") == 0
    assert metric(scrape(coord_metrics), live) == 0
    assert metric(scrape(coord_metrics), refusals, reason="duplicate") == 0

    with Client(fe.target, retries=False) as client:
        long = request(max_tokens=8000)  # 16 s at the default 2 ms step: it ends only when cancelled
        stream = client.inference.Generate(long, timeout=60)
        assert next(stream).WhichOneof("event") == "token"
        wait_for(
            lambda: metric(scrape(node_metrics), "openengine_node_running_requests") == 1,
            5,
            "the node's running_requests gauge at 1",
        )
        assert metric(scrape(node_metrics), "openengine_node_batch_slot_usage") == 1 / 256  # the default batch
        assert (
            sum(
                value
                for (name, _), value in scrape(fe_metrics).items()
                if name == "openengine_frontend_worker_in_flight_requests"
            )
            == 1
        )
        assert metric(scrape(coord_metrics), live) == 1
        with pytest.raises(grpc.RpcError) as duplicate:
            list(client.inference.Generate(long, timeout=10))
        assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as no_rank:
            list(
                client.inference.Generate(
                    request(max_tokens=2), timeout=10, metadata=(("openengine-target-dp-rank", "7"),)
                )
            )
        assert no_rank.value.code() == grpc.StatusCode.NOT_FOUND
        stream.cancel()
    wait_for(
        lambda: metric(scrape(node_metrics), "openengine_node_running_requests") == 0,
        5,
        "the node's running_requests gauge back at 0",
    )
    wait_for(lambda: metric(scrape(coord_metrics), live) == 0, 5, "live_reservations back at 0")
    coord_samples = scrape(coord_metrics)
    assert metric(coord_samples, refusals, reason="duplicate") == 1
    assert metric(coord_samples, refusals, reason="rank_not_found") == 1
    after = wait_for(
        lambda: (
            (s := scrape(fe_metrics)) and metric(s, REQUESTS, status="cancelled", code="CANCELLED", key="-") == 1 and s
        ),
        5,
        "the cancelled request counted",
    )
    assert finished_ok(after) == finished_ok(before)
    frontend_refusals = "openengine_frontend_refusals_total"
    assert metric(after, frontend_refusals, reason="duplicate_request") == 1
    assert metric(after, frontend_refusals, reason="not_served") == 1


def listening_ports(pid: int) -> set[int]:
    """TCP ports a process listens on, from /proc (its socket inodes matched against the kernel's tables)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_metrics_port_zero_disables_the_endpoint(cluster, stack):
    """The shared deployment runs with --metrics-port 0: each process listens on its API ports only (the
    frontend: gRPC and the OpenAI-compatible HTTP API)."""
    coord, nodes = cluster
    assert listening_ports(coord.proc.pid) == {coord.port}
    http_port = urllib.parse.urlsplit(stack.http_url).port
    assert listening_ports(stack.frontend.proc.pid) == {stack.frontend.port, http_port}
    assert nodes[0].port in listening_ports(nodes[0].proc.pid)


def test_a_metrics_port_is_listened_on(deployment):
    """The counterpart of the test above: the same check sees a metrics port when one is given."""
    coord, coord_metrics = with_metrics(processes.coordinator())
    deployment.add(coord)
    assert listening_ports(coord.proc.pid) == {coord.port, coord_metrics}
