"""The internal plane's role table: every internal RPC has its roles, and a refusal says what it needs."""

from __future__ import annotations

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common import peer_identity


def internal_methods() -> set[str]:
    services = cluster_pb2.DESCRIPTOR.services_by_name.values()
    return {f"/{service.full_name}/{method.name}" for service in services for method in service.methods}


def test_every_internal_rpc_names_the_roles_that_may_call_it():
    assert set(peer_identity.ALLOWED_ROLES) == internal_methods()


def test_a_refusal_names_the_caller_and_the_certificate_needed():
    message = peer_identity.refusal("/openengine_internal.v1.Coordinator/RegisterNode", "frontend")
    assert message == (
        "/openengine_internal.v1.Coordinator/RegisterNode is not open to a frontend: "
        "it needs an internal certificate with CN=openengine-node"
    )


def test_an_instance_certificate_acts_for_its_instance_and_a_frontends_workers():
    acts_for, node, frontend = peer_identity.acts_for, peer_identity.NODE, peer_identity.FRONTEND
    assert acts_for(None, node, "any-node"), "a role-wide certificate: any instance of its role"
    assert acts_for(frozenset({"node-a"}), node, "node-a")
    assert not acts_for(frozenset({"node-a"}), node, "node-b")
    assert not acts_for(frozenset({"node-a"}), node, "node-a-w0"), "workers are a frontend's"
    assert acts_for(frozenset({"fe"}), frontend, "fe-w12")
    assert not acts_for(frozenset({"fe"}), frontend, "fe-wx")
    assert not acts_for(frozenset({"fe"}), frontend, "other-w1")
    assert peer_identity.instance_name(node, "node-a") == "node-a.openengine-node"
