"""The Helm chart helm/openengine-serve: lint, render, validate, dry-run install.

Rendering uses the Helm v4 library (helm-python-sdk); every rendered document
is validated with kubernetes-validate --strict against the oldest and newest
supported Kubernetes versions; the rendered output passes yamllint --strict.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from typing import Any

import pytest

from .chart_helpers import (
    CHART_DIR,
    K8S_OLDEST,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    VARIANTS,
    YAMLLINT_CONFIG,
    chart_kube_version_floor,
    name,
    node_groups,
    require,
    role,
)

pytestmark = pytest.mark.helm

COMPONENTS = ("frontend", "coordinator", "node")
# The node's engine and model settings (templates/node.yaml).
NODE_ENGINE_ENV = {
    "OPENENGINE_ENGINE",
    "OPENENGINE_MODEL_PATH",
    "OPENENGINE_CONTEXT_SIZE",
    "OPENENGINE_PREFILL_CHUNK",
    "OPENENGINE_THREADS",
    "OPENENGINE_MAX_BATCH",
    "OPENENGINE_MAX_QUEUE",
    "OPENENGINE_STEP_MS",
}
PORTS = {"frontend": (50051, 9091), "coordinator": (50052, 9092), "node": (50053, 9093)}
# Prometheus Operator, KEDA and cert-manager CRDs: kubernetes-validate ships no
# schema for them, so they are checked structurally in test_service_monitor /
# test_pod_monitor, test_monitoring.py and the security tests.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}
VARIANT_IDS = list(VARIANTS)


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else doc["spec"]


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    meta = doc["spec"]["template"]["metadata"] if doc["kind"] == "Deployment" else doc["metadata"]
    return meta["labels"]


def pods(rendered) -> list[dict[str, Any]]:
    return rendered.of_kind("Deployment") + rendered.of_kind("Pod")


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """LabelSelector semantics (matchLabels + In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# --------------------------------------------------------------------------
# Tooling: lint, kubernetes-validate, yamllint, dry-run install
# --------------------------------------------------------------------------


def test_supported_versions_match_chart_floor() -> None:
    assert chart_kube_version_floor() == K8S_OLDEST, (
        "the oldest Kubernetes version validated must be the chart's kubeVersion floor"
    )
    # Native gRPC probes (>=1.24) and the preStop sleep action (beta, on by default, >=1.30).
    assert tuple(map(int, K8S_OLDEST.split(".")[:2])) >= (1, 30)


@pytest.mark.parametrize("kube_version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_lint_strict(helm, variant: str, kube_version: str) -> None:
    report = helm.lint(
        str(CHART_DIR), VARIANTS[variant], strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    # "icon is recommended" is informational (severity 1) and allowed.
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("kube_version", K8S_VERSIONS)
def test_kubernetes_validate_strict(rendered_dir, render, kube_version: str) -> None:
    """The kubernetes-validate CLI, --strict, over every document of every variant."""
    require("kubernetes_validate")
    files = sorted(rendered_dir.glob("*.yaml"))
    assert len(files) == len(VARIANTS)
    proc = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", kube_version, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "ERROR" not in out and "FATAL" not in out, out
    expected_pass = 0
    expected_warn = 0
    for variant in VARIANTS:
        for doc in render(VARIANTS[variant]).docs:
            if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
                expected_warn += 1
            else:
                expected_pass += 1
    major_minor = ".".join(kube_version.split(".")[:2])
    passed = re.findall(rf"^INFO .* passed for resource .* against version {re.escape(major_minor)}$", out, re.M)
    crd_kinds = "|".join(sorted(kind for _, kind in CRD_KINDS))
    warned = re.findall(rf"^WARN .*Couldn't find schema for kind ({crd_kinds}) ", out, re.M)
    assert len(passed) == expected_pass, out
    assert len(warned) == expected_warn, out


def test_yamllint_rendered_output(rendered_dir) -> None:
    require("yamllint")
    files = sorted(map(str, rendered_dir.glob("*.yaml")))
    proc = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-f", "parsable", "-c", str(YAMLLINT_CONFIG), *files],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_yamllint_chart_sources() -> None:
    require("yamllint")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "yamllint",
            "--strict",
            "-f",
            "parsable",
            "-c",
            str(YAMLLINT_CONFIG),
            str(CHART_DIR / "values.yaml"),
            str(CHART_DIR / "Chart.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("variant", ["default", "everything"])
def test_client_dry_run_install(helm, yaml, variant: str) -> None:
    with helm.Config(namespace=NAMESPACE) as cfg:
        release = cfg.install(str(CHART_DIR), RELEASE, VARIANTS[variant], namespace=NAMESPACE, dry_run="client")
    assert release["status"] == "pending-install"
    assert release["chart_name"] == "openengine-serve"
    assert release["app_version"] == "0.1.0"
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(release["manifest"]) if d}
    for component in COMPONENTS:
        assert ("Deployment", name(component)) in kinds
        assert ("Service", name(component)) in kinds
    assert "openengine-serve generate --target" in release["notes"]
    assert f"helm test {RELEASE} -n {NAMESPACE}" in release["notes"]


# --------------------------------------------------------------------------
# Values schema
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"frontend": {"grpcServer": "grpc"}}, "/frontend/grpcServer"),
        ({"frontend": {"grpcServer": "PYGRPC-NATIVE"}}, "/frontend/grpcServer"),
        ({"frontend": {"replicas": -1}}, "/frontend/replicas"),
        ({"node": {"replicas": -3}}, "/node/replicas"),
        ({"frontend": {"workers": 0}}, "/frontend/workers"),
        ({"frontend": {"replicaCount": 2}}, "'replicaCount' not allowed"),
        ({"coordinator": {"replicas": 2}}, "'replicas' not allowed"),
        ({"node": {"image": {"repo": "x"}}}, "'repo' not allowed"),
        ({"metrics": {"serviceMonitor": {"enable": True}}}, "'enable' not allowed"),
        ({"networkPolicy": {"enable": True}}, "'enable' not allowed"),
        ({"frontnd": {}}, "'frontnd' not allowed"),
        ({"frontend": {"service": {"type": "Ingress"}}}, "/frontend/service/type"),
        ({"frontend": {"port": 70000}}, "/frontend/port"),
        ({"lifecycle": {"preStopSleepSeconds": 0}}, "/lifecycle/preStopSleepSeconds"),
        ({"frontend": {"service": {"headless": "yes"}}}, "/frontend/service/headless"),
        ({"frontend": {"maxConnectionAgeSeconds": -1}}, "/frontend/maxConnectionAgeSeconds"),
        ({"node": {"engine": "vllm"}}, "/node/engine"),
        ({"node": {"engine": "LLAMA.CPP"}}, "/node/engine"),
        # llama.cpp runs at most 256 sequences (the node refuses more); the simulated engine has no limit.
        ({"node": {"maxBatch": 300}}, "/node/maxBatch"),
        ({"node": {"engine": "llama.cpp", "maxBatch": 257}}, "/node/maxBatch"),
        ({"node": {"maxBatch": -1, "engine": "simulated"}}, "/node/maxBatch"),
        ({"node": {"contextSize": 32}}, "/node/contextSize"),
        ({"node": {"prefillChunk": 0}}, "/node/prefillChunk"),
        ({"node": {"threads": 257}}, "/node/threads"),
        ({"node": {"stepMs": 0}}, "/node/stepMs"),
        ({"node": {"model": {"file": "/models/x.gguf"}}}, "'file' not allowed"),
        (
            {"node": {"model": {"path": "/models/x.gguf", "volume": {"name": "m", "hostPath": {"path": "/m"}}}}},
            "/node/model/volume",
        ),
        ({"node": {"model": {"mountPath": "models"}}}, "/node/model/mountPath"),
        ({"node": {"modelPath": "/models/x.gguf"}}, "'modelPath' not allowed"),
        ({"node": {"groups": [{"name": "Gemma"}]}}, "/node/groups/0/name"),
        ({"node": {"groups": [{"name": "a-name-too-long-for-dns"}]}}, "/node/groups/0/name"),
        ({"node": {"groups": [{"replicas": 2}]}}, "missing property 'name'"),
        ({"node": {"groups": [{"name": "g", "port": 50054}]}}, "'port' not allowed"),
        ({"node": {"groups": [{"name": "g", "contextSize": 0}]}}, "/node/groups/0/contextSize"),
    ],
)
def test_schema_rejects(helm, chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert complaint in str(info.value)
    # An install refuses the same values before anything is sent.
    with helm.Config(namespace=NAMESPACE) as cfg, pytest.raises(helm.HelmError) as info:
        cfg.install(chart, RELEASE, values, namespace=NAMESPACE, dry_run="client")
    assert complaint in str(info.value)


def test_a_node_groups_settings_have_the_nodes_schema_but_none_required() -> None:
    """values.schema.json spells a group's settings out again (a group overrides some keys of an object, so
    node's `required` lists cannot apply): the copy must stay node's, the ports left out."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    node = schema["properties"]["node"]["properties"]

    def resolved(part: Any) -> Any:
        if isinstance(part, dict) and "$ref" in part:  # draft-07: a $ref's sibling keys are ignored
            target = schema
            for key in part["$ref"].removeprefix("#/").split("/"):
                target = target[key]
            return resolved(target)
        if isinstance(part, dict):
            return {k: resolved(v) for k, v in part.items()}
        return part

    def optional(part: Any) -> Any:
        if isinstance(part, dict):
            return {k: optional(v) for k, v in part.items() if k != "required"}
        return part

    group = schema["properties"]["node"]["properties"]["groups"]["items"]["properties"]
    assert set(group) == set(node) - {"port", "metricsPort", "groups"} | {"name"}
    for key in set(group) - {"name"}:
        assert optional(resolved(group[key])) == optional(resolved(node[key])), key


def test_schema_accepts_both_servers(chart) -> None:
    for server in ("grpcio", "pygrpc-native"):
        chart.validate_schema({"frontend": {"grpcServer": server}})


def test_schema_accepts_both_engines_and_their_batch_limits(chart) -> None:
    for values in (
        {"node": {"engine": "llama.cpp", "maxBatch": 256}},
        {"node": {"engine": "simulated", "maxBatch": 300}},
        {"node": {"engine": "simulated", "maxBatch": 0}},
    ):
        chart.validate_schema(values)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (
            {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
            "enable at most one",
        ),
        (
            {"node": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
            "node.autoscaling.minReplicas (5) is greater than node.autoscaling.maxReplicas (2)",
        ),
        (
            {"frontend": {"service": {"headless": True, "type": "LoadBalancer"}}},
            "frontend.service.headless needs frontend.service.type ClusterIP, not LoadBalancer",
        ),
        (
            {"node": {"model": {"volume": {"persistentVolumeClaim": {"claimName": "models"}}}}},
            "node.model.volume is set but node.model.path is empty",
        ),
        (
            {"node": {"model": {"path": "/data/m.gguf", "volume": {"persistentVolumeClaim": {"claimName": "m"}}}}},
            "node.model.path /data/m.gguf is not in node.model.mountPath /models",
        ),
        (
            {"node": {"model": {"path": "/models-old/m.gguf", "volume": {"hostPath": {"path": "/m"}}}}},
            "node.model.path /models-old/m.gguf is not in node.model.mountPath /models",
        ),
        (
            {"node": {"groups": [{"name": "gemma", "model": {"volume": {"hostPath": {"path": "/m"}}}}]}},
            "node.groups[gemma].model.volume is set but node.groups[gemma].model.path is empty",
        ),
        (
            {"node": {"groups": [{"name": "big", "autoscaling": {"enabled": True, "minReplicas": 9}}]}},
            "node.groups[big].autoscaling.minReplicas (9) is greater than node.groups[big].autoscaling.maxReplicas (8)",
        ),
        (
            {"node": {"groups": [{"name": "gemma"}, {"name": "gemma", "replicas": 2}]}},
            "node.groups has two groups named gemma",
        ),
        (
            {
                "node": {"groups": [{"name": "sim", "autoscaling": {"enabled": True}}]},
                "autoscaling": {"node": {"enabled": True}},
            },
            "autoscaling.node.enabled and node.groups[sim].autoscaling.enabled are both true",
        ),
        (
            {
                "node": {"groups": [{"name": "sim"}]},
                "autoscaling": {"provider": "hpa", "hpa": {"metricType": "External"}, "node": {"enabled": True}},
            },
            "cannot scale each of node.groups on its own load",
        ),
    ],
)
def test_template_rejects(helm, chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert complaint in str(info.value)


# --------------------------------------------------------------------------
# The rendered objects
# --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_grpc_server_env_only_on_frontend(render, variant: str) -> None:
    r = render(VARIANTS[variant])
    expected = VARIANTS[variant].get("frontend", {}).get("grpcServer", "grpcio")
    assert r.env("frontend")["OPENENGINE_GRPC_SERVER"] == expected
    for doc in pods(r):
        spec = pod_spec(doc)
        for container in spec["containers"] + spec.get("initContainers", []):
            names = [e["name"] for e in container.get("env", [])]
            if doc["kind"] == "Deployment" and doc["metadata"]["name"] == name("frontend"):
                assert names.count("OPENENGINE_GRPC_SERVER") == 1
            else:
                assert "OPENENGINE_GRPC_SERVER" not in names, doc["metadata"]["name"]


def test_component_environment(render) -> None:
    r = render()
    coordinator = f"{name('coordinator')}.{NAMESPACE}.svc:50052"
    fe, co, no = r.env("frontend"), r.env("coordinator"), r.env("node")
    for component, env in (("frontend", fe), ("coordinator", co), ("node", no)):
        grpc, metrics = PORTS[component]
        assert env["OPENENGINE_HOST"] == "0.0.0.0"
        assert env["OPENENGINE_PORT"] == str(grpc)
        assert env["OPENENGINE_METRICS_PORT"] == str(metrics)
        assert env["OPENENGINE_DRAIN_TIMEOUT_S"] == "30"
        assert env["OPENENGINE_LOG_LEVEL"]
        assert env["HOME"] == "/tmp"
        assert all(isinstance(v, (str, dict)) for v in env.values()), env
    assert fe["OPENENGINE_COORDINATOR_ADDRESS"] == coordinator
    assert no["OPENENGINE_COORDINATOR_ADDRESS"] == coordinator
    assert "OPENENGINE_COORDINATOR_ADDRESS" not in co
    assert fe["OPENENGINE_FRONTEND_WORKERS"] == "2"
    assert "OPENENGINE_MODEL" not in fe  # the frontend takes the nodes' model's name
    assert fe["OPENENGINE_MAX_CONNECTION_AGE_S"] == "0"
    assert {"OPENENGINE_FRONTEND_WORKERS", "OPENENGINE_MODEL"}.isdisjoint(co.keys() | no.keys())
    # The node advertises its pod IP; POD_IP must be defined before it is referenced.
    names = [e["name"] for e in r.container("node")["env"]]
    assert names.index("POD_IP") < names.index("OPENENGINE_ADVERTISE_ADDRESS")
    assert no["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert no["OPENENGINE_ADVERTISE_ADDRESS"] == "$(POD_IP):50053"
    assert {k: v for k, v in no.items() if k in NODE_ENGINE_ENV} == {
        "OPENENGINE_ENGINE": "llama.cpp",
        "OPENENGINE_CONTEXT_SIZE": "16384",
        "OPENENGINE_PREFILL_CHUNK": "256",
        "OPENENGINE_THREADS": "0",
        "OPENENGINE_MAX_BATCH": "0",  # the engine's default (32 for llama.cpp)
        "OPENENGINE_MAX_QUEUE": "1024",
        "OPENENGINE_STEP_MS": "2",
    }  # no OPENENGINE_MODEL_PATH: the embedded model
    assert NODE_ENGINE_ENV.isdisjoint(fe.keys() | co.keys())
    assert "OPENENGINE_ADVERTISE_ADDRESS" not in fe
    assert "OPENENGINE_NODE_EXPIRY_S" not in co  # null keeps the component's default
    # The coordinator Service really serves that address.
    svc = r.get("Service", name("coordinator"))
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["grpc"] == 50052


def test_everything_environment(render) -> None:
    r = render(VARIANTS["everything"])
    assert r.env("coordinator")["OPENENGINE_NODE_EXPIRY_S"] == "15"
    no = r.env("node")
    assert (no["OPENENGINE_STEP_MS"], no["OPENENGINE_MAX_BATCH"], no["OPENENGINE_MAX_QUEUE"]) == ("5", "64", "4096")
    assert no["OPENENGINE_ENGINE"] == "llama.cpp"
    assert r.env("frontend")["EXTRA"] == "1"
    assert r.env("frontend")["OPENENGINE_GRPC_SERVER"] == "pygrpc-native"
    assert r.env("frontend")["OPENENGINE_DRAIN_TIMEOUT_S"] == "120"


# --------------------------------------------------------------------------
# The node's engine and model
# --------------------------------------------------------------------------


def _volumes(component: str, r) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in r.deployment(component)["spec"]["template"]["spec"]["volumes"]}


def _quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity))
    assert match, quantity
    return int(float(match.group(1)) * units.get(match.group(2), 1))


def test_default_node_serves_the_embedded_model_without_a_volume(render) -> None:
    r = render()
    no = r.env("node")
    assert no["OPENENGINE_ENGINE"] == "llama.cpp"
    assert "OPENENGINE_MODEL_PATH" not in no
    for component in COMPONENTS:
        assert set(_volumes(component, r)) == {"tmp"}, component
        assert [m["name"] for m in r.container(component)["volumeMounts"]] == ["tmp"], component


# SmolLM2-135M-Instruct, the node image's default model: the GGUF file, the KV cache per cell
# (30 layers x K and V x 192 x 2 bytes) and the node's processes (Python, MPI).
DEFAULT_MODEL_BYTES = 93 * 10**6
KV_BYTES_PER_CELL = 30 * 2 * 192 * 2
PROCESS_BYTES = 150 * 10**6


def test_default_node_memory_fits_the_default_model(render, chart) -> None:
    """The memory limit holds the model, the KV cache at the default context size and the processes,
    with room to spare; the request holds them too."""
    values = chart.merge_values({})
    resources = render().container("node")["resources"]
    need = DEFAULT_MODEL_BYTES + values["node"]["contextSize"] * KV_BYTES_PER_CELL + PROCESS_BYTES
    assert _quantity_bytes(resources["requests"]["memory"]) >= need
    assert _quantity_bytes(resources["limits"]["memory"]) >= 2 * need
    assert "cpu" not in resources["limits"]  # CPU throttling hurts token latency


def test_own_model_from_a_volume(render) -> None:
    r = render(VARIANTS["own-model"])
    no = r.env("node")
    assert no["OPENENGINE_MODEL_PATH"] == "/models/my-model.Q4_K_M.gguf"
    assert (
        no["OPENENGINE_CONTEXT_SIZE"],
        no["OPENENGINE_PREFILL_CHUNK"],
        no["OPENENGINE_THREADS"],
        no["OPENENGINE_MAX_BATCH"],
    ) == ("8192", "128", "4", "64")
    assert _volumes("node", r)["model"] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    }
    mounts = [m for m in r.container("node")["volumeMounts"] if m["name"] == "model"]
    assert mounts == [{"name": "model", "mountPath": "/models", "readOnly": True}]
    # Only the node mounts the model: frontends get the tokenizer from the nodes.
    for component in ("frontend", "coordinator"):
        assert "model" not in _volumes(component, r)
        assert "OPENENGINE_MODEL_PATH" not in r.env(component)
    assert r.container("node")["resources"]["limits"]["memory"] == "8Gi"
    assert "model SmolLM2" not in r.notes and "model /models/my-model.Q4_K_M.gguf" in r.notes


def test_own_model_at_another_mount_path_or_in_the_image(render) -> None:
    r = render(
        {
            "node": {
                "model": {
                    "path": "/srv/gguf/llama.gguf",
                    "mountPath": "/srv/gguf",
                    "volume": {"hostPath": {"path": "/var/models", "type": "Directory"}},
                }
            }
        }
    )
    assert r.env("node")["OPENENGINE_MODEL_PATH"] == "/srv/gguf/llama.gguf"
    assert _volumes("node", r)["model"]["hostPath"] == {"path": "/var/models", "type": "Directory"}
    assert {"name": "model", "mountPath": "/srv/gguf", "readOnly": True} in r.container("node")["volumeMounts"]
    # A path without a volume: a file the user's node image carries.
    baked = render({"node": {"model": {"path": "/opt/models/m.gguf"}}})
    assert baked.env("node")["OPENENGINE_MODEL_PATH"] == "/opt/models/m.gguf"
    assert set(_volumes("node", baked)) == {"tmp"}


def test_simulated_engine(render) -> None:
    r = render(VARIANTS["simulated"])
    no = r.env("node")
    engine = (no["OPENENGINE_ENGINE"], no["OPENENGINE_STEP_MS"], no["OPENENGINE_MAX_BATCH"])
    assert engine == ("simulated", "0.5", "512")  # above llama.cpp's 256: the schema allows it here
    assert "OPENENGINE_MODEL_PATH" not in no
    assert "engine simulated" in r.notes and "--chat" not in r.notes


def test_frontend_model_name_is_optional(render) -> None:
    assert "OPENENGINE_MODEL" not in render().env("frontend")
    named = render({"frontend": {"model": "smollm2"}})
    assert named.env("frontend")["OPENENGINE_MODEL"] == "smollm2"
    assert "OPENENGINE_MODEL" not in named.env("node")


LIVENESS_P99_BOUND_S = 1.0


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_grpc_probes(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    values = chart.merge_values(VARIANTS[variant])
    for component in COMPONENTS:
        container = r.container(component)
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert grpc_port == PORTS[component][0]
        services = {"startupProbe": "liveness", "livenessProbe": "liveness", "readinessProbe": "readiness"}
        for probe, service in services.items():
            spec = container[probe]
            assert "initialDelaySeconds" not in spec, (component, probe)
            tls_port = variant == "secured" or (variant == "internal-cert-manager" and component != "frontend")
            if tls_port:  # exec probes, see test_probes_on_a_tls_port_use_the_cli_over_tls
                command = spec["exec"]["command"]
                assert command[3:6] == [f"127.0.0.1:{grpc_port}", "--service", service], (component, probe)
                continue
            assert spec["grpc"] == {"port": grpc_port, "service": service}, (component, probe)
            assert not {"httpGet", "tcpSocket", "exec"} & spec.keys()
        # The frontend's liveness p99 under twice the saturating load stays < 1 s (tests/integration/
        # test_overload.py, docs/robustness.md): the probe's timeout leaves 3x that before it counts a failure.
        assert container["livenessProbe"]["timeoutSeconds"] >= 3 * LIVENESS_P99_BOUND_S
        assert container["readinessProbe"]["timeoutSeconds"] >= 3 * LIVENESS_P99_BOUND_S
        startup = container["startupProbe"]
        budget = values[component]["startupTimeoutSeconds"]
        assert startup["failureThreshold"] == math.ceil(budget / startup["periodSeconds"])
        assert startup["failureThreshold"] * startup["periodSeconds"] >= budget
    # The node answers liveness once started (before its MPI worker loads the model, which readiness
    # covers); its start-up budget leaves room for a slow start (e.g. a model file on network storage).
    node_startup = r.container("node")["startupProbe"]
    assert node_startup["failureThreshold"] * node_startup["periodSeconds"] >= 30


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_rollout_and_grace_period(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    values = chart.merge_values(VARIANTS[variant])
    pre_stop = values["lifecycle"]["preStopSleepSeconds"]
    margin = values["lifecycle"]["terminationMarginSeconds"]
    for component in COMPONENTS:
        deployment = r.deployment(component)
        strategy = deployment["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate"
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0
        spec = deployment["spec"]["template"]["spec"]
        drain = values[component]["drainTimeoutSeconds"]
        assert spec["terminationGracePeriodSeconds"] == pre_stop + drain + margin
        assert r.env(component)["OPENENGINE_DRAIN_TIMEOUT_S"] == str(drain)
        (container,) = spec["containers"]
        assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": pre_stop}}
        assert spec["terminationGracePeriodSeconds"] > pre_stop + drain
    assert r.deployment("coordinator")["spec"]["replicas"] == 1


def test_grace_period_arithmetic_custom(render) -> None:
    r = render(VARIANTS["everything"])
    grace = {c: r.deployment(c)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for c in COMPONENTS}
    assert grace == {"frontend": 10 + 120 + 7, "coordinator": 10 + 5 + 7, "node": 10 + 30 + 7}


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_security_context(render, variant: str) -> None:
    r = render(VARIANTS[variant])
    groups = VARIANTS[variant].get("node", {}).get("groups", [])
    assert len(pods(r)) == 4 + len(groups)  # a Deployment per component and node group, and the test Pod
    for doc in pods(r):
        spec = pod_spec(doc)
        what = doc["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, what
        assert spec["securityContext"]["runAsUser"] != 0, what
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, what
        assert spec["automountServiceAccountToken"] is False, what
        assert spec["enableServiceLinks"] is False, what
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["tmp"], what
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, what
            assert sc["allowPrivilegeEscalation"] is False, what
            assert sc["capabilities"] == {"drop": ["ALL"]}, what
            assert sc["runAsNonRoot"] is True, what
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, what
            assert "privileged" not in sc, what
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"], what
            assert {"name": "HOME", "value": "/tmp"} in container["env"], what
            assert container["resources"]["requests"], what


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_images(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    for component in COMPONENTS:
        assert r.container(component)["image"] == f"openengine-serve-{component}:0.1.0"
        assert r.container(component)["imagePullPolicy"] == "IfNotPresent"
    custom = render({"node": {"image": {"repository": "reg.example/oes-node", "tag": "abc", "pullPolicy": "Always"}}})
    assert custom.container("node")["image"] == "reg.example/oes-node:abc"
    assert custom.container("node")["imagePullPolicy"] == "Always"
    assert custom.container("frontend")["image"] == "openengine-serve-frontend:0.1.0"


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_services(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    values = chart.merge_values(VARIANTS[variant])
    public = r.get("Service", name("frontend"))
    assert public["spec"]["type"] == values["frontend"]["service"]["type"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in public["spec"]["ports"]] == [
        ("grpc", 50051, "grpc"),
        ("http", 8000, "http"),  # the OpenAI-compatible API
    ]
    assert r.get("Service", name("coordinator"))["spec"]["type"] == "ClusterIP"
    assert r.get("Service", name("node"))["spec"]["clusterIP"] == "None"
    assert r.get("Service", name("frontend-metrics"))["spec"]["clusterIP"] == "None"
    metrics_services = {name("frontend-metrics"): "frontend", name("coordinator"): "coordinator"}
    metrics_services |= {name(group): group for group in node_groups(values)}
    for svc in r.of_kind("Service"):
        component = svc["spec"]["selector"]["app.kubernetes.io/component"]
        deployment = r.deployment(component)
        assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(deployment)), svc["metadata"]["name"]
        container_ports = {p["name"]: p["containerPort"] for p in r.container(component)["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in container_ports, (svc["metadata"]["name"], port)
        if svc["metadata"]["name"] in metrics_services:
            metrics = [p for p in svc["spec"]["ports"] if p["name"] == "metrics"]
            assert metrics and metrics[0]["port"] == PORTS[role(component)][1]
        else:
            assert svc["metadata"]["name"] == name("frontend")  # the only Service without metrics
    assert len(r.of_kind("Service")) == 3 + len(node_groups(values))
    for component in COMPONENTS:
        expected = {"grpc", "http", "metrics"} if component == "frontend" else {"grpc", "metrics"}
        assert {p["name"] for p in r.container(component)["ports"]} == expected
    assert {"name": "OPENENGINE_HTTP_PORT", "value": "8000"} in r.container("frontend")["env"]


def test_the_http_api_can_be_turned_off(render) -> None:
    r = render({"frontend": {"httpPort": 0}})
    assert [p["name"] for p in r.get("Service", name("frontend"))["spec"]["ports"]] == ["grpc"]
    assert {p["name"] for p in r.container("frontend")["ports"]} == {"grpc", "metrics"}
    assert {"name": "OPENENGINE_HTTP_PORT", "value": "0"} in r.container("frontend")["env"]
    grpc_rule = r.get("NetworkPolicy", name("frontend"))["spec"]["ingress"][0]
    assert [p["port"] for p in grpc_rule["ports"]] == ["grpc"]


def test_public_service_types(render) -> None:
    lb = render(VARIANTS["loadbalancer"]).get("Service", name("frontend"))["spec"]
    assert lb["type"] == "LoadBalancer"
    assert lb["externalTrafficPolicy"] == "Local"
    assert lb["loadBalancerSourceRanges"] == ["10.0.0.0/8"]
    np = render(VARIANTS["nodeport"]).get("Service", name("frontend"))["spec"]
    assert np["type"] == "NodePort" and np["ports"][0]["nodePort"] == 30051
    assert "nodePort" not in render().get("Service", name("frontend"))["spec"]["ports"][0]
    assert "clusterIP" not in render().get("Service", name("frontend"))["spec"]


def test_headless_public_service(render) -> None:
    """One address per ready frontend pod behind the name; `helm test` calls through it with round_robin."""
    r = render(VARIANTS["headless"])
    public = r.get("Service", name("frontend"))["spec"]
    assert public["type"] == "ClusterIP" and public["clusterIP"] == "None"
    assert not public.get("publishNotReadyAddresses")  # only ready frontends are resolved
    (pod,) = r.of_kind("Pod")
    target = f"dns:///{name('frontend')}:50051"
    assert pod["spec"]["initContainers"][0]["args"][:3] == ["health", "--target", target]
    assert pod["spec"]["containers"][0]["args"][:3] == ["generate", "--target", target]
    assert f"dns:///{name('frontend')}.{NAMESPACE}.svc:50051" in r.notes
    assert "dns:///" not in render().notes


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_replicas_hpa_and_pdb(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    values = chart.merge_values(VARIANTS[variant])
    hpas = {h["metadata"]["name"]: h for h in r.of_kind("HorizontalPodAutoscaler")}
    settings = {"frontend": values["frontend"]} | node_groups(values)
    for component in settings:
        spec = r.deployment(component)["spec"]
        autoscaling = settings[component]["autoscaling"]
        if autoscaling["enabled"]:
            assert "replicas" not in spec, "the HPA owns the replica count"
            hpa = hpas[name(component)]
            assert hpa["apiVersion"] == "autoscaling/v2"
            target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name(component)}
            assert hpa["spec"]["scaleTargetRef"] == target
            assert hpa["spec"]["minReplicas"] == autoscaling["minReplicas"]
            assert hpa["spec"]["maxReplicas"] == autoscaling["maxReplicas"]
            if autoscaling["metrics"]:
                assert hpa["spec"]["metrics"] == autoscaling["metrics"]
            else:
                assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
        elif values["autoscaling"][role(component)]["enabled"]:  # on load: test_monitoring.py checks the scaler
            assert "replicas" not in spec, "the load autoscaler owns the replica count"
        else:
            assert spec["replicas"] == settings[component]["replicas"]
            assert name(component) not in hpas
    assert set(hpas) <= {name(c) for c in settings}  # none for the single coordinator
    pdbs = {p["metadata"]["name"]: p for p in r.of_kind("PodDisruptionBudget")}
    with_pdb = [c for c in settings if settings[c]["podDisruptionBudget"]["enabled"]]
    assert set(pdbs) == {name(c) for c in with_pdb}  # none for the single coordinator
    deployments = r.of_kind("Deployment")
    for component in with_pdb:
        pdb = pdbs[name(component)]
        assert pdb["spec"]["maxUnavailable"] == settings[component]["podDisruptionBudget"]["maxUnavailable"]
        # its own pods, no other Deployment's (a node group's pods are not the first group's)
        covered = [d["metadata"]["name"] for d in deployments if selects(pdb["spec"]["selector"], pod_labels(d))]
        assert covered == [name(component)]


def test_node_groups(render, chart) -> None:
    """A Deployment, headless Service, HPA and PDB per node group, each selecting its own pods only; the
    group's settings over the node's; the network policies and the PodMonitor cover every group."""
    r = render(VARIANTS["node-groups"])
    groups = node_groups(chart.merge_values(VARIANTS["node-groups"]))
    assert list(groups) == ["node", "node-gemma", "node-sim"]
    deployments = r.of_kind("Deployment")
    for doc in deployments + r.of_kind("HorizontalPodAutoscaler") + r.of_kind("PodDisruptionBudget"):
        selector = doc["spec"]["selector"] if doc["kind"] != "HorizontalPodAutoscaler" else None
        if selector is None:  # an HPA counts the pods of its target's selector
            selector = r.get("Deployment", doc["spec"]["scaleTargetRef"]["name"])["spec"]["selector"]
        covered = [d["metadata"]["name"] for d in deployments if selects(selector, pod_labels(d))]
        assert covered == [doc["metadata"]["name"]], (doc["kind"], doc["metadata"]["name"])
    for component in groups:
        labels = pod_labels(r.deployment(component))
        assert labels["app.kubernetes.io/component"] == component
        service = r.get("Service", name(component))
        assert service["spec"]["clusterIP"] == "None"
        assert [d["metadata"]["name"] for d in deployments if selects(service["spec"], labels)]
    gemma, sim, first = r.env("node-gemma"), r.env("node-sim"), r.env("node")
    assert gemma["OPENENGINE_MODEL_PATH"] == "/models/gemma-3-270m-q4_k_m.gguf"
    assert gemma["OPENENGINE_CONTEXT_SIZE"] == "8192" and first["OPENENGINE_CONTEXT_SIZE"] == "16384"
    assert "OPENENGINE_MODEL_PATH" not in first and "OPENENGINE_MODEL_PATH" not in sim
    assert (sim["OPENENGINE_ENGINE"], first["OPENENGINE_ENGINE"]) == ("simulated", "llama.cpp")
    assert gemma["OPENENGINE_COORDINATOR_ADDRESS"] == first["OPENENGINE_COORDINATOR_ADDRESS"]
    assert r.deployment("node-gemma")["spec"]["replicas"] == 2
    assert "replicas" not in r.deployment("node-sim")["spec"]  # its HPA owns it
    assert r.container("node-gemma")["resources"] == {  # the limit is the group's, the requests node's
        "requests": {"cpu": "1", "memory": "1536Mi"},
        "limits": {"memory": "3Gi"},
    }
    assert _volumes("node-gemma", r)["model"] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    }
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in r.container("node-gemma")["volumeMounts"]
    assert "model" not in _volumes("node", r) and "model" not in _volumes("node-sim", r)
    # the node policy holds every group's pods; frontends and the coordinator reach each group and back
    policies = {p["metadata"]["name"]: p["spec"] for p in r.of_kind("NetworkPolicy")}
    assert set(policies) == {name(c) for c in COMPONENTS}
    node_policy = policies[name("node")]
    assert [d["metadata"]["name"] for d in deployments if selects(node_policy["podSelector"], pod_labels(d))] == [
        name(c) for c in groups
    ]
    callers = {c: pod_labels(r.deployment(c)) for c in ("frontend", "coordinator")}
    for component in groups:
        labels = pod_labels(r.deployment(component))
        for caller, caller_labels in callers.items():
            assert _admits(node_policy["ingress"], "from", caller_labels, ("grpc",)), (caller, component)
            assert _admits(policies[name(caller)]["egress"], "to", labels, (PORTS["node"][0],)), (caller, component)
        assert _admits(policies[name("coordinator")]["ingress"], "from", labels, ("grpc",)), component
    assert "node-gemma  2 replica(s), engine llama.cpp, model /models/gemma-3-270m-q4_k_m.gguf" in r.notes
    assert "node-sim    1-4 (HPA) replica(s), engine simulated" in r.notes
    (monitor,) = r.of_kind("PodMonitor")
    monitored = [d["metadata"]["name"] for d in deployments if selects(monitor["spec"]["selector"], pod_labels(d))]
    assert sorted(monitored) == sorted(name(c) for c in ("frontend", "coordinator", *groups))


def test_a_node_groups_model_volume_replaces_the_nodes(render) -> None:
    first = {"path": "/models/a.gguf", "volume": {"hostPath": {"path": "/srv/models"}}}
    group = {"name": "b", "model": {"path": "/models/b.gguf", "volume": {"persistentVolumeClaim": {"claimName": "b"}}}}
    r = render({"node": {"model": first, "groups": [group]}})
    assert _volumes("node", r)["model"] == {"name": "model", "hostPath": {"path": "/srv/models"}}
    assert _volumes("node-b", r)["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": "b"}}
    assert r.env("node-b")["OPENENGINE_MODEL_PATH"] == "/models/b.gguf"


def test_three_nodes(render) -> None:
    assert render(VARIANTS["nodes3"]).deployment("node")["spec"]["replicas"] == 3
    assert render(VARIANTS["nodes3"]).deployment("frontend")["spec"]["replicas"] == 2


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_prometheus_annotations_only_without_monitors(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    m = chart.merge_values(VARIANTS[variant])["metrics"]
    monitors = m["serviceMonitor"]["enabled"] or m["podMonitor"]["enabled"]
    for component in COMPONENTS:
        annotations = r.deployment(component)["spec"]["template"]["metadata"].get("annotations", {})
        if monitors:
            assert not any(k.startswith("prometheus.io/") for k in annotations), component
        else:
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/port"] == str(PORTS[component][1])
            assert annotations["prometheus.io/path"] == "/metrics"
    assert len(r.of_kind("ServiceMonitor")) == int(m["serviceMonitor"]["enabled"])
    assert len(r.of_kind("PodMonitor")) == int(m["podMonitor"]["enabled"])


@pytest.mark.parametrize("variant", ["servicemonitor", "everything"])
def test_service_monitor(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    sm_values = chart.merge_values(VARIANTS[variant])["metrics"]["serviceMonitor"]
    (sm,) = r.of_kind("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    for k, v in sm_values["labels"].items():
        assert sm["metadata"]["labels"][k] == v
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint == {
        "port": "metrics",
        "path": "/metrics",
        "interval": sm_values["interval"],
        "scrapeTimeout": sm_values["scrapeTimeout"],
    }
    selected = [s for s in r.of_kind("Service") if selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    assert sorted(s["metadata"]["name"] for s in selected) == sorted(
        [name("frontend-metrics"), name("coordinator"), name("node")]
    )
    for svc in selected:
        assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}


def test_pod_monitor(render) -> None:
    r = render(VARIANTS["podmonitor"])
    (pm,) = r.of_kind("PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "kps"
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    selected = [d["metadata"]["name"] for d in pods(r) if selects(pm["spec"]["selector"], pod_labels(d))]
    assert sorted(selected) == sorted(name(c) for c in COMPONENTS)  # not the test pod


def _admits(rules: list[dict[str, Any]], side: str, peer_labels: dict[str, str], ports: tuple) -> bool:
    """Whether NetworkPolicy rules (ingress: side "from", egress: "to") admit a pod of this release with
    `peer_labels` on a port known by any name or number in `ports`."""
    for rule in rules:
        if "ports" in rule and not any(p["port"] in ports for p in rule["ports"]):
            continue
        peers = rule.get(side)
        if peers is None:
            return True
        if any(set(peer) == {"podSelector"} and selects(peer["podSelector"], peer_labels) for peer in peers):
            return True
    return False


def reachable_pairs(r) -> set[tuple[str, str]]:
    """(caller, callee) component pairs of this release the rendered policies let through on the callee's
    gRPC port: the callee's ingress and the caller's egress must both admit it (no policy: all admitted)."""
    policies = r.of_kind("NetworkPolicy")

    def policy_of(labels: dict[str, str]) -> dict[str, Any] | None:
        chosen = [p["spec"] for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert len(chosen) <= 1, labels
        return chosen[0] if chosen else None

    pairs = set()
    for caller in pods(r):
        caller_labels, caller_policy = pod_labels(caller), policy_of(pod_labels(caller))
        for callee in COMPONENTS:
            callee_labels = pod_labels(r.deployment(callee))
            ports = ("grpc", PORTS[callee][0])
            callee_policy = policy_of(callee_labels)
            ingress = callee_policy is None or _admits(callee_policy.get("ingress", []), "from", caller_labels, ports)
            egress = caller_policy is None or _admits(caller_policy.get("egress", []), "to", callee_labels, ports)
            if ingress and egress:
                pairs.add((caller_labels["app.kubernetes.io/component"], callee))
    return pairs


@pytest.mark.parametrize("variant", ["default", "everything"])
def test_network_policy_admits_only_the_internal_plane_pairs(render, chart, variant: str) -> None:
    r = render(VARIANTS[variant])
    np_values = chart.merge_values(VARIANTS[variant])["networkPolicy"]
    policies = {p["metadata"]["name"]: p["spec"] for p in r.of_kind("NetworkPolicy")}
    assert set(policies) == {name(c) for c in COMPONENTS}
    assert reachable_pairs(r) == {
        ("frontend", "coordinator"),
        ("frontend", "node"),
        ("node", "coordinator"),
        ("coordinator", "node"),  # Abort: Node.Cancel
        ("test", "frontend"),  # `helm test`
    }
    # each side on its own too (either alone would hide a hole in the other)
    release = {pod_labels(d)["app.kubernetes.io/component"]: pod_labels(d) for d in pods(r)}
    callers = {"coordinator": {"frontend", "node"}, "node": {"frontend", "coordinator"}}
    callees = {"frontend": {"coordinator", "node"}, "coordinator": {"node"}, "node": {"coordinator"}}
    for component in COMPONENTS:
        spec = policies[name(component)]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        reached = {c for c in COMPONENTS if _admits(spec["egress"], "to", release[c], ("grpc", PORTS[c][0]))}
        assert reached == callees[component], component
        if component != "frontend":
            admitted = {c for c, labels in release.items() if _admits(spec["ingress"], "from", labels, ("grpc",))}
            assert admitted == callers[component], component
        targets = [d["metadata"]["name"] for d in pods(r) if selects(spec["podSelector"], pod_labels(d))]
        assert targets == [name(component)]
        grpc_rule, metrics_rule = spec["ingress"]
        public_ports = ["grpc", "http"] if component == "frontend" else ["grpc"]  # the frontend's two APIs
        assert [p["port"] for p in grpc_rule["ports"]] == public_ports
        assert [p["port"] for p in metrics_rule["ports"]] == ["metrics"]
        (peer,) = metrics_rule["from"]
        assert peer["namespaceSelector"] == np_values["metrics"]["namespaceSelector"]
        assert peer.get("podSelector", {}) == np_values["metrics"]["podSelector"]
        if component == "frontend":
            if np_values["frontendFrom"]:
                assert grpc_rule["from"][: len(np_values["frontendFrom"])] == np_values["frontendFrom"]
            else:
                assert "from" not in grpc_rule, "the frontend's gRPC port is public"
        else:
            assert all(set(peer) == {"podSelector"} for peer in grpc_rule["from"]), "only pods of this release"
        dns = [rule for rule in spec["egress"] if rule["to"] == np_values["dnsTo"]]
        assert [(p["port"], p["protocol"]) for (rule,) in [dns] for p in rule["ports"]] == [(53, "UDP"), (53, "TCP")]
        assert all("to" in rule for rule in spec["egress"]), "no egress rule open to everyone"


def test_network_policy_can_be_turned_off_and_extended(render) -> None:
    assert not render({"networkPolicy": {"enabled": False}}).of_kind("NetworkPolicy")
    collector = {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": [{"port": 4317, "protocol": "TCP"}]}
    r = render({"networkPolicy": {"extraEgress": [collector]}})
    for policy in r.of_kind("NetworkPolicy"):
        assert policy["spec"]["egress"][-1] == collector


def test_helm_test_hook(render) -> None:
    r = render()
    (pod,) = r.of_kind("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    target = f"{name('frontend')}:50051"
    (health,) = pod["spec"]["initContainers"]
    (generate,) = pod["spec"]["containers"]
    for container in (health, generate):
        assert container["image"] == "openengine-serve-frontend:0.1.0"
        assert container["command"] == ["openengine-serve"]
    assert health["args"] == ["health", "--target", target, "--service", "readiness"]
    assert generate["args"][:3] == ["generate", "--target", target]
    assert generate["args"][generate["args"].index("--max-tokens") + 1] == "8"
    assert "--prompt" in generate["args"]
    assert not render({"tests": {"enabled": False}}).of_kind("Pod")


@pytest.mark.parametrize("variant", ["default", "loadbalancer", "nodeport"])
def test_notes(render, variant: str) -> None:
    notes = render(VARIANTS[variant]).notes
    assert "openengine-serve generate --target" in notes
    assert "openengine-serve health --target" in notes
    assert f"helm test {RELEASE}" in notes
    assert "--model" not in notes  # the CLI names the served model itself
    # A first call the default instruct model answers, through its chat template.
    first_call = '--chat --prompt "Write a haiku about the sea" --max-tokens 48 --temperature 0'
    assert notes.count(first_call) == 2, notes  # from your machine and from inside the cluster
    assert "engine llama.cpp, model SmolLM2-135M-Instruct (embedded)" in notes
    if variant == "default":
        assert f"port-forward service/{name('frontend')} 50051:50051" in notes
        assert f"{name('frontend')}.{NAMESPACE}.svc:50051" in notes
    elif variant == "loadbalancer":
        assert "status.loadBalancer.ingress" in notes
    else:
        assert "nodePort" in notes


def test_labels_and_names(render) -> None:
    r = render(VARIANTS["everything"])
    for doc in r.docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/name"] == "openengine-serve"
        assert labels["team"] == "inference"
        assert doc["metadata"]["namespace"] == NAMESPACE
    # A long release name still yields DNS-label object names (<= 63 characters).
    long_release = "a-very-long-release-name-for-openengine-serve-xx"
    long = render({}, release=long_release)
    for doc in long.docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])


# --------------------------------------------------------------------------
# TLS, API keys, internal mutual TLS
# --------------------------------------------------------------------------


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def _secret_volumes(spec: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}


def test_keys_behind_a_tls_terminating_ingress_are_accepted_in_plaintext_when_said(render) -> None:
    values = {
        "frontend": {"apiKeys": {"secretName": "k", "allowPlaintext": True}},
        "tests": {"apiKeySecret": {"name": "t"}},
    }
    fe_env = render(values).env("frontend")
    assert fe_env["OPENENGINE_ALLOW_PLAINTEXT_KEYS"] == "1"
    assert fe_env["OPENENGINE_API_KEYS_FILE"] == "/etc/openengine/api-keys/api-keys"


def test_secured_release_mounts_secrets_and_sets_the_variables(render) -> None:
    r = render(VARIANTS["secured"])
    fe_env = r.env("frontend")
    assert fe_env["OPENENGINE_TLS_CERT_FILE"] == "/etc/openengine/tls/tls.crt"
    assert fe_env["OPENENGINE_TLS_KEY_FILE"] == "/etc/openengine/tls/tls.key"
    assert fe_env["OPENENGINE_TLS_CLIENT_CA_FILE"] == "/etc/openengine/tls/ca.crt"
    assert fe_env["OPENENGINE_API_KEYS_FILE"] == "/etc/openengine/api-keys/api-keys"
    assert "OPENENGINE_ALLOW_PLAINTEXT_KEYS" not in fe_env  # the frontend has TLS of its own
    assert _secret_volumes(r.deployment("frontend")["spec"]["template"]["spec"]) == {
        "tls": "oe-public-tls",
        "api-keys": "oe-api-keys",
        "internal-tls": "oe-fe-internal",
    }
    for component, secret in (("coordinator", "oe-coord-internal"), ("node", "oe-node-internal")):
        assert _secret_volumes(r.deployment(component)["spec"]["template"]["spec"]) == {"internal-tls": secret}
    for component in COMPONENTS:
        env = r.env(component)
        assert env["OPENENGINE_INTERNAL_TLS_CA_FILE"] == "/etc/openengine/internal-tls/ca.crt"
        assert env["OPENENGINE_INTERNAL_TLS_SERVER_NAME"] == "openengine-internal"
        assert _mounts(r.container(component))["/etc/openengine/internal-tls"] == "internal-tls"
        assert all(m.get("readOnly") for m in r.container(component)["volumeMounts"] if m["name"] != "tmp")
    for component in ("coordinator", "node"):
        assert "OPENENGINE_TLS_CERT_FILE" not in r.env(component)
        assert "OPENENGINE_API_KEYS_FILE" not in r.env(component)
    default = render()
    for component in COMPONENTS:
        assert not any(
            k.startswith(("OPENENGINE_TLS", "OPENENGINE_INTERNAL_TLS", "OPENENGINE_API_KEYS"))
            for k in default.env(component)
        )


def test_probes_on_a_tls_port_use_the_cli_over_tls(render) -> None:
    r = render(VARIANTS["secured"])
    frontend = r.container("frontend")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = frontend[probe]["exec"]["command"]
        assert command[:4] == ["openengine-serve", "health", "--target", "127.0.0.1:50051"]
        assert command[command.index("--tls-ca-file") + 1] == "/etc/openengine/tls/ca.crt"
        assert command[command.index("--tls-server-name") + 1] == name("frontend")
        assert "--tls-cert-file" in command  # mutual TLS: the probe presents a certificate
        node = r.container("node")[probe]["exec"]["command"]
        assert node[node.index("--tls-server-name") + 1] == "openengine-internal"
        assert "grpc" not in frontend[probe]
    # only internal TLS: the frontend's public port stays plaintext with native probes
    internal_only = render(VARIANTS["internal-cert-manager"])
    assert internal_only.container("frontend")["readinessProbe"]["grpc"]["service"] == "readiness"
    assert "exec" in internal_only.container("coordinator")["readinessProbe"]


def test_cert_manager_certificate(render) -> None:
    r = render(VARIANTS["secured"])
    (cert,) = r.of_kind("Certificate")
    assert cert["spec"]["secretName"] == "oe-public-tls"
    assert cert["spec"]["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer"}
    assert name("frontend") in cert["spec"]["dnsNames"]
    assert f"{name('frontend')}.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    assert "openengine.example.com" in cert["spec"]["dnsNames"]
    assert not render({"frontend": {"tls": {"secretName": "s"}}}).of_kind("Certificate")


def test_cert_manager_issues_one_internal_certificate_per_component(render) -> None:
    r = render(VARIANTS["internal-cert-manager"])
    certificates = {c["metadata"]["name"]: c["spec"] for c in r.of_kind("Certificate")}
    ca = f"{RELEASE}-openengine-serve-internal-ca"
    assert certificates[ca]["isCA"] is True
    assert {i["metadata"]["name"]: i["spec"] for i in r.of_kind("Issuer")} == {
        f"{ca}-root": {"selfSigned": {}},
        ca: {"ca": {"secretName": ca}},
    }
    for component in COMPONENTS:
        cert = certificates[f"{name(component)}-internal"]
        assert cert["commonName"] == f"openengine-{component}"  # the role common/peer_identity.py checks
        assert "openengine-internal" in cert["dnsNames"]  # OPENENGINE_INTERNAL_TLS_SERVER_NAME
        assert ("server auth" in cert["usages"]) == (component != "frontend")
        assert "client auth" in cert["usages"]
        assert cert["issuerRef"] == {"name": ca, "kind": "Issuer", "group": "cert-manager.io"}
        volumes = _secret_volumes(r.deployment(component)["spec"]["template"]["spec"])
        assert volumes["internal-tls"] == cert["secretName"]
        assert r.env(component)["OPENENGINE_INTERNAL_TLS_CERT_FILE"] == "/etc/openengine/internal-tls/tls.crt"
    assert set(certificates) == {ca} | {f"{name(c)}-internal" for c in COMPONENTS}


def test_internal_certificates_from_a_given_issuer_and_not_without_cert_manager(render) -> None:
    issuer = {"name": "corp-ca", "kind": "ClusterIssuer"}
    r = render({"internalTls": {"certManager": {"enabled": True, "issuerRef": issuer}}})
    assert not r.of_kind("Issuer")
    assert [c["spec"]["issuerRef"] for c in r.of_kind("Certificate")] == [issuer] * 3
    # the default (auto) renders internal TLS only where the cluster serves cert-manager.io/v1 (not offline)
    assert not render().of_kind("Certificate")
    assert not render({"internalTls": {"certManager": {"enabled": False}}}).of_kind("Certificate")


def test_helm_test_sends_an_api_key_and_speaks_tls(render) -> None:
    r = render(VARIANTS["secured"])
    (pod,) = r.of_kind("Pod")
    (health,) = pod["spec"]["initContainers"]
    (generate,) = pod["spec"]["containers"]
    key = {e["name"]: e for e in generate["env"]}["OPENENGINE_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "oe-test-key", "key": "api-key"}
    for container in (health, generate):
        assert "--tls-ca-file" in container["args"] and "--tls-cert-file" in container["args"]
        assert _mounts(container)["/etc/openengine/tls"] == "tls"
    assert _secret_volumes(pod["spec"]) == {"tls": "oe-public-tls"}


def test_notes_say_how_to_call_with_tls_and_a_key(render) -> None:
    notes = render(VARIANTS["secured"]).notes
    assert "--tls-ca-file" in notes and "--api-key" in notes and "OPENENGINE_API_KEY" in notes
    assert "oe-public-tls" in notes and "--tls-cert-file" in notes
    assert "--api-key" not in render().notes


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"frontend": {"grpcServer": "pygrpc-native", "tls": {"secretName": "s"}}}, "terminate TLS in front"),
        (
            {"frontend": {"apiKeys": {"secretName": "k"}}, "tests": {"apiKeySecret": {"name": "t"}}},
            "sends keys in plaintext",
        ),
        (
            {"frontend": {"apiKeys": {"secretName": "k", "allowPlaintext": True}}},
            "set tests.apiKeySecret.name",
        ),
        (
            {"frontend": {"tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "Issuer"}}}}},
            "needs frontend.tls.secretName",
        ),
        ({"internalTls": {"secretName": "shared"}}, "Set internalTls.secrets.frontend, .coordinator and .node"),
        ({"internalTls": {"secrets": {"node": "n"}}}, "internalTls.secrets needs all three"),
        (
            {
                "internalTls": {
                    "secrets": {"frontend": "f", "coordinator": "c", "node": "n"},
                    "certManager": {"enabled": True},
                }
            },
            "use one",
        ),
    ],
)
def test_security_template_rejects(helm, chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert complaint in str(info.value)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"frontend": {"tls": {"secret": "x"}}}, "'secret' not allowed"),
        ({"internalTls": {"secretname": "x"}}, "'secretname' not allowed"),
        ({"internalTls": {"certManager": {"enabled": "yes"}}}, "/internalTls/certManager/enabled"),
        ({"frontend": {"apiKeys": {"secretKey": ""}}}, "/frontend/apiKeys/secretKey"),
    ],
)
def test_security_schema_rejects(helm, chart, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert complaint in str(info.value)


@pytest.mark.parametrize("age, expected", [(120, "120"), (2.5, "2.5")])
def test_max_connection_age_reaches_the_frontend_on_either_server(render, age, expected) -> None:
    r = render({"frontend": {"grpcServer": "pygrpc-native", "maxConnectionAgeSeconds": age}})
    assert r.env("frontend")["OPENENGINE_MAX_CONNECTION_AGE_S"] == expected
    assert "OPENENGINE_MAX_CONNECTION_AGE_S" not in r.env("node") | r.env("coordinator")
