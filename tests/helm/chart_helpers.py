"""Shared constants and helpers of the Helm chart tests (conftest.py and the
test modules import them)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "openengine-serve"
YAMLLINT_CONFIG = Path(__file__).with_name("yamllint.yaml")
RELEASE = "oes"
NAMESPACE = "serve"

# Oldest and newest Kubernetes versions the chart supports. The oldest is the
# chart's kubeVersion floor (preStop `sleep` is on by default from 1.30); the
# newest is the newest schema set kubernetes-validate ships.
K8S_OLDEST = "1.30.0"
K8S_NEWEST = "1.37.0"
K8S_VERSIONS = (K8S_OLDEST, K8S_NEWEST)

# Value sets every rendering test runs against.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "native": {"frontend": {"grpcServer": "pygrpc-native", "workers": 4}},
    "hpa": {
        "frontend": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}},
        "node": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}},
    },
    "servicemonitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}}},
    "podmonitor": {"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}},
    "networkpolicy": {"networkPolicy": {"enabled": True}},
    # cert-manager issues one internal certificate per component (with the release's own CA).
    "internal-cert-manager": {"internalTls": {"certManager": {"enabled": True}}},
    "nodes3": {"node": {"replicas": 3}},
    # A node group per model: Gemma 3 from a PVC beside the default SmolLM2, and an autoscaled simulated group.
    "node-groups": {
        "node": {
            "groups": [
                {
                    "name": "gemma",
                    "replicas": 2,
                    "model": {
                        "path": "/models/gemma-3-270m-q4_k_m.gguf",
                        "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                    },
                    "contextSize": 8192,
                    "resources": {"limits": {"memory": "3Gi"}},
                    "podDisruptionBudget": {"enabled": False},
                },
                {"name": "sim", "engine": "simulated", "autoscaling": {"enabled": True, "maxReplicas": 4}},
            ]
        },
        "networkPolicy": {"enabled": True},
        "metrics": {"podMonitor": {"enabled": True}},
    },
    "simulated": {"node": {"engine": "simulated", "stepMs": 0.5, "maxBatch": 512}},
    # A GGUF of the user's own on a PVC, mounted read-only.
    "own-model": {
        "node": {
            "model": {
                "path": "/models/my-model.Q4_K_M.gguf",
                "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
            },
            "contextSize": 8192,
            "prefillChunk": 128,
            "threads": 4,
            "maxBatch": 64,
            "resources": {"requests": {"cpu": "4", "memory": "6Gi"}, "limits": {"memory": "8Gi"}},
        }
    },
    "loadbalancer": {
        "frontend": {
            "service": {
                "type": "LoadBalancer",
                "externalTrafficPolicy": "Local",
                "loadBalancerSourceRanges": ["10.0.0.0/8"],
                "annotations": {"example.com/lb": "internal"},
            }
        }
    },
    "nodeport": {"frontend": {"service": {"type": "NodePort", "nodePort": 30051}}},
    "monitoring": {
        "monitoring": {
            "dashboards": {"enabled": True, "folder": "Inference", "labels": {"team": "llm"}},
            "rules": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        },
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "keda": {
        "autoscaling": {
            "keda": {"authenticationRef": "prometheus-auth"},
            "node": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "queuedPerNode": 8},
            "frontend": {"enabled": True, "maxReplicas": 4},
        }
    },
    "adapter-pods": {
        "autoscaling": {
            "provider": "hpa",
            "node": {"enabled": True},
            "frontend": {"enabled": True, "inFlightPerFrontend": 150},
        }
    },
    "adapter-external": {
        "autoscaling": {"provider": "hpa", "hpa": {"metricType": "External"}, "node": {"enabled": True}}
    },
    "headless": {"frontend": {"service": {"headless": True}, "autoscaling": {"enabled": True}}},
    "secured": {
        "frontend": {
            "tls": {
                "secretName": "oe-public-tls",
                "clientCaKey": "ca.crt",
                "certManager": {
                    "issuerRef": {"name": "internal-ca", "kind": "ClusterIssuer"},
                    "dnsNames": ["openengine.example.com"],
                },
            },
            "apiKeys": {"secretName": "oe-api-keys"},
        },
        "internalTls": {
            "secrets": {"frontend": "oe-fe-internal", "coordinator": "oe-coord-internal", "node": "oe-node-internal"}
        },
        "tests": {"apiKeySecret": {"name": "oe-test-key"}},
        "networkPolicy": {"enabled": True},
    },
    "everything": {
        "commonLabels": {"team": "inference"},
        "imagePullSecrets": [{"name": "registry"}],
        "lifecycle": {"preStopSleepSeconds": 10, "terminationMarginSeconds": 7},
        "frontend": {
            "grpcServer": "pygrpc-native",
            "drainTimeoutSeconds": 120,
            "autoscaling": {
                "enabled": True,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {
                            "name": "memory",
                            "target": {"type": "Utilization", "averageUtilization": 80},
                        },
                    }
                ],
            },
            "extraEnv": [{"name": "EXTRA", "value": "1"}],
            "podAnnotations": {"example.com/a": "b"},
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "frontend"}},
                }
            ],
            "priorityClassName": "high",
        },
        "coordinator": {"nodeExpirySeconds": 15, "drainTimeoutSeconds": 5},
        "node": {
            "replicas": 3,
            "stepMs": 5,
            "maxBatch": 64,
            "maxQueue": 4096,
            "nodeSelector": {"example.com/pool": "engine"},
            "tolerations": [{"key": "engine", "operator": "Exists", "effect": "NoSchedule"}],
            "podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"},
        },
        "metrics": {"serviceMonitor": {"enabled": True, "interval": "15s"}},
        "networkPolicy": {
            "enabled": True,
            "frontendFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
            "metrics": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            },
        },
        "serviceAccount": {"annotations": {"example.com/sa": "x"}},
    },
}

_TOOLS = {
    "helm_python": "helm-python-sdk",
    "kubernetes_validate": "kubernetes-validate",
    "yamllint": "yamllint",
    "yaml": "pyyaml",
    "jsonschema": "jsonschema (a kubernetes-validate dependency)",
}


def require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # never skip: CI installs the dev extra
        pytest.fail(
            f"{_TOOLS[module]} is required by the Helm chart tests but cannot be imported "
            f"({exc}); install the dev extra: pip install -e '.[dev]'",
            pytrace=False,
        )


class Rendered:
    """One rendering of the chart: raw templates, the `helm template`-style
    stream and the parsed objects."""

    def __init__(self, files: dict[str, str], yaml: Any) -> None:
        self.files = files
        self.notes = next((v for k, v in files.items() if k.endswith("NOTES.txt")), "")
        parts = []
        for path in sorted(files):
            if not path.endswith(".yaml"):
                continue
            # `helm template` layout: split each template into its documents,
            # drop empty ones, print each under a source comment.
            for text in re.split(r"^---[ \t]*$", files[path], flags=re.M):
                if text.strip():
                    parts.append(f"---\n# Source: {path}\n{text.strip()}\n")
        self.stream = "".join(parts)
        self.docs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(self.stream) if d]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def deployment(self, component: str) -> dict[str, Any]:
        return self.get("Deployment", name(component))

    def container(self, component: str) -> dict[str, Any]:
        (container,) = self.deployment(component)["spec"]["template"]["spec"]["containers"]
        return container

    def env(self, component: str) -> dict[str, Any]:
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in self.container(component)["env"]}


def node_groups(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The node groups of merged chart values, by component label: "node" and "node-<group>" with the
    group's settings over node's (maps merge key by key, model.volume and other values are replaced)."""

    def overlay(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        merged = dict(base)
        for key, value in over.items():
            both_maps = isinstance(value, dict) and isinstance(base.get(key), dict) and key != "volume"
            merged[key] = overlay(base[key], value) if both_maps else value
        return merged

    base = {k: v for k, v in values["node"].items() if k != "groups"}
    groups = {"node": base}
    for group in values["node"]["groups"]:
        groups[f"node-{group['name']}"] = overlay(base, {k: v for k, v in group.items() if k != "name"})
    return groups


def role(component: str) -> str:
    """frontend, coordinator or node: the component a node group's pods ("node-<group>") are."""
    return "node" if component.startswith("node-") else component


def name(component: str) -> str:
    """Object name of a component for the test release."""
    return f"{RELEASE}-openengine-serve-{component}"


def chart_kube_version_floor() -> str:
    text = (CHART_DIR / "Chart.yaml").read_text()
    match = re.search(r'^kubeVersion:\s*"?>=\s*([0-9.]+)', text, re.M)
    assert match, "Chart.yaml has no kubeVersion floor"
    return match.group(1)
