"""The request owner (frontend/requests.py): reserve, submit, and always clean up, with fake internal stubs."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.attempts import request_id_of
from openengine_serve.common.routing import rendezvous_pick
from openengine_serve.frontend import refusal
from openengine_serve.frontend.fallback_routing import FallbackRouter
from openengine_serve.frontend.inference import REFUSAL_CODES
from openengine_serve.frontend.nodes import LaneFailure, NodeConnections
from openengine_serve.frontend.refusal import DuplicateRequest, NotServed, Overloaded, Unavailable
from openengine_serve.frontend.requests import Requests
from openengine_serve.frontend.tasks import BackgroundTasks
from openengine_serve.frontend.validation import GenerationPlan, RequestMetadata

from .frontend_fakes import FakeCoordinatorStub, add_fake_node, coordinator_client, node_entry, rpc_error, settle


class Deployment:
    """A Requests owner over a fake coordinator and fake nodes n0, n1, n2 (the coordinator picks n1)."""

    def __init__(self) -> None:
        self.tasks = BackgroundTasks()
        self.nodes = NodeConnections("fe-test", self.tasks, connect_timeout_s=1.0, call_timeout_s=1.0)
        self.entries = [node_entry(f"n{i}", rank=i) for i in range(3)]
        self.node_stubs = {e.node_id: add_fake_node(self.nodes, e)[1] for e in self.entries}
        self.coordinator_stub = FakeCoordinatorStub(self.entries[1])
        self.coordinator = coordinator_client(self.coordinator_stub, self.nodes)
        self.coordinator._set_nodes(self.coordinator.shards[0], self.entries)
        self.requests = Requests("fe-test", self.coordinator, self.nodes, FallbackRouter())

    def coordinator_unreachable(self) -> None:
        self.coordinator_stub.reserve_error = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")

    def assert_cleaned_up(self, request_id: str) -> None:
        assert self.coordinator_stub.released == [request_id]
        assert self.nodes.sinks == {}
        assert all(not conn.requests for conn in self.nodes.connections.values())
        assert self.requests.open_count == 0


def plan(request_id: str = "r1", routing_key: str = "", target_rank: int | None = None) -> GenerationPlan:
    return GenerationPlan(
        request_id=request_id,
        model="m",
        prompt_token_ids=[11, 12, 13],
        num_sequences=2,
        max_tokens=4,
        seed=7,
        temperature=0.5,
        output_candidates=("top_n", 3),
        metadata=RequestMetadata(
            routing_key=routing_key,
            target_rank=target_rank,
            priority=-2,
            traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        ),
    )


@pytest.fixture
async def deployment():
    deployment = Deployment()
    yield deployment
    await deployment.nodes.close()  # stops the lane readers
    await settle()


async def test_an_accepted_request_is_submitted_then_released(deployment: Deployment):
    async with deployment.requests.open(plan()) as accepted:
        assert accepted.node.node_id == "n1" and deployment.requests.open_count == 1
        [submitted] = deployment.node_stubs["n1"].submitted
        assert (submitted.request_id, submitted.frontend_id, list(submitted.prompt_token_ids)) == (
            accepted.attempt_id,
            "fe-test",
            [11, 12, 13],
        )
        assert request_id_of(accepted.attempt_id) == "r1"
        assert (submitted.num_sequences, submitted.max_tokens, submitted.seed, submitted.has_seed) == (2, 4, 7, True)
        assert (submitted.priority, submitted.output_candidates.top_n) == (-2, 3)
        assert submitted.temperature == pytest.approx(0.5)
        [reserve] = deployment.coordinator_stub.reserved
        assert (reserve.request_id, reserve.prompt_tokens, reserve.num_sequences, reserve.HasField("target_rank")) == (
            "r1",
            3,
            2,
            False,
        )
        assert reserve.traceparent == "00-" + "a" * 32 + "-" + "b" * 16 + "-01"  # rides in the batched reservation
        event = cluster_pb2.OutputEvent(request_id=accepted.attempt_id)
        deployment.nodes.sinks[accepted.attempt_id].put(event)
        assert await accepted.sink.take() == [event]
        accepted.ended = True
    await settle()
    deployment.assert_cleaned_up("r1")
    assert deployment.node_stubs["n1"].cancelled == []


async def test_the_owner_goes_with_the_reservation(deployment: Deployment):
    """The API key name that starts a request reaches the coordinator (Abort is scoped by it), and scopes the
    internal id: the same id under two keys is two requests."""
    async with deployment.requests.open(plan("r-owned"), owner="team-a", share_weight=3) as accepted:
        assert accepted.owner == "team-a"
        accepted.ended = True
    async with deployment.requests.open(plan("r-anonymous")) as accepted:
        assert accepted.owner == ""
        accepted.ended = True
    await settle()
    submitted = deployment.node_stubs["n1"].submitted
    assert [(s.owner, s.share_weight) for s in submitted] == [("team-a", 3), ("", 1)], "the engine's fair share"
    assert [(r.request_id, r.owner) for r in deployment.coordinator_stub.reserved] == [
        ("team-a r-owned", "team-a"),
        ("r-anonymous", ""),
    ]
    assert deployment.coordinator_stub.released == ["team-a r-owned", "r-anonymous"]


async def test_each_submission_of_an_id_is_its_own_attempt_on_the_node(deployment: Deployment):
    """An id sent again once its stream ended: the first one's late cancel or events cannot reach the second."""
    attempts = []
    for _ in range(2):
        with pytest.raises(RuntimeError):
            async with deployment.requests.open(plan()) as accepted:
                attempts.append(accepted.attempt_id)
                raise RuntimeError("client went away")
    assert attempts[0] != attempts[1] and {request_id_of(a) for a in attempts} == {"r1"}
    await settle()
    assert deployment.node_stubs["n1"].cancelled == [(attempts[0], None), (attempts[1], None)]
    assert deployment.coordinator_stub.released == ["r1", "r1"]


async def test_a_stream_that_did_not_end_is_cancelled_on_its_node(deployment: Deployment):
    with pytest.raises(RuntimeError, match="client went away"):
        async with deployment.requests.open(plan()) as accepted:
            accepted.cancel_output(1)  # a stop string matched on output 1
            raise RuntimeError("client went away")
    await settle()
    assert deployment.node_stubs["n1"].cancelled == [(accepted.attempt_id, 1), (accepted.attempt_id, None)]
    deployment.assert_cleaned_up("r1")


@pytest.mark.parametrize(
    ("code", "refusal", "message"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded, "the node chosen for the request is full; retry later"),
        (
            grpc.StatusCode.UNAVAILABLE,
            Unavailable,
            "the node chosen for the request did not take it (UNAVAILABLE); retry",
        ),
    ],
)
async def test_a_node_that_does_not_take_the_request_is_a_refusal_naming_no_node(
    deployment: Deployment, code, refusal, message, caplog
):
    deployment.node_stubs["n1"].submit_error = rpc_error(code, "node n1 at n1.test:1: queue full")
    with caplog.at_level("WARNING", logger="openengine_serve.frontend"), pytest.raises(refusal) as refused:
        async with deployment.requests.open(plan()):
            pytest.fail("the body must not run")
    assert refused.value.message == message
    [logged] = [r.kv for r in caplog.records if r.getMessage() == "node did not take the request"]
    assert logged["detail"] == "node n1 at n1.test:1: queue full"  # the log keeps what the node said
    await settle()
    deployment.assert_cleaned_up("r1")
    assert deployment.node_stubs["n1"].cancelled == []


@pytest.mark.parametrize(
    ("code", "refusal"),
    [
        (grpc.StatusCode.ALREADY_EXISTS, DuplicateRequest),
        (grpc.StatusCode.NOT_FOUND, NotServed),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (grpc.StatusCode.INTERNAL, Unavailable),
    ],
)
async def test_a_coordinator_refusal_keeps_its_kind_and_message(deployment: Deployment, code, refusal):
    deployment.coordinator_stub.reserve_error = rpc_error(code, "what the coordinator said")
    # but for a duplicate: the coordinator names the frontend holding the id (and the internal id)
    said = "'r1' is already in flight" if refusal is DuplicateRequest else "what the coordinator said"
    with pytest.raises(refusal, match=said) as refused:
        async with deployment.requests.open(plan()):
            pytest.fail("the body must not run")
    assert (refusal is DuplicateRequest) == ("what the coordinator said" not in refused.value.message)
    await settle()
    assert deployment.coordinator_stub.released == []  # nothing was reserved
    assert deployment.nodes.sinks == {} and deployment.requests.open_count == 0


async def test_without_the_coordinator_a_key_goes_where_the_coordinator_would_send_it(deployment: Deployment):
    deployment.coordinator_unreachable()
    for key in (f"user-{i}" for i in range(6)):
        async with deployment.requests.open(plan(routing_key=key)) as accepted:
            assert accepted.node.node_id == rendezvous_pick(key, ["n0", "n1", "n2"], str)
            accepted.ended = True
    assert not deployment.coordinator.reachable


async def test_without_the_coordinator_duplicates_are_caught_on_this_frontend(deployment: Deployment):
    deployment.coordinator_unreachable()
    async with deployment.requests.open(plan("dup")):
        with pytest.raises(DuplicateRequest, match="'dup' is already in flight"):
            async with deployment.requests.open(plan("dup")):
                pytest.fail("the body must not run")
        assert deployment.requests.open_count == 1


async def test_a_client_leaving_during_reserve_still_releases(deployment: Deployment):
    deployment.coordinator_stub.reserve_gate = asyncio.Event()

    async def call():
        async with deployment.requests.open(plan()):
            pytest.fail("the body must not run")

    task = asyncio.ensure_future(call())
    await settle()
    assert deployment.requests.open_count == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deployment.coordinator_stub.reserve_gate.set()  # the coordinator answers the batch: the release goes next
    await settle()
    deployment.assert_cleaned_up("r1")


async def test_drain_waits_for_the_open_requests(deployment: Deployment):
    assert await deployment.requests.wait_idle(0.01)
    leave = asyncio.Event()

    async def call():
        async with deployment.requests.open(plan()) as accepted:
            await leave.wait()
            accepted.ended = True

    task = asyncio.ensure_future(call())
    await settle()
    assert not await deployment.requests.wait_idle(0.05)
    waiter = asyncio.ensure_future(deployment.requests.wait_idle(5.0))
    await settle()
    assert not waiter.done()
    leave.set()
    assert await waiter
    await task


async def test_the_drain_deadline_fails_every_open_stream(deployment: Deployment):
    async with deployment.requests.open(plan()) as accepted:
        deployment.requests.fail_all(LaneFailure("drain deadline", retryable=True, draining=True))
        [failure] = await accepted.sink.take()
        assert failure.draining and failure.retryable


def test_every_kind_of_refusal_has_its_grpc_code_at_the_edge():
    kinds = {c for c in vars(refusal).values() if isinstance(c, type) and issubclass(c, refusal.Refusal)}
    assert set(REFUSAL_CODES) == kinds - {refusal.Refusal}
    # one kind per code, but for "retry later": a full deployment and an API key at its limit (separate metric reasons)
    codes = list(REFUSAL_CODES.values())
    assert {code for code in codes if codes.count(code) > 1} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert [k for k, code in REFUSAL_CODES.items() if code == grpc.StatusCode.RESOURCE_EXHAUSTED] == [
        Overloaded,
        refusal.KeyAtLimit,
    ]


async def test_the_count_per_owner_returns_to_zero_on_every_ending(deployment: Deployment):
    """The API key concurrency limit reads this count: no ending may leak one."""
    requests = deployment.requests
    async with requests.open(plan("finished"), owner="alice") as accepted:
        async with requests.open(plan("other"), owner="bob"):
            assert (requests.open_count_of("alice"), requests.open_count_of("bob")) == (1, 1)
            async with requests.open(plan("second"), owner="alice"):
                assert requests.open_count_of("alice") == 2
        accepted.ended = True
    assert (requests.open_count_of("alice"), requests.open_count_of("bob")) == (0, 0)
    with pytest.raises(RuntimeError):  # the stream failed or the client went away mid-stream
        async with requests.open(plan("broken"), owner="alice"):
            raise RuntimeError("client went away")
    assert requests.open_count_of("alice") == 0
    deployment.node_stubs["n1"].submit_error = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    with pytest.raises(Overloaded):  # refused by the node after the reservation
        async with requests.open(plan("refused"), owner="alice"):
            pytest.fail("the body must not run")
    assert requests.open_count_of("alice") == 0
    deployment.node_stubs["n1"].submit_error = None
    deployment.coordinator_stub.reserve_gate = asyncio.Event()

    async def reserving():
        async with requests.open(plan("cancelled"), owner="alice"):
            pytest.fail("the body must not run")

    task = asyncio.ensure_future(reserving())
    await settle()
    assert requests.open_count_of("alice") == 1
    task.cancel()  # the client left during Reserve
    with pytest.raises(asyncio.CancelledError):
        await task
    deployment.coordinator_stub.reserve_gate.set()
    await settle()
    assert requests.open_count_of("alice") == 0 and requests.open_count == 0
