"""The chart's monitoring and load-autoscaling objects: the Grafana dashboard
ConfigMap, the PrometheusRule, KEDA ScaledObjects and the prometheus-adapter HPA.

The dashboard and rules are the files of deploy/monitoring (the chart holds
identical copies); the CRD objects are checked against the fields of their CRDs
(kubernetes-validate ships no schema for them), the HPAs by kubernetes-validate
through the variants of chart_helpers.VARIANTS.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from .chart_helpers import CHART_DIR, NAMESPACE, RELEASE, REPO, VARIANTS, name, require

pytestmark = pytest.mark.helm

MONITORING = REPO / "deploy" / "monitoring"
ASSETS = ("openengine-dashboard.json", "openengine-alerts.yml")

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# The fields of keda.sh/v1alpha1 ScaledObject the chart may set (KEDA 2.x CRD), closed.
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                    },
                },
                "fallback": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "metadata": _STRING_MAP,
                            "authenticationRef": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
# monitoring.coreos.com/v1 PrometheusRule (Prometheus Operator CRD), closed.
PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "interval": {"type": "string"},
                            "limit": {"type": "integer"},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["expr"],
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": "string"},
                                        "for": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"},
                                        "keep_firing_for": {"type": "string"},
                                        "labels": _STRING_MAP,
                                        "annotations": _STRING_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


def validate(doc: dict[str, Any], schema: dict[str, Any]) -> None:
    require("jsonschema").validate(doc, schema)


# ---------------------------------------------------------------- the files


@pytest.mark.parametrize("asset", ASSETS)
def test_chart_files_are_the_deploy_monitoring_files(asset: str) -> None:
    chart_copy, source = CHART_DIR / "files" / asset, MONITORING / asset
    assert chart_copy.read_bytes() == source.read_bytes(), (
        f"{chart_copy} differs from {source}: edit deploy/monitoring, then cp {source} {chart_copy}"
    )


def test_off_by_default(render) -> None:
    r = render()
    assert not r.of_kind("PrometheusRule") and not r.of_kind("ScaledObject") and not r.of_kind("ConfigMap")
    assert not r.of_kind("HorizontalPodAutoscaler")


# ------------------------------------------------------- dashboard and rules


def test_dashboard_config_map(render) -> None:
    r = render(VARIANTS["monitoring"])
    cm = r.get("ConfigMap", f"{RELEASE}-openengine-serve-dashboard")
    assert cm["metadata"]["namespace"] == NAMESPACE
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["team"] == "llm"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Inference"}
    assert json.loads(cm["data"]["openengine-dashboard.json"]) == json.loads(
        (MONITORING / "openengine-dashboard.json").read_text()
    )


def test_dashboard_sidecar_label_and_namespace_are_configurable(render) -> None:
    r = render(
        {"monitoring": {"dashboards": {"enabled": True, "label": "dash", "labelValue": "yes", "namespace": "grafana"}}}
    )
    (cm,) = r.of_kind("ConfigMap")
    assert cm["metadata"]["labels"]["dash"] == "yes" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "grafana"
    assert "annotations" not in cm["metadata"]


def test_prometheus_rule_is_the_rule_file(render, yaml) -> None:
    r = render(VARIANTS["monitoring"])
    (rule,) = r.of_kind("PrometheusRule")
    validate(rule, PROMETHEUS_RULE)
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((MONITORING / "openengine-alerts.yml").read_text())
    assert len([x for g in rule["spec"]["groups"] for x in g["rules"] if "alert" in x]) >= 8


# -------------------------------------------------------------- autoscaling


def pod_name(component: str) -> str:
    return f"{name(component)}-7d9f8b6c5d-x2kqz"  # what a Deployment's ReplicaSet names its pods


def query_selects(query: str, pod: str) -> bool:
    """Every pod matcher of the query (pod=~"regex") matches `pod`, and the namespace matcher is this one."""
    pods = re.findall(r'pod=~"([^"]+)"', query)
    assert pods and all(f'namespace="{NAMESPACE}"' in m for m in re.findall(r"\{[^}]*\}", query)), query
    return all(re.fullmatch(p, pod) for p in pods)


def test_keda_scaled_objects(render, chart) -> None:
    r = render(VARIANTS["keda"])
    values = chart.merge_values(VARIANTS["keda"])["autoscaling"]
    objects = {o["metadata"]["name"]: o for o in r.of_kind("ScaledObject")}
    assert set(objects) == {name("node"), name("frontend")}
    assert not r.of_kind("HorizontalPodAutoscaler"), "KEDA creates the HPA itself"
    expected = {
        "node": {
            "queued": ("openengine_node_queued_requests", 8),
            "in-use": ("openengine_node_running_requests", values["node"]["inUsePerNode"]),
        },
        "frontend": {
            "in-flight": ("openengine_frontend_in_flight_requests", values["frontend"]["inFlightPerFrontend"])
        },
    }
    for component, triggers in expected.items():
        so = objects[name(component)]
        validate(so, SCALED_OBJECT)
        spec = so["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name(component)}
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (
            values[component]["minReplicas"],
            values[component]["maxReplicas"],
        )
        assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == values["behavior"]
        assert {t["name"] for t in spec["triggers"]} == set(triggers)
        other = "frontend" if component == "node" else "node"
        for trigger in spec["triggers"]:
            metric, threshold = triggers[trigger["name"]]
            meta = trigger["metadata"]
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
            assert meta["serverAddress"] == values["prometheus"]["serverAddress"]
            assert float(meta["threshold"]) == threshold
            assert metric in meta["query"] and meta["query"].startswith("sum(")
            assert query_selects(meta["query"], pod_name(component))
            assert not query_selects(meta["query"], pod_name(other))
            assert trigger["authenticationRef"] == {"name": "prometheus-auth"}


@pytest.mark.parametrize("provider", ["keda", "hpa"])
def test_load_autoscaling_scales_each_node_group_on_its_own_pods(render, provider: str) -> None:
    values = {
        "node": {"groups": [{"name": "gemma"}]},
        "autoscaling": {"provider": provider, "node": {"enabled": True}},
    }
    r = render(values)
    kind = "ScaledObject" if provider == "keda" else "HorizontalPodAutoscaler"
    scalers = {o["spec"]["scaleTargetRef"]["name"]: o for o in r.of_kind(kind)}
    assert set(scalers) == {name("node"), name("node-gemma")}
    for component, other in (("node", "node-gemma"), ("node-gemma", "node")):
        assert "replicas" not in r.get("Deployment", name(component))["spec"]
        if provider == "keda":
            for trigger in scalers[name(component)]["spec"]["triggers"]:
                assert query_selects(trigger["metadata"]["query"], pod_name(component))
                assert not query_selects(trigger["metadata"]["query"], pod_name(other))


@pytest.mark.parametrize("variant", ["adapter-pods", "adapter-external"])
def test_prometheus_adapter_hpa(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    values = chart.merge_values(VARIANTS[variant])["autoscaling"]
    metric_type = values["hpa"]["metricType"]
    hpas = {h["metadata"]["name"]: h for h in r.of_kind("HorizontalPodAutoscaler")}
    enabled = [c for c in ("node", "frontend") if values[c]["enabled"]]
    assert set(hpas) == {name(c) for c in enabled}
    assert not r.of_kind("ScaledObject")
    targets = {
        "node": {
            "openengine_node_queued_requests": values["node"]["queuedPerNode"],
            "openengine_node_requests_in_use": values["node"]["inUsePerNode"],
        },
        "frontend": {"openengine_frontend_in_flight_requests": values["frontend"]["inFlightPerFrontend"]},
    }
    for component in enabled:
        spec = hpas[name(component)]["spec"]
        assert spec["scaleTargetRef"]["name"] == name(component)
        assert spec["behavior"] == values["behavior"]
        got = {}
        for m in spec["metrics"]:
            assert m["type"] == metric_type
            source = m[metric_type.lower()]
            assert source["target"]["type"] == "AverageValue"
            got[source["metric"]["name"]] = float(source["target"]["averageValue"])
        assert got == targets[component]


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"autoscaling": {"provider": "prometheus-adapter"}}, "/autoscaling/provider"),
        ({"autoscaling": {"node": {"queuedPerNode": 0}}}, "/autoscaling/node/queuedPerNode"),
        ({"autoscaling": {"frontend": {"inFlight": 10}}}, "'inFlight' not allowed"),
        ({"autoscaling": {"hpa": {"metricType": "Object"}}}, "/autoscaling/hpa/metricType"),
        (
            {"autoscaling": {"prometheus": {"serverAddress": "prometheus:9090"}}},
            "/autoscaling/prometheus/serverAddress",
        ),
        ({"autoscaling": {"prometheus": {"podLabel": "pod-name"}}}, "/autoscaling/prometheus/podLabel"),
        ({"autoscaling": {"node": {"minReplicas": 0}}}, "/autoscaling/node/minReplicas"),
        ({"monitoring": {"dashboards": {"enable": True}}}, "'enable' not allowed"),
        ({"monitoring": {"rules": {"enabled": "yes"}}}, "/monitoring/rules/enabled"),
    ],
)
def test_schema_rejects(helm, chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert complaint in str(info.value)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (
            {"autoscaling": {"node": {"enabled": True}}, "node": {"autoscaling": {"enabled": True}}},
            "autoscaling.node.enabled and node.autoscaling.enabled are both true",
        ),
        (
            {"autoscaling": {"frontend": {"enabled": True, "minReplicas": 4, "maxReplicas": 3}}},
            "autoscaling.frontend.minReplicas (4) is greater than autoscaling.frontend.maxReplicas (3)",
        ),
    ],
)
def test_template_rejects(helm, chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert complaint in str(info.value)
