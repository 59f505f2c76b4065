"""Who may call what on the internal plane: the caller's role, read from its internal mTLS certificate.

With internal mutual TLS on, every component presents a certificate of the internal CA whose subject
Common Name names its role (`ROLE_COMMON_NAMES`). The coordinator and the nodes check that role on
every call of their internal services (`ALLOWED_ROLES`): only nodes register as nodes and publish a
node's load; only frontends reserve, open lanes and submit. A caller with another role gets
PERMISSION_DENIED. Without internal TLS there is no certificate, hence no check (development only).

A certificate may also name the component instance it belongs to, as a DNS name `<id>.openengine-<role>` among
its subject alternative names (`instance_name`). Such a certificate acts only for that instance: a node registers
and heartbeats only that node_id; a frontend registers, reserves, submits and opens a lane only as that
frontend_id (or one of its worker processes, `<id>-w<n>`). A role certificate naming no instance acts for any
instance of its role (one certificate shared by a Deployment's replicas).
"""

from __future__ import annotations

import contextlib

import grpc

from .tls import internal_tls_enabled

FRONTEND, COORDINATOR, NODE = "frontend", "coordinator", "node"
ROLE_COMMON_NAMES = {f"openengine-{role}": role for role in (FRONTEND, COORDINATOR, NODE)}
ANY_ROLE = frozenset((FRONTEND, COORDINATOR, NODE))

# Every method of the internal services, and the roles that may call it (tests/unit/test_peer_identity.py checks
# that none is missing). Read-only calls are open to every role.
ALLOWED_ROLES: dict[str, frozenset[str]] = {
    "/openengine_internal.v1.Coordinator/RegisterNode": frozenset((NODE,)),
    "/openengine_internal.v1.Coordinator/NodeHeartbeats": frozenset((NODE,)),
    "/openengine_internal.v1.Coordinator/RegisterFrontend": frozenset((FRONTEND,)),
    "/openengine_internal.v1.Coordinator/FrontendHeartbeats": frozenset((FRONTEND,)),
    "/openengine_internal.v1.Coordinator/Reserve": frozenset((FRONTEND,)),
    "/openengine_internal.v1.Coordinator/Release": frozenset((FRONTEND,)),
    "/openengine_internal.v1.Coordinator/Reservations": frozenset((FRONTEND,)),
    "/openengine_internal.v1.Coordinator/Abort": frozenset((FRONTEND,)),
    "/openengine_internal.v1.Coordinator/GetClusterLoad": ANY_ROLE,
    "/openengine_internal.v1.Coordinator/SetLora": frozenset((FRONTEND,)),  # LoadLora, UnloadLora
    "/openengine_internal.v1.Node/Submissions": frozenset((FRONTEND,)),
    "/openengine_internal.v1.Node/Lane": frozenset((FRONTEND,)),
    "/openengine_internal.v1.Node/Cancel": frozenset((FRONTEND, COORDINATOR)),  # the coordinator's Abort
    "/openengine_internal.v1.Node/GetNodeLoad": ANY_ROLE,
    "/openengine_internal.v1.Node/GetModel": ANY_ROLE,
    "/openengine_internal.v1.Node/KvEvents": frozenset((FRONTEND, COORDINATOR)),  # SubscribeKvEvents; routing
    "/openengine_internal.v1.Node/SetLora": frozenset((COORDINATOR,)),  # the deployment's LoadLora, UnloadLora
}
CHECKED_SERVICES = ("/openengine_internal.v1.Coordinator/", "/openengine_internal.v1.Node/")


def instance_name(role: str, instance_id: str) -> str:
    """The DNS subject alternative name that makes a certificate an instance's: `node-1.openengine-node`."""
    return f"{instance_id}.openengine-{role}"


def caller_instances(context, role: str) -> frozenset[str] | None:
    """The instances of `role` the caller's certificate names; None when it names none (a role-wide certificate,
    or no internal TLS): then it may act for any instance."""
    suffix = f".openengine-{role}"
    names = frozenset(
        name[: -len(suffix)]
        for raw in context.auth_context().get("x509_subject_alternative_name", ())
        if (name := raw.decode(errors="replace")).endswith(suffix)
    )
    return names or None


def acts_for(instances: frozenset[str] | None, role: str, claimed_id: str) -> bool:
    """May a caller whose certificate names `instances` act as `claimed_id`? A frontend's worker processes use
    the ids `<frontend id>-w<n>`."""
    if instances is None or claimed_id in instances:
        return True
    if role == FRONTEND:
        base, separator, worker = claimed_id.rpartition("-w")
        return bool(separator) and worker.isdigit() and base in instances
    return False


def instance_refusal(method: str, role: str, claimed_id: str, instances: frozenset[str]) -> str:
    named = ", ".join(repr(i) for i in sorted(instances))
    return (
        f"{method} as {role} {claimed_id!r} is refused: the caller's internal certificate names the {role} "
        f"instance {named} (DNS name <id>.openengine-{role}); a {role} acts only as its own instance"
    )


class InstanceCheck:
    """One call's caller, for the servicers' checks of the instance ids a request names."""

    __slots__ = ("role", "instances", "method")

    def __init__(self, context, role: str, method: str) -> None:
        self.role, self.method = role, method
        self.instances = caller_instances(context, role)

    def allows(self, claimed_id: str) -> bool:
        return acts_for(self.instances, self.role, claimed_id)

    def refusal(self, claimed_id: str) -> str:
        return instance_refusal(self.method, self.role, claimed_id, self.instances or frozenset())

    async def require(self, context, claimed_id: str) -> None:
        """Aborts the call with PERMISSION_DENIED unless the caller may act as `claimed_id`."""
        if not self.allows(claimed_id):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, self.refusal(claimed_id))


def caller_role(context) -> str | None:
    """The role named by the peer certificate's Common Name; None when it names none (or there is no certificate)."""
    for common_name in context.auth_context().get("x509_common_name", ()):
        role = ROLE_COMMON_NAMES.get(common_name.decode(errors="replace"))
        if role is not None:
            return role
    return None


def refusal(method: str, role: str | None) -> str:
    allowed = sorted(ALLOWED_ROLES.get(method, ()))
    names = " or ".join(f"CN={common_name}" for common_name, r in ROLE_COMMON_NAMES.items() if r in allowed)
    caller = f"a {role}" if role else "a caller whose internal certificate names no role"
    return f"{method} is not open to {caller}: it needs an internal certificate with {names or 'no role (closed)'}"


class RoleCheck(grpc.aio.ServerInterceptor):
    """Checks the caller's role on each call of the internal services (installed only with internal mTLS on).

    grpc.aio gives an interceptor no peer, so the check runs inside the wrapped handler, once per call before
    the method; a stream's messages then pass through one extra generator frame."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(CHECKED_SERVICES):
            return handler  # health checks: any peer the CA signed
        allowed = ALLOWED_ROLES.get(method, frozenset())

        async def check(context) -> None:
            role = caller_role(context)
            if role not in allowed:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal(method, role))

        kind = (
            ("stream" if handler.request_streaming else "unary")
            + "_"
            + ("stream" if handler.response_streaming else "unary")
        )
        behavior = getattr(handler, kind)

        async def respond(request, context):
            await check(context)
            return await behavior(request, context)

        async def stream(request, context):
            await check(context)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return handler._replace(**{kind: stream if handler.response_streaming else respond})


def role_checks(config) -> tuple[grpc.aio.ServerInterceptor, ...]:
    """The interceptors of an internal server: the role check with internal mTLS on, none without."""
    return (RoleCheck(),) if internal_tls_enabled(config) else ()
