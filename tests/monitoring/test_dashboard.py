"""The Grafana dashboard and the Compose Prometheus configuration, checked without a server:
layout, data source, and that the dashboard and the alerts use exactly the documented metrics."""

from __future__ import annotations

import itertools
import re
import subprocess

import yaml

from .prom import MONITORING, REPO, RULES, binary, dashboard

METRIC = re.compile(r"\bopenengine_[a-z_]+")
HISTOGRAM_SERIES = re.compile(r"_(bucket|count|sum)$")


def documented_metrics() -> set[str]:
    """Metric names of the README's Metrics table (labels stripped)."""
    readme = REPO.joinpath("README.md").read_text()
    table = readme.split("### Metrics", 1)[1].split("\n## ", 1)[0]
    return {
        m
        for line in table.splitlines()
        if line.startswith("| `openengine_")
        for m in METRIC.findall(line.split("|")[1])
    }


def queried_metrics(exprs) -> set[str]:
    return {HISTOGRAM_SERIES.sub("", m) for expr in exprs for m in METRIC.findall(expr)}


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def test_panels_are_well_formed():
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], (panel["title"], target["expr"])
    variables = {v["name"] for v in dashboard()["templating"]["list"]}
    assert variables == {"datasource", "namespace"}


def test_panels_do_not_overlap():
    cells = {}
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        for x, y in itertools.product(range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])):
            assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
            cells[(x, y)] = panel["title"]


def test_every_documented_metric_has_a_panel():
    documented = documented_metrics()
    assert len(documented) >= 15, documented
    shown = queried_metrics(t["expr"] for p in panels() for t in p["targets"])
    assert documented - shown == set(), "README metrics missing from the dashboard (add a panel or a query)"


def test_dashboard_and_alerts_query_only_documented_metrics():
    documented = documented_metrics()
    exprs = [t["expr"] for p in panels() for t in p["targets"]]
    exprs += [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert queried_metrics(exprs) - documented == set()


def test_compose_prometheus_config_is_valid():
    proc = subprocess.run(
        [binary("promtool"), "check", "config", str(MONITORING / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout


def test_compose_profile_wires_grafana_to_prometheus_and_the_dashboard():
    """Grafana cannot run here: check that its provisioning points where the Compose file puts things."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    grafana, prometheus = services["grafana"], services["prometheus"]
    assert grafana["profiles"] == prometheus["profiles"] == ["observability"]
    mounts = dict(v.removesuffix(":ro").split(":", 1) for v in grafana["volumes"])
    assert mounts["./deploy/monitoring/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboard_target = mounts["./deploy/monitoring/openengine-dashboard.json"]
    provisioning = MONITORING / "grafana" / "provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "openengine.yml").read_text())["providers"]
    assert dashboard_target.rsplit("/", 1)[0] == provider["options"]["path"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_target
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == "http://prometheus:9090"
    assert any(p.endswith(":9090") for p in prometheus["ports"])
    prom_mounts = dict(v.removesuffix(":ro").split(":", 1) for v in prometheus["volumes"])
    assert prom_mounts["./deploy/monitoring/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert prom_mounts["./deploy/monitoring/openengine-alerts.yml"] == "/etc/prometheus/openengine-alerts.yml"


def test_compose_passes_the_tracing_variables_and_offers_a_trace_backend():
    """Every component takes OTEL_EXPORTER_OTLP_ENDPOINT from the environment (empty: tracing off); the
    observability profile's Jaeger receives OTLP/gRPC on the port the docs name."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    for component in ("coordinator", "node", "frontend"):
        env = services[component]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "${OTEL_EXPORTER_OTLP_ENDPOINT:-}", component
        assert env["OTEL_TRACES_SAMPLER"].startswith("${OTEL_TRACES_SAMPLER:-"), component
    jaeger = services["jaeger"]
    assert jaeger["profiles"] == ["observability"]
    assert jaeger["image"].startswith("${OPENENGINE_JAEGER_IMAGE:-jaegertracing/all-in-one:")
    assert any(p.endswith(":16686") for p in jaeger["ports"])
    assert "http://jaeger:4317" in (REPO / "docs" / "observability.md").read_text()
