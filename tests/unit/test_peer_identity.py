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
