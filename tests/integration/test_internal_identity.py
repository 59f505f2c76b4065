"""Internal mutual TLS with roles and instances: real processes, one certificate per component (trustme) whose
Common Name names its role (and, for instance certificates, whose DNS name <id>.openengine-<role> names its
instance). A node without a node certificate cannot register; each internal RPC refuses a caller of another role
with PERMISSION_DENIED; a certificate of another instance cannot act for this one; rotated client certificates
reach new connections."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest
import trustme

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from openengine_serve.client import Client, Credentials
from openengine_serve.common.peer_identity import instance_name

from . import processes
from .conftest import MODEL, SERVERS


class RolePki:
    """One internal CA and, per name, a certificate for 127.0.0.1 with the given Common Name."""

    def __init__(self, directory: Path) -> None:
        self.ca = trustme.CA()
        self.dir = directory
        self.ca_file = self.dir / "ca.pem"
        self.ca_file.write_bytes(self.ca.cert_pem.bytes())

    def issue(self, common_name: str, instance: str = "") -> trustme.LeafCert:
        """`instance`: the certificate also names this instance of the role (else it is role-wide)."""
        names = ["localhost", "127.0.0.1"]
        if instance:
            names.append(instance_name(common_name.removeprefix("openengine-"), instance))
        return self.ca.issue_cert(*names, common_name=common_name)

    def env(self, common_name: str, instance: str = "") -> dict[str, str]:
        """A new certificate in the files of this name (those of a component started with them: a rotation)."""
        cert = self.issue(common_name, instance)
        stem = f"{common_name}-{instance}" if instance else common_name
        cert_file, key_file = self.dir / f"{stem}.pem", self.dir / f"{stem}.key"
        cert_file.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
        key_file.write_bytes(cert.private_key_pem.bytes())
        return {
            "OPENENGINE_INTERNAL_TLS_CERT_FILE": str(cert_file),
            "OPENENGINE_INTERNAL_TLS_KEY_FILE": str(key_file),
            "OPENENGINE_INTERNAL_TLS_CA_FILE": str(self.ca_file),
        }

    def credentials(self, common_name: str, instance: str = "") -> Credentials:
        env = self.env(common_name, instance)
        return Credentials(
            ca_file=env["OPENENGINE_INTERNAL_TLS_CA_FILE"],
            cert_file=env["OPENENGINE_INTERNAL_TLS_CERT_FILE"],
            key_file=env["OPENENGINE_INTERNAL_TLS_KEY_FILE"],
        )

    def channel(self, target: str, common_name: str, instance: str = "") -> grpc.Channel:
        """A test client's channel, with a certificate of its own (the files of a component's name stay as they
        are: rewriting them would rotate that component's certificate)."""
        cert = self.issue(common_name, instance)
        credentials = grpc.ssl_channel_credentials(
            self.ca.cert_pem.bytes(),
            cert.private_key_pem.bytes(),
            b"".join(pem.bytes() for pem in cert.cert_chain_pems),
        )
        return grpc.secure_channel(target, credentials)


def component_with(
    pki: RolePki, component: processes.Component, common_name: str, instance: str = ""
) -> processes.Component:
    component.env.update(pki.env(common_name, instance))
    if not component.name.startswith(
        "frontend"
    ):  # internal ports: readiness over mTLS (the health service admits any role)
        component.credentials = pki.credentials(common_name, instance)
    return component


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    pki = RolePki(tmp_path_factory.mktemp("internal-pki"))
    deployment = processes.Deployment()
    try:
        coordinator = deployment.add(component_with(pki, processes.coordinator(), "openengine-coordinator"), 30)
        node = deployment.add(component_with(pki, processes.node(coordinator.target, 0), "openengine-node"), 90)
        yield pki, deployment, coordinator, node
    finally:
        deployment.close()


def registered_nodes(pki: RolePki, coordinator: processes.Component) -> list[str]:
    with pki.channel(coordinator.target, "openengine-frontend") as channel:
        load = cluster_pb2_grpc.CoordinatorStub(channel).GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=5)
    return [entry.node_id for entry in load.nodes]


@pytest.mark.parametrize("server", SERVERS)
def test_a_frontend_with_its_certificate_generates_through_role_checked_calls(secured, server):
    pki, deployment, coordinator, _ = secured
    frontend = deployment.add(
        component_with(pki, processes.frontend(coordinator.target, server), "openengine-frontend"), 60
    )
    processes.wait_for(lambda: generates(frontend.target), 30, "a generation over role-checked internal mTLS")


def generates(target: str) -> bool:
    request = G.GenerateRequest(
        request_id=f"roles-{uuid.uuid4()}",
        model=MODEL,
        prompt="Hello",
        stopping=G.StoppingOptions(max_tokens=6, ignore_eos=True),
    )
    try:
        with Client(target, retries=False) as client:
            return list(client.inference.Generate(request, timeout=30))[-1].usage.completion_tokens == 6
    except grpc.RpcError:
        return False


def test_rotated_internal_certificates_are_presented_on_new_connections(tmp_path):
    """Every file replaced by one of a new CA (what a Secret update does), then the coordinator restarted: the
    frontend's and the node's existing channels reconnect to it, which works only with the new files."""
    pki = RolePki(tmp_path)
    roles = ("openengine-coordinator", "openengine-node", "openengine-frontend")
    deployment = processes.Deployment()
    try:
        coordinator = deployment.add(component_with(pki, processes.coordinator(), roles[0]), 30)
        deployment.add(component_with(pki, processes.node(coordinator.target, 0), roles[1]), 90)
        frontend = deployment.add(component_with(pki, processes.frontend(coordinator.target, "grpcio"), roles[2]), 60)
        processes.wait_for(lambda: generates(frontend.target), 30, "a generation with the first CA")

        pki.ca = trustme.CA()
        pki.ca_file.write_bytes(pki.ca.cert_pem.bytes())
        for role in roles:
            pki.env(role)
        coordinator.stop()
        log = processes.LOG_DIR / f"{coordinator.name}-{coordinator.port}.log"
        before = log.read_text(errors="replace").count('event="frontend registered"')
        coordinator.start().wait_ready(30)
        # (a generation alone would not tell: the frontend routes without its coordinator for a while)
        processes.wait_for(lambda: registered_nodes(pki, coordinator), 15, "the node registered again")
        processes.wait_for(
            lambda: log.read_text(errors="replace").count('event="frontend registered"') > before,
            15,
            "the frontend registered again",
        )
        assert generates(frontend.target)
    finally:
        deployment.close()


def test_a_node_without_a_node_certificate_cannot_register(secured):
    pki, deployment, coordinator, node = secured
    processes.wait_for(lambda: len(registered_nodes(pki, coordinator)) == 1, 10, "the node with its certificate")
    impostor = deployment.add(
        component_with(pki, processes.node(coordinator.target, 1), "openengine-frontend"), 90
    )  # a certificate of the same CA, for another role
    log = processes.LOG_DIR / f"{impostor.name}-{impostor.port}.log"
    processes.wait_for(
        lambda: "PERMISSION_DENIED" in log.read_text(errors="replace"), 15, "the impostor's refused registration"
    )
    assert "RegisterNode is not open to a frontend" in log.read_text(errors="replace")
    assert len(registered_nodes(pki, coordinator)) == 1


def call(pki: RolePki, target: str, common_name: str, rpc, instance: str = "") -> grpc.StatusCode:
    with pki.channel(target, common_name, instance) as channel:
        try:
            rpc(channel)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def register(channel):
    entry = cluster_pb2.NodeEntry(node_id="intruder", address="127.0.0.1:1", rank=7)
    cluster_pb2_grpc.CoordinatorStub(channel).RegisterNode(cluster_pb2.RegisterNodeRequest(node=entry), timeout=5)


def publish_load(channel):
    heartbeat = cluster_pb2.NodeHeartbeatRequest(node_id="intruder", load=cluster_pb2.NodeLoad(running_requests=99))
    next(cluster_pb2_grpc.CoordinatorStub(channel).NodeHeartbeats(iter([heartbeat]), timeout=5))


def reserve(channel):
    request = cluster_pb2.ReserveRequest(request_id=f"r-{uuid.uuid4()}", frontend_id="intruder")
    cluster_pb2_grpc.CoordinatorStub(channel).Reserve(request, timeout=5)


def open_lane(channel):
    next(cluster_pb2_grpc.NodeStub(channel).Lane(iter([cluster_pb2.LaneCredit(frontend_id="x", window=2)]), timeout=5))


def submit(channel):
    batch = cluster_pb2.SubmitBatch(submit=[cluster_pb2.SubmitRequest(request=cluster_pb2.EngineRequest())])
    next(cluster_pb2_grpc.NodeStub(channel).Submissions(iter([batch]), timeout=5))


def read_cluster_load(channel):
    cluster_pb2_grpc.CoordinatorStub(channel).GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=5)


@pytest.mark.parametrize(
    ("service", "rpc", "common_name"),
    [
        ("coordinator", register, "openengine-frontend"),
        ("coordinator", register, "openengine-coordinator"),
        ("coordinator", publish_load, "openengine-frontend"),
        ("coordinator", reserve, "openengine-node"),
        ("node", open_lane, "openengine-node"),
        ("node", open_lane, "openengine-coordinator"),
        ("node", submit, "openengine-node"),
        ("coordinator", read_cluster_load, "someone-else"),  # a certificate of the CA that names no role
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_a_caller_of_another_role_is_denied(secured, service, rpc, common_name):
    pki, _, coordinator, node = secured
    target = {"coordinator": coordinator, "node": node}[service].target
    assert call(pki, target, common_name, rpc) == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize(
    ("service", "rpc", "common_name"),
    [
        ("coordinator", reserve, "openengine-frontend"),
        ("node", open_lane, "openengine-frontend"),
        ("coordinator", read_cluster_load, "openengine-node"),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_the_role_a_call_needs_passes_the_check(secured, service, rpc, common_name):
    pki, _, coordinator, node = secured
    target = {"coordinator": coordinator, "node": node}[service].target
    assert call(pki, target, common_name, rpc) == grpc.StatusCode.OK


# ---------------------------------------------------------------- instances: a certificate acts for its own instance

NODE_CN, FRONTEND_CN = "openengine-node", "openengine-frontend"


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    """A coordinator, node `node-a` and grpcio frontend `fe-a`, each with a certificate naming its instance."""
    pki = RolePki(tmp_path_factory.mktemp("instance-pki"))
    deployment = processes.Deployment()
    try:
        coordinator = deployment.add(
            component_with(pki, processes.coordinator(), "openengine-coordinator", "coordinator-0"), 30
        )
        node = deployment.add(
            component_with(pki, processes.node(coordinator.target, 0, OPENENGINE_NODE_ID="node-a"), NODE_CN, "node-a"),
            90,
        )
        frontend = deployment.add(
            component_with(
                pki,
                processes.frontend(coordinator.target, "grpcio", OPENENGINE_FRONTEND_ID="fe-a"),
                FRONTEND_CN,
                "fe-a",
            ),
            60,
        )
        processes.wait_for(lambda: generates(frontend.target), 30, "a generation with instance certificates")
        yield pki, deployment, coordinator, node, frontend
    finally:
        deployment.close()


def node_states(pki: RolePki, coordinator: processes.Component) -> dict[str, int]:
    with pki.channel(coordinator.target, FRONTEND_CN, "fe-a") as channel:
        load = cluster_pb2_grpc.CoordinatorStub(channel).GetClusterLoad(cluster_pb2.GetClusterLoadRequest(), timeout=5)
    return {entry.node_id: entry.state for entry in load.nodes}


def register_as(node_id: str):
    def rpc(channel):
        entry = cluster_pb2.NodeEntry(node_id=node_id, address="127.0.0.1:1", rank=7)
        cluster_pb2_grpc.CoordinatorStub(channel).RegisterNode(cluster_pb2.RegisterNodeRequest(node=entry), timeout=5)

    return rpc


def heartbeat_down_as(node_id: str):
    def rpc(channel):
        heartbeat = cluster_pb2.NodeHeartbeatRequest(node_id=node_id, state=cluster_pb2.NODE_STATE_DRAINING)
        next(cluster_pb2_grpc.CoordinatorStub(channel).NodeHeartbeats(iter([heartbeat]), timeout=5))

    return rpc


def lane_as(frontend_id: str):
    def rpc(channel):
        credit = cluster_pb2.LaneCredit(frontend_id=frontend_id, window=2)
        next(cluster_pb2_grpc.NodeStub(channel).Lane(iter([credit]), timeout=5))

    return rpc


def register_frontend_as(frontend_id: str):
    def rpc(channel):
        request = cluster_pb2.RegisterFrontendRequest(frontend_id=frontend_id, address="127.0.0.1:1")
        cluster_pb2_grpc.CoordinatorStub(channel).RegisterFrontend(request, timeout=5)

    return rpc


def reserve_as(frontend_id: str):
    def rpc(channel):
        request = cluster_pb2.ReserveRequest(request_id=f"r-{uuid.uuid4()}", frontend_id=frontend_id)
        cluster_pb2_grpc.CoordinatorStub(channel).Reserve(request, timeout=5)

    return rpc


def submit_as(frontend_id: str) -> int:
    """The refusal code of a submission into `frontend_id`'s lane (a grpc status number; 0: taken)."""

    def rpc(channel):
        request = cluster_pb2.EngineRequest(
            request_id=f"s-{uuid.uuid4()}", frontend_id=frontend_id, prompt_token_ids=[1, 2, 3], max_tokens=2
        )
        batch = cluster_pb2.SubmitBatch(submit=[cluster_pb2.SubmitRequest(request=request)])
        outcome = next(cluster_pb2_grpc.NodeStub(channel).Submissions(iter([batch]), timeout=5)).outcome[0]
        if outcome.refusal_code:
            raise SubmissionRefused(outcome.refusal_code, outcome.refusal)

    return rpc


class SubmissionRefused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@pytest.mark.parametrize(
    ("service", "rpc", "common_name", "instance"),
    [
        ("coordinator", register_as("node-a"), NODE_CN, "node-b"),  # take over node-a's table entry (its address)
        ("coordinator", heartbeat_down_as("node-a"), NODE_CN, "node-b"),  # report node-a draining
        ("coordinator", register_frontend_as("fe-a"), FRONTEND_CN, "fe-b"),
        ("coordinator", reserve_as("fe-a"), FRONTEND_CN, "fe-b"),
        ("node", lane_as("fe-a"), FRONTEND_CN, "fe-b"),  # take fe-a's result lane (its streams' tokens)
        ("node", lane_as("fe-a-w0"), FRONTEND_CN, "fe-b"),  # ... or one of its workers'
        ("node", lane_as("fe-a"), FRONTEND_CN, "fe-a-x"),  # a name that starts like it is another instance
    ],
    ids=["register-node", "heartbeat-node", "register-frontend", "reserve", "lane", "worker-lane", "prefix-lane"],
)
def test_another_instances_certificate_is_refused(instances, service, rpc, common_name, instance):
    pki, _, coordinator, node, _ = instances
    target = {"coordinator": coordinator, "node": node}[service].target
    assert call(pki, target, common_name, rpc, instance) == grpc.StatusCode.PERMISSION_DENIED
    assert node_states(pki, coordinator) == {"node-a": cluster_pb2.NODE_STATE_READY}


@pytest.mark.parametrize(
    ("service", "rpc", "common_name", "instance"),
    [
        ("coordinator", register_frontend_as("fe-b"), FRONTEND_CN, "fe-b"),
        ("coordinator", reserve_as("fe-b-w1"), FRONTEND_CN, "fe-b"),  # a worker of its own
        ("node", lane_as("fe-b"), FRONTEND_CN, "fe-b"),
        ("node", lane_as("fe-b-w3"), FRONTEND_CN, "fe-b"),
    ],
    ids=["register-frontend", "reserve-worker", "lane", "worker-lane"],
)
def test_an_instance_acts_as_itself(instances, service, rpc, common_name, instance):
    pki, _, coordinator, node, _ = instances
    target = {"coordinator": coordinator, "node": node}[service].target
    assert call(pki, target, common_name, rpc, instance) == grpc.StatusCode.OK


def test_a_submission_into_another_frontends_lane_is_refused(instances):
    pki, _, _, node, _ = instances
    with pki.channel(node.target, FRONTEND_CN, "fe-b") as channel:
        with pytest.raises(SubmissionRefused) as refused:
            submit_as("fe-a")(channel)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert "names the frontend instance 'fe-b'" in str(refused.value)


def test_a_node_registers_only_the_id_its_certificate_names(instances):
    """A node started with node-b's certificate but node-a's id never gets into the table."""
    pki, deployment, coordinator, _, _ = instances
    impostor = deployment.add(
        component_with(pki, processes.node(coordinator.target, 1, OPENENGINE_NODE_ID="node-a"), NODE_CN, "node-b"), 90
    )
    log = processes.LOG_DIR / f"{impostor.name}-{impostor.port}.log"
    processes.wait_for(
        lambda: "PERMISSION_DENIED" in log.read_text(errors="replace"), 15, "the impostor's refused registration"
    )
    assert "RegisterNode as node 'node-a' is refused" in log.read_text(errors="replace")
    assert node_states(pki, coordinator) == {"node-a": cluster_pb2.NODE_STATE_READY}
    impostor.stop()
