"""Control.Abort (frontend/control.py) over fake coordinators: which requests an Abort by id reaches under API
keys (ids are scoped per key), and an incomplete Abort(all_requests) that names no coordinator."""

from __future__ import annotations

import grpc
import pytest

from openengine_serve.api.openengine.v1 import lifecycle_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.frontend import auth
from openengine_serve.frontend.control import Control
from openengine_serve.frontend.nodes import NodeConnections
from openengine_serve.frontend.tasks import BackgroundTasks

from .frontend_fakes import FakeCoordinatorStub, coordinator_client, node_entry, rpc_error

FIRST, SECOND = "coordinator.test:1", "coordinator.test:2"


class Aborted(Exception):
    pass


class FakeContext:
    """What Abort uses of a servicer context: abort() ends the call with its status."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str):
        self.status = (code, details)
        raise Aborted(details)


@pytest.fixture(autouse=True)
def no_caller_after():
    yield
    auth._CALLER.set(None)  # the test's caller stays in its test
    auth._KEY_STORE.set(None)


@pytest.fixture
def stubs() -> dict[str, FakeCoordinatorStub]:
    return {FIRST: FakeCoordinatorStub(node_entry("n0")), SECOND: FakeCoordinatorStub(node_entry("n1"))}


@pytest.fixture
async def control(stubs) -> Control:
    nodes = NodeConnections("fe-test", BackgroundTasks(), connect_timeout_s=1.0, call_timeout_s=1.0)
    coordinator = coordinator_client(stubs[FIRST], nodes, more_shards={SECOND: stubs[SECOND]})
    return Control(None, "fe-test", None, coordinator, None, None, None, None)  # Abort needs only the coordinator


@pytest.fixture
def store(tmp_path) -> auth.KeyStore:
    path = tmp_path / "keys"
    path.write_text("admin ops k-ops\nuser alice k-alice\nuser bob k-bob\nuser bob k-bob-second\n")
    return auth.KeyStore(str(path))


def calling_as(store: auth.KeyStore, name: str) -> None:
    """The current task calls with the key `name` (what the interceptor's bound handler sets)."""
    auth._CALLER.set(next(k for k in store.keys if k.name == name))
    auth._KEY_STORE.set(store)


def asked(stubs) -> list[tuple[str, str]]:
    return sorted((a.request_id, a.owner) for stub in stubs.values() for a in stub.aborts)


async def abort_id(control: Control, request_id: str = "r1") -> lifecycle_pb2.AbortResponse:
    return await control.Abort(lifecycle_pb2.AbortRequest(request_id=request_id), FakeContext())


async def test_a_users_abort_by_id_asks_only_for_its_own_request(control, stubs, store):
    calling_as(store, "alice")
    reply = await abort_id(control)
    assert reply.status == lifecycle_pb2.ABORT_STATUS_ABORTED
    assert asked(stubs) == [("alice r1", "alice")]


async def test_an_admins_abort_by_id_asks_for_the_id_under_every_key(control, stubs, store):
    stubs[FIRST].aborted = stubs[SECOND].aborted = 1
    calling_as(store, "ops")
    reply = await abort_id(control)
    assert asked(stubs) == [("alice r1", ""), ("bob r1", ""), ("ops r1", "")]  # bob's two secrets: one name
    assert reply.message == "aborted 3 request(s)"


async def test_without_keys_an_abort_by_id_asks_for_the_id_itself(control, stubs):
    auth._CALLER.set(None)
    await abort_id(control)
    assert asked(stubs) == [("r1", "")]


async def test_an_abort_of_all_that_misses_a_coordinator_names_none(control, stubs):
    stubs[FIRST].aborted = 2
    stubs[SECOND].unreachable = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
    context = FakeContext()
    with pytest.raises(Aborted):
        await control.Abort(lifecycle_pb2.AbortRequest(all_requests=lifecycle_pb2.AllRequests()), context)
    assert context.status == (
        grpc.StatusCode.UNAVAILABLE,
        "aborted 2 request(s); 1 coordinator(s) were unreachable; retry the Abort",
    )
    assert stubs[FIRST].aborts == [cluster_pb2.ClusterAbortRequest(all_requests=True)]
