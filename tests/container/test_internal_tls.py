"""Compose runs internal mutual TLS by default: a container on the internal network without a certificate, or
with another role's or another instance's certificate (taken from the stack's own volumes), can neither register
as a node, heartbeat the stack's node away, nor open a frontend's result lane; the stack keeps serving."""

from __future__ import annotations

import json

from .conftest import Stack
from .test_compose import generate_ok

# Runs inside the frontend image on the internal network: each attack, its gRPC status code name.
ATTACKS = """
import json, sys, grpc
from openengine_serve.api.openengine_internal.v1 import cluster_pb2 as C, cluster_pb2_grpc as S

def channel(target, pki):
    if not pki:
        return grpc.insecure_channel(target)
    read = lambda name: open(f"/pki/{name}", "rb").read()
    cert, key = sys.argv[2], sys.argv[3]
    credentials = grpc.ssl_channel_credentials(read("ca.pem"), read(key), read(cert))
    return grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", "openengine-internal")])

def register(ch):
    node = C.NodeEntry(node_id="node-1", address="attacker:50053", rank=0)
    S.CoordinatorStub(ch).RegisterNode(C.RegisterNodeRequest(node=node), timeout=10)

def heartbeat(ch):
    beat = C.NodeHeartbeatRequest(node_id="node-1", state=C.NODE_STATE_DRAINING)
    next(S.CoordinatorStub(ch).NodeHeartbeats(iter([beat]), timeout=10))

def lane(ch):
    next(S.NodeStub(ch).Lane(iter([C.LaneCredit(frontend_id="frontend", window=2)]), timeout=10))

def table(ch):
    load = S.CoordinatorStub(ch).GetClusterLoad(C.GetClusterLoadRequest(), timeout=10)
    return {n.node_id: C.NodeState.Name(n.state) for n in load.nodes}

pki = sys.argv[1] == "pki"
codes = {}
if pki:
    with channel("coordinator:50052", pki) as ch:
        codes["table_before"] = table(ch)
attacks = [("register", register, "coordinator:50052"), ("heartbeat", heartbeat, "coordinator:50052")]
if sys.argv[4] != "no-lane":  # (with the frontend's own certificate, opening its lane is no attack)
    attacks.append(("lane", lane, "node:50053"))
for name, rpc, target in attacks:
    with channel(target, pki) as ch:
        try:
            rpc(ch)
            codes[name] = "OK"
        except grpc.RpcError as exc:
            codes[name] = exc.code().name
if pki:
    with channel("coordinator:50052", pki) as ch:
        codes["table"] = table(ch)
print(json.dumps(codes))
"""


def attack(stack: Stack, volume: str = "", cert: str = "", key: str = "", lane: bool = True) -> dict:
    """The attacks from a fresh container on the stack's internal network (with `volume` at /pki: its files)."""
    mount = ["-v", f"{stack.project}_{volume}:/pki:ro"] if volume else []
    out = stack.docker_cmd(
        "run",
        "--rm",
        "--network",
        f"{stack.project}_internal",
        *mount,
        "--entrypoint",
        "python3",
        "openengine-serve-frontend:0.1.0",
        "-c",
        ATTACKS,
        "pki" if volume else "plain",
        cert,
        key,
        "lane" if lane else "no-lane",
        timeout=120,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_container_without_a_certificate_is_refused_on_the_internal_plane(stack: Stack):
    codes = attack(stack)
    assert codes == {"register": "UNAVAILABLE", "heartbeat": "UNAVAILABLE", "lane": "UNAVAILABLE"}, codes
    generate_ok(stack, 8)


def test_another_roles_or_instances_certificate_is_refused(stack: Stack):
    """node-2's certificate acts neither as node-1 nor as the frontend; the frontend's certificate is not a
    node's; the node table is what it was before the attacks (whatever earlier tests left running)."""
    as_other_node = attack(stack, "internal-pki-node", "node-2.pem", "node-2.key")
    assert as_other_node["register"] == as_other_node["heartbeat"] == "PERMISSION_DENIED", as_other_node
    assert as_other_node["lane"] == "PERMISSION_DENIED", as_other_node
    as_frontend = attack(stack, "internal-pki-frontend", "cert.pem", "key.pem", lane=False)
    assert as_frontend["register"] == as_frontend["heartbeat"] == "PERMISSION_DENIED", as_frontend
    assert as_frontend["table"] == as_frontend["table_before"], as_frontend
    assert "NODE_STATE_READY" in as_frontend["table"].values(), as_frontend
    generate_ok(stack, 8)
