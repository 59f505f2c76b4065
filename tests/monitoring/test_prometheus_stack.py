"""A real Prometheus scrapes a real `openengine-serve up --metrics` stack under load:
every dashboard query returns data, so do the chart's KEDA queries and the example
prometheus-adapter rules.

The alert rules: a run of about 30 s cannot make an alert with `for: 1m` or more fire
(tests/monitoring/test_rules.py checks firing and silence with promtool's simulated time).
What it shows here: every alert of the file is loaded and evaluated on the live data
without error, each expression returns nothing on the healthy stack (every alert
inactive), and the one condition the test sets up, a scrape target of the deployment
that does not answer, is seen at once: OpenEngineComponentDown goes pending for it.

OPENENGINE_DASHBOARD_PNG=docs/observability/dashboard.png writes the documentation
image (rendered from the dashboard's queries) instead of a temporary one.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from openengine_serve.api.openengine.v1 import generation_pb2
from openengine_serve.client import Client

from ..helm.chart_helpers import CHART_DIR, NAMESPACE, RELEASE, VARIANTS, Rendered, name, require
from ..integration.processes import wait_for
from ..integration.test_generate import request
from .prom import ADAPTER_RULES, RULES, Prometheus, alert_rules, binary, finite_values, panel_queries
from .render import render

NODES = 2
# `up --metrics` serves frontend, coordinator and nodes on these fixed ports.
METRICS_PORTS = {"frontend": [9091], "coordinator": [9092], "node": [9093 + i for i in range(NODES)]}
LOAD_S = 25.0
SCRAPE = "1s"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        # as the metrics servers bind: connections of the previous stack may linger in TIME_WAIT
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture
def up_stack(request):
    busy = [p for ports in METRICS_PORTS.values() for p in ports if not port_free(p)]
    assert not busy, f"`openengine-serve up --metrics` needs 127.0.0.1 ports {busy} free"
    from openengine_serve.local import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "up",
            "--metrics",
            "--port",
            str(port),
            "--nodes",
            str(NODES),
            "--grpc-server",
            request.param,
            "--engine",
            "simulated",
        ],  # load at a rate only the simulated engine serves here
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "ready on" in line, f"`openengine-serve up` did not start: {line!r}"
        yield f"127.0.0.1:{port}", request.param
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def keda_queries() -> dict[str, str]:
    """The Prometheus queries of the chart's KEDA ScaledObjects (variant "keda"), by trigger."""
    helm, yaml = require("helm_python"), require("yaml")
    chart = helm.Chart.load(str(CHART_DIR))
    try:
        rendered = Rendered(chart.render(VARIANTS["keda"], name=RELEASE, namespace=NAMESPACE, is_install=True), yaml)
    finally:
        chart.close()
    return {
        f"{so['metadata']['name']}/{t['name']}": t["metadata"]["query"]
        for so in rendered.of_kind("ScaledObject")
        for t in so["spec"]["triggers"]
    }


def adapter_queries() -> dict[str, str]:
    """The metricsQuery of every example prometheus-adapter rule, filled in as the adapter does
    for an HPA in NAMESPACE (Pods rules: per pod; External rules: per namespace)."""
    yaml = require("yaml")
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    out = {}
    for kind, group_by, matchers in (
        ("custom", "pod", f'namespace="{NAMESPACE}",pod=~".+"'),
        ("external", "namespace", f'namespace="{NAMESPACE}"'),
    ):
        for rule in rules[kind]:
            series = rule["seriesQuery"].split("{", 1)[0]
            query = (
                rule["metricsQuery"]
                .replace("<<.Series>>", series)
                .replace("<<.LabelMatchers>>", matchers)
                .replace("<<.GroupBy>>", group_by)
            )
            out[f"{kind}/{rule['name']['as']}"] = query
    return out


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: a scrape target that is down."""
    from openengine_serve.local import free_port

    return free_port()


@pytest.fixture
def prometheus(tmp_path, closed_port):
    binary("prometheus")
    config = {
        "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE},
        "rule_files": [str(RULES)],
        # Each target labelled as the Prometheus Operator labels a pod of the chart's release, so the
        # chart's autoscaling queries can be run here too.
        "scrape_configs": [
            {
                "job_name": f"openengine-{component}",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{p}"],
                        "labels": {"namespace": NAMESPACE, "pod": f"{name(component)}-5f7c9d8b6-pod{i}"},
                    }
                    for i, p in enumerate(ports)
                ],
            }
            for component, ports in METRICS_PORTS.items()
        ]
        + [
            {  # as pods scraped through prometheus.io/* annotations are labelled; not on the dashboard
                "job_name": "kubernetes-pods",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{closed_port}"],
                        "labels": {"namespace": NAMESPACE, "app_kubernetes_io_part_of": "openengine-serve"},
                    }
                ],
            }
        ],
    }
    prom = Prometheus(tmp_path / "prometheus", config).wait_ready()
    yield prom
    prom.stop()


def load(target: str, stop: threading.Event, errors: list[BaseException]) -> None:
    try:
        with Client(target) as client:
            while not stop.is_set():
                assert list(client.generate(request(max_tokens=48), timeout=30))[-1].HasField("usage")
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


@pytest.mark.parametrize("up_stack", ["grpcio", "pygrpc-native"], indirect=True)
def test_every_dashboard_query_returns_data_under_load(up_stack, prometheus, closed_port, tmp_path):
    target, server = up_stack
    wait_for(
        lambda: len([t for t in prometheus.api("targets")["activeTargets"] if t["health"] == "up"]) == NODES + 2,
        30,
        "every component scraped",
        interval=0.5,
    )
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=load, args=(target, stop, errors), daemon=True) for _ in range(4)]
    start = time.time()
    for t in threads:
        t.start()
    with Client(target) as client:  # one client error, so "Requests by status" shows a rejection too
        with pytest.raises(grpc.RpcError):
            list(client.generate(generation_pb2.GenerateRequest(request_id="", model="x"), timeout=10))
    try:
        time.sleep(LOAD_S)
        assert not errors, errors
        missing = []
        for title, ref, expr in panel_queries():
            result = prometheus.query(expr)
            if not finite_values(result):
                missing.append(f"{title} [{ref}]: {expr} -> {result}")
        assert not missing, "dashboard queries without data:\n" + "\n".join(missing)
        scaler_queries = keda_queries()
        assert len(scaler_queries) == 3
        for trigger, expr in scaler_queries.items():
            assert len(finite_values(prometheus.query(expr))) == 1, f"KEDA trigger {trigger}: {expr} has no value"
        adapter = adapter_queries()
        assert len(adapter) == 6
        for rule, expr in adapter.items():
            assert finite_values(prometheus.query(expr)), f"prometheus-adapter rule {rule}: {expr} has no value"
        info = prometheus.query("openengine_frontend_grpc_server_info == 1")
        assert {s["metric"]["implementation"] for s in info} == {server}
        tokens = prometheus.query("sum(increase(openengine_frontend_generated_tokens_total[1m]))")
        assert finite_values(tokens)[0] > 100
        png = Path(os.environ.get("OPENENGINE_DASHBOARD_PNG") or tmp_path / "dashboard.png")
        drawn = render(prometheus, start, time.time(), png)
        assert drawn >= 10 and png.stat().st_size > 10_000
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=40)

    rules = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"] if r["type"] == "alerting"}
    assert set(rules) == {rule["alert"] for rule in alert_rules()}
    down = f"127.0.0.1:{closed_port}"
    for alert, rule in rules.items():
        assert rule["health"] == "ok" and not rule["lastEvaluation"].startswith("0001-"), (alert, rule)
        answer = prometheus.query(rule["query"])  # the expression on the live data, without error
        if alert == "OpenEngineComponentDown":
            assert [s["metric"]["instance"] for s in answer] == [down], answer
            assert rule["state"] == "pending", rule  # its `for: 2m` is longer than this run
        else:
            assert answer == [], f"{alert} is true on a healthy stack under load: {answer}"
            assert rule["state"] == "inactive", rule
