"""TLS and mutual TLS on the public port (grpcio), real handshakes with certificates made here (trustme);
pygrpc-native with TLS refused at start; internal mutual TLS refusing a stranger."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import trustme

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine.v1 import server_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from openengine_serve.client import Client, Credentials, is_serving

from . import processes

MODEL = "Qwen/Qwen3-0.6B"


class Pki:
    """A CA and files for one server certificate and one client certificate it signed."""

    def __init__(self, directory: Path, name: str) -> None:
        self.ca = trustme.CA()
        self.dir = directory / name
        self.dir.mkdir()
        self.ca_file = self.write("ca.pem", self.ca.cert_pem.bytes())
        self.cert_file, self.key_file = self.issue("server", "localhost", "127.0.0.1")
        self.client_cert_file, self.client_key_file = self.issue("client", "client.example")

    def write(self, name: str, data: bytes) -> str:
        path = self.dir / name
        path.write_bytes(data)
        return str(path)

    def issue(self, name: str, *identities: str) -> tuple[str, str]:
        cert = self.ca.issue_cert(*identities)
        chain = b"".join(pem.bytes() for pem in cert.cert_chain_pems)
        return self.write(f"{name}.pem", chain), self.write(f"{name}.key", cert.private_key_pem.bytes())

    def client(self, mutual: bool = False, **extra) -> Credentials:
        if mutual:
            return Credentials(
                ca_file=self.ca_file, cert_file=self.client_cert_file, key_file=self.client_key_file, **extra
            )
        return Credentials(ca_file=self.ca_file, **extra)


def tls_frontend(coordinator: str, pki: Pki, mutual: bool = False, **env) -> processes.Component:
    env = {"OPENENGINE_TLS_CERT_FILE": pki.cert_file, "OPENENGINE_TLS_KEY_FILE": pki.key_file, **env}
    if mutual:
        env["OPENENGINE_TLS_CLIENT_CA_FILE"] = pki.ca_file
    component = processes.frontend(coordinator, "grpcio", **env)
    component.credentials = pki.client(mutual)
    return component


def request(max_tokens: int = 8) -> G.GenerateRequest:
    return G.GenerateRequest(
        request_id=f"tls-{uuid.uuid4()}",
        model=MODEL,
        prompt="Hello there",
        stopping=G.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


def generates(target: str, credentials: Credentials, max_tokens: int = 8) -> bool:
    with Client(target, credentials=credentials, retries=False) as client:
        responses = list(client.inference.Generate(request(max_tokens), timeout=30))
    return responses[-1].usage.completion_tokens == max_tokens


def refused(target: str, credentials: Credentials) -> grpc.StatusCode:
    with Client(target, credentials=credentials, retries=False) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=3)
    return err.value.code()


@pytest.fixture
def deployment():
    d = processes.Deployment()
    yield d
    d.close()


def test_tls_only_and_a_plaintext_client_fails(cluster, tmp_path, deployment):
    coord, _ = cluster
    pki = Pki(tmp_path, "public")
    fe = deployment.add(tls_frontend(coord.target, pki), 60)
    processes.wait_for(lambda: generates(fe.target, pki.client()), 20, "a TLS generation")
    assert refused(fe.target, Credentials()) == grpc.StatusCode.UNAVAILABLE
    assert refused(fe.target, Pki(tmp_path, "other").client()) == grpc.StatusCode.UNAVAILABLE  # untrusted server


def test_mutual_tls_refuses_no_or_a_foreign_client_certificate(cluster, tmp_path, deployment):
    coord, _ = cluster
    pki, stranger = Pki(tmp_path, "public"), Pki(tmp_path, "stranger")
    fe = deployment.add(tls_frontend(coord.target, pki, mutual=True), 60)
    processes.wait_for(lambda: generates(fe.target, pki.client(mutual=True)), 20, "an mTLS generation")
    assert refused(fe.target, pki.client()) == grpc.StatusCode.UNAVAILABLE
    foreign = Credentials(ca_file=pki.ca_file, cert_file=stranger.client_cert_file, key_file=stranger.client_key_file)
    assert refused(fe.target, foreign) == grpc.StatusCode.UNAVAILABLE


def test_certificate_rotation_keeps_open_streams_and_serves_the_new_certificate(cluster, tmp_path, deployment):
    coord, _ = cluster
    old, new = Pki(tmp_path, "old"), Pki(tmp_path, "new")
    fe = deployment.add(tls_frontend(coord.target, old), 60)
    with Client(fe.target, credentials=old.client(), retries=False) as client:
        stream = client.inference.Generate(request(1500), timeout=60)
        assert next(stream).HasField("token")
        # what a Secret update does: the files change in place
        Path(old.cert_file).write_bytes(Path(new.cert_file).read_bytes())
        Path(old.key_file).write_bytes(Path(new.key_file).read_bytes())
        processes.wait_for(
            lambda: is_serving(fe.target, credentials=new.client()), 10, "the new certificate on new connections"
        )
        assert refused(fe.target, old.client()) == grpc.StatusCode.UNAVAILABLE
        responses = list(stream)
    assert responses[-1].usage.completion_tokens == 1500


def run_cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "openengine_serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_pygrpc_native_with_tls_exits_2_at_start_naming_both_ways_out(tmp_path):
    pki = Pki(tmp_path, "public")
    started = time.monotonic()
    result = run_cli(
        "frontend",
        "--grpc-server",
        "pygrpc-native",
        "--port",
        str(processes.free_port()),
        "--tls-cert-file",
        pki.cert_file,
        "--tls-key-file",
        pki.key_file,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 10
    message = result.stderr.strip()
    assert message.count("\n") == 0, message
    assert "pygrpc-native" in message and "OPENENGINE_GRPC_SERVER=grpcio" in message
    assert "terminate TLS in front" in message


def test_malformed_key_file_stops_the_start_with_file_and_line(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# keys\nuser alice k1\nadmin ops\n")
    result = run_cli("frontend", "--port", str(processes.free_port()), "--api-keys-file", str(keys), timeout=30)
    assert result.returncode == 2
    expected = "expected `ROLE NAME SECRET [max_in_flight=N] [max_priority=N] [cache_group=NAME] [share_weight=N]`"
    assert f"{keys}:3: {expected}" in result.stderr


def test_cli_calls_a_frontend_with_mutual_tls_and_an_api_key(cluster, tmp_path, deployment):
    coord, _ = cluster
    pki = Pki(tmp_path, "public")
    keys = tmp_path / "keys"
    keys.write_text("user cli-user k-cli-9d\n")
    fe = deployment.add(tls_frontend(coord.target, pki, mutual=True, OPENENGINE_API_KEYS_FILE=str(keys)), 60)
    processes.wait_for(
        lambda: generates(fe.target, pki.client(mutual=True, api_key="k-cli-9d")), 20, "a keyed mTLS generation"
    )
    tls = [
        "--target",
        fe.target,
        "--tls-ca-file",
        pki.ca_file,
        "--tls-cert-file",
        pki.client_cert_file,
        "--tls-key-file",
        pki.client_key_file,
    ]
    result = run_cli(
        "generate", *tls, "--prompt", "Hi", "--max-tokens", "4", "--ignore-eos", env={"OPENENGINE_API_KEY": "k-cli-9d"}
    )
    assert result.returncode == 0, result.stderr
    assert "completion_tokens=4" in result.stderr
    info = run_cli("info", *tls, "--api-key", "k-cli-9d")
    assert info.returncode == 0 and "engine_name" in info.stdout, info.stderr
    no_key = run_cli("info", *tls, env={"OPENENGINE_API_KEY": ""})
    assert no_key.returncode == 2 and "UNAUTHENTICATED" in no_key.stderr
    assert run_cli("health", *tls).returncode == 0  # probes need no key
    assert run_cli("health", "--target", fe.target, "--tls-ca-file", pki.ca_file).returncode == 1  # no client cert


def test_internal_mutual_tls_admits_the_deployment_and_refuses_a_stranger(tmp_path, deployment):
    internal, stranger = Pki(tmp_path, "internal"), Pki(tmp_path, "stranger")

    def tls_env(pki: Pki, role: str) -> dict[str, str]:
        """The component's own certificate: its Common Name names its role (common/peer_identity.py)."""
        cert = pki.ca.issue_cert("localhost", "127.0.0.1", common_name=f"openengine-{role}")
        chain = b"".join(pem.bytes() for pem in cert.cert_chain_pems)
        return {
            "OPENENGINE_INTERNAL_TLS_CERT_FILE": pki.write(f"{role}.pem", chain),
            "OPENENGINE_INTERNAL_TLS_KEY_FILE": pki.write(f"{role}.key", cert.private_key_pem.bytes()),
            "OPENENGINE_INTERNAL_TLS_CA_FILE": pki.ca_file,
        }

    coordinator = processes.coordinator(**tls_env(internal, "coordinator"))
    coordinator.credentials = Credentials(
        ca_file=internal.ca_file, cert_file=internal.cert_file, key_file=internal.key_file
    )
    deployment.add(coordinator, 30)
    node = processes.node(coordinator.target, 0, **tls_env(internal, "node"))
    node.credentials = coordinator.credentials
    deployment.add(node, 90)
    fe = deployment.add(processes.frontend(coordinator.target, "grpcio", **tls_env(internal, "frontend")), 60)
    processes.wait_for(lambda: generates(fe.target, Credentials()), 30, "a generation over internal mTLS")

    entry = cluster_pb2.NodeEntry(node_id="intruder", address="127.0.0.1:1", rank=5)
    for credentials in (
        None,
        grpc.ssl_channel_credentials(
            Path(internal.ca_file).read_bytes(),
            Path(stranger.client_key_file).read_bytes(),
            Path(stranger.client_cert_file).read_bytes(),
        ),
    ):
        for target, call in (
            (
                coordinator.target,
                lambda ch: cluster_pb2_grpc.CoordinatorStub(ch).RegisterNode(
                    cluster_pb2.RegisterNodeRequest(node=entry), timeout=3
                ),
            ),
            (
                coordinator.target,
                lambda ch: cluster_pb2_grpc.CoordinatorStub(ch).Reserve(
                    cluster_pb2.ReserveRequest(request_id="x", frontend_id="intruder"), timeout=3
                ),
            ),
            (
                node.target,
                lambda ch: next(
                    cluster_pb2_grpc.NodeStub(ch).Submissions(
                        iter([cluster_pb2.SubmitBatch(submit=[cluster_pb2.SubmitRequest()])]), timeout=3
                    )
                ),
            ),
            (
                node.target,
                lambda ch: next(
                    cluster_pb2_grpc.NodeStub(ch).Lane(
                        iter([cluster_pb2.LaneCredit(frontend_id="intruder", window=2)]), timeout=3
                    )
                ),
            ),
        ):
            channel = (
                grpc.insecure_channel(target)
                if credentials is None
                else grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", "localhost")])
            )
            with channel, pytest.raises(grpc.RpcError) as err:
                call(channel)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


def test_up_with_mutual_tls_and_api_keys_checks_readiness_over_tls_and_says_so(tmp_path):
    import signal

    pki = Pki(tmp_path, "public")
    keys = tmp_path / "keys"
    keys.write_text("user up-user k-up-41\n")
    port = processes.free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "openengine_serve",
            "up",
            "--port",
            str(port),
            "--engine",
            "simulated",
            "--tls-cert-file",
            pki.cert_file,
            "--tls-key-file",
            pki.key_file,
            "--tls-client-ca-file",
            pki.ca_file,
            "--api-keys-file",
            str(keys),
            "--tls-ca-file",
            pki.ca_file,
            "--client-cert-file",
            pki.client_cert_file,
            "--client-key-file",
            pki.client_key_file,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert f"ready on 127.0.0.1:{port};" in line, line
        assert "API on https://" in line and line.count("(TLS, mutual TLS, API key required)") == 1, line
        assert generates(f"127.0.0.1:{port}", pki.client(mutual=True, api_key="k-up-41"))
        assert refused(f"127.0.0.1:{port}", pki.client(mutual=True)) == grpc.StatusCode.UNAUTHENTICATED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("component", ["coordinator", "node", "frontend"])
def test_incomplete_internal_tls_stops_the_start(tmp_path, component):
    pki = Pki(tmp_path, "internal")
    result = run_cli(
        component,
        "--port",
        str(processes.free_port()),
        "--internal-tls-cert-file",
        pki.cert_file,
        "--internal-tls-key-file",
        pki.key_file,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert "needs all three of OPENENGINE_INTERNAL_TLS_CERT_FILE" in result.stderr


def test_the_http_api_serves_https_with_the_public_certificate_and_its_client_ca(cluster, tmp_path, deployment):
    import http.client
    import json
    import ssl

    coord, _ = cluster
    pki = Pki(tmp_path, "public")
    frontend, url = processes.with_http(tls_frontend(coord.target, pki, mutual=True))
    fe = deployment.add(frontend, 60)
    processes.wait_for(lambda: generates(fe.target, pki.client(mutual=True)), 20, "a TLS generation")
    port = int(url.rsplit(":", 1)[1].split("/")[0])

    def get_models(with_client_certificate: bool) -> int:
        context = ssl.create_default_context(cafile=pki.ca_file)
        if with_client_certificate:
            context.load_cert_chain(pki.client_cert_file, pki.client_key_file)
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        assert json.loads(response.read())["data"][0]["id"] == MODEL
        return response.status

    assert get_models(with_client_certificate=True) == 200
    with pytest.raises((ssl.SSLError, ConnectionError)):
        get_models(with_client_certificate=False)
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/v1/models")
        plain.getresponse()
