"""API keys and roles on the public port, on both gRPC servers (real frontends sharing the session's nodes)."""

from __future__ import annotations

import time
import urllib.request
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openengine_serve.api.openengine.v1 import (
    generation_pb2 as G,
)
from openengine_serve.api.openengine.v1 import (
    kv_pb2,
    lifecycle_pb2,
    lora_pb2,
    model_pb2,
    server_pb2,
)
from openengine_serve.client import Client, Credentials
from openengine_serve.frontend import auth

from . import processes
from .conftest import SERVERS

MODEL = "Qwen/Qwen3-0.6B"
KEYS = {
    "ops": ("admin", "k-admin-3f9"),
    "alice": ("user", "k-alice-77a"),
    "bob": ("user", "k-bob-0c1"),
    "carol": ("user", "k-carol-5e2"),
}


KEY_MAX_IN_FLIGHT = 2  # the frontends' default per-key limit (OPENENGINE_API_KEY_MAX_IN_FLIGHT)


def key_file_text(names=tuple(KEYS), options: dict[str, str] | None = None) -> str:
    options = options or {}
    return "# role name secret\n" + "".join(f"{KEYS[n][0]} {n} {KEYS[n][1]} {options.get(n, '')}\n" for n in names)


@pytest.fixture(scope="module", params=SERVERS)
def keyed(request, cluster, tmp_path_factory):
    """Two frontends of one server implementation reading one key file; the first serves metrics."""
    coord, _nodes = cluster
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(key_file_text())
    metrics_port = processes.free_port()
    frontends = [
        processes.frontend(
            coord.target,
            request.param,
            OPENENGINE_API_KEYS_FILE=str(path),
            OPENENGINE_ALLOW_PLAINTEXT_KEYS="1",  # loopback, no TLS
            OPENENGINE_API_KEY_MAX_IN_FLIGHT=str(KEY_MAX_IN_FLIGHT),
        )
        for _ in range(2)
    ]
    frontends[0].args[frontends[0].args.index("--metrics-port") + 1] = str(metrics_port)
    try:
        for f in frontends:
            f.start()
        for f in frontends:
            f.wait_ready(60)
        processes.wait_for(lambda: _ready_ranks(frontends[0].target) == 2, 20, "both nodes ready")
        yield frontends, path, metrics_port
    finally:
        for f in frontends:
            f.stop()


def _ready_ranks(target: str) -> int:
    with client_for(target, "ops") as c:
        return c.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=2).parallelism.data_parallel_size


def client_for(target: str, name: str | None = None, secret: str | None = None) -> Client:
    key = secret if secret is not None else (KEYS[name][1] if name else "")
    return Client(target, credentials=Credentials(api_key=key), retries=False)


def long_request(max_tokens: int = 3000) -> G.GenerateRequest:
    return G.GenerateRequest(
        request_id=f"sec-{uuid.uuid4()}",
        model=MODEL,
        prompt="Tell a long story",
        stopping=G.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_no_or_unknown_key_is_refused_before_validation(keyed):
    frontends, _, _ = keyed
    bad = G.GenerateRequest(request_id="", model="no-such-model")  # would be INVALID_ARGUMENT
    for client in (client_for(frontends[0].target), client_for(frontends[0].target, secret="k-nobody")):
        with client:
            code, details = code_of(lambda: list(client.inference.Generate(bad, timeout=5)))
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
            code, _ = code_of(lambda: client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED
    with client_for(frontends[0].target, secret="") as anonymous:
        assert (
            "authorization: Bearer"
            in code_of(lambda: anonymous.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5))[1]
        )
    with client_for(frontends[0].target, "alice") as alice:
        assert code_of(lambda: list(alice.inference.Generate(bad, timeout=5)))[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection_need_no_key(keyed):
    frontends, _, _ = keyed
    with grpc.insecure_channel(frontends[0].target) as channel:
        status = (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            .status
        )
        replies = list(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "openengine.v1.Inference" in {s.name for s in replies[0].list_services_response.service}


def test_user_role_reaches_its_calls_and_nothing_else(keyed):
    frontends, _, _ = keyed
    with client_for(frontends[0].target, "alice") as alice, client_for(frontends[0].target, "ops") as ops:
        assert alice.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5).instance_id
        assert alice.control.GetModelInfo(model_pb2.GetModelInfoRequest(model=MODEL), timeout=5).max_context_length
        assert alice.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5).timestamp_unix_nanos
        assert alice.control.Health(lifecycle_pb2.HealthRequest(), timeout=5).checks
        responses = list(alice.inference.Generate(long_request(5), timeout=30))
        assert responses[-1].HasField("usage")
        for call, request in (
            ("LoadLora", lora_pb2.LoadLoraRequest()),
            ("ListLoras", lora_pb2.ListLorasRequest()),
            ("GetKvEventSources", kv_pb2.GetKvEventSourcesRequest()),
        ):
            code, details = code_of(lambda: getattr(alice.control, call)(request, timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "'alice' has role user" in details
        # the admin passes the key check and gets the call's own answer
        assert (
            code_of(lambda: ops.control.ListLoras(lora_pb2.ListLorasRequest(), timeout=5))[0]
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        assert list(ops.control.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest(), timeout=5).sources) == []
        code, details = code_of(
            lambda: alice.control.Abort(lifecycle_pb2.AbortRequest(all_requests=lifecycle_pb2.AllRequests()), timeout=5)
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and "all_requests needs role admin" in details
        assert (
            ops.control.Abort(lifecycle_pb2.AbortRequest(all_requests=lifecycle_pb2.AllRequests()), timeout=5).status
            == lifecycle_pb2.ABORT_STATUS_ABORTED
        )


def test_abort_reaches_only_the_callers_own_requests_across_frontends(keyed):
    frontends, _, _ = keyed
    first, second = (f.target for f in frontends)
    with (
        client_for(first, "alice") as alice,
        client_for(second, "alice") as alice_elsewhere,
        client_for(second, "bob") as bob,
        client_for(second, "ops") as ops,
    ):
        for aborter in (alice_elsewhere, ops):
            request = long_request()
            stream = alice.inference.Generate(request, timeout=60)
            assert next(stream).HasField("token")
            # bob cannot tell alice's id from an id never used
            code, details = code_of(
                lambda: bob.control.Abort(lifecycle_pb2.AbortRequest(request_id=request.request_id), timeout=5)
            )
            unknown_id = f"sec-{uuid.uuid4()}"
            unknown_code, unknown_details = code_of(
                lambda: bob.control.Abort(lifecycle_pb2.AbortRequest(request_id=unknown_id), timeout=5)
            )
            assert code == unknown_code == grpc.StatusCode.NOT_FOUND
            assert details.replace(request.request_id, "ID") == unknown_details.replace(unknown_id, "ID")
            reply = aborter.control.Abort(lifecycle_pb2.AbortRequest(request_id=request.request_id), timeout=5)
            assert reply.status == lifecycle_pb2.ABORT_STATUS_ABORTED, reply
            finished = [r.finished for r in stream if r.HasField("finished")]
            assert [f.reason for f in finished] == [G.FINISH_REASON_CANCELLED]


IN_FLIGHT = 8  # streams open during the Abort-all calls, half on each frontend


def open_streams(clients: list[Client], max_tokens: int) -> list[tuple[G.GenerateRequest, object]]:
    """IN_FLIGHT streams spread over `clients`, each past its first token (so running on a node)."""
    streams = []
    for i in range(IN_FLIGHT):
        request = long_request(max_tokens)
        streams.append((request, clients[i % len(clients)].inference.Generate(request, timeout=120)))
    for _, stream in streams:
        assert next(stream).HasField("token")
    return streams


def finished_outputs(stream) -> tuple[list[G.GenerationFinished], G.Usage]:
    """The rest of a stream: its `finished` events and the usage on its last message."""
    responses = list(stream)
    return [r.finished for r in responses if r.HasField("finished")], responses[-1].usage


def test_abort_all_needs_the_admin_role_and_then_ends_every_stream_in_flight(keyed):
    frontends, path, _ = keyed
    first, second = (f.target for f in frontends)
    path.write_text(key_file_text(options={"alice": f"max_in_flight={IN_FLIGHT // 2}"}))  # per frontend worker
    time.sleep(auth.RELOAD_CHECK_S + 0.1)
    abort_all = lifecycle_pb2.AbortRequest(all_requests=lifecycle_pb2.AllRequests())
    try:
        with (
            client_for(first, "alice") as alice,
            client_for(second, "alice") as alice_elsewhere,
            client_for(second, "ops") as ops,
        ):
            alice.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5)  # the first call after the change reloads
            alice_elsewhere.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5)
            # a user's Abort-all is refused, and every stream, its own included, runs to its end
            streams = open_streams([alice, alice_elsewhere], max_tokens=1000)
            code, details = code_of(lambda: alice.control.Abort(abort_all, timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED and "all_requests needs role admin" in details
            for request, stream in streams:
                finished, usage = finished_outputs(stream)
                assert [f.reason for f in finished] == [G.FINISH_REASON_LENGTH], request.request_id
                assert usage.completion_tokens == 1000
            # the admin's Abort-all, sent to the other frontend, ends every stream of both frontends
            streams = open_streams([alice, alice_elsewhere], max_tokens=3000)
            assert ops.control.Abort(abort_all, timeout=5).status == lifecycle_pb2.ABORT_STATUS_ABORTED
            for request, stream in streams:
                finished, usage = finished_outputs(stream)  # ends OK: a cancel, then usage (SEMANTICS: Abort)
                assert [(f.output_index, f.reason) for f in finished] == [(0, G.FINISH_REASON_CANCELLED)], (
                    request.request_id
                )
                assert 1 <= usage.completion_tokens < 3000
    finally:
        path.write_text(key_file_text())


def test_a_removed_key_stops_within_one_second_and_its_running_stream_is_not_cut(keyed):
    frontends, path, _ = keyed
    with client_for(frontends[0].target, "carol") as carol:
        stream = carol.inference.Generate(long_request(1500), timeout=60)
        assert next(stream).HasField("token")
        path.write_text(key_file_text(("ops", "alice", "bob")))
        removed_at = time.monotonic()
        try:

            def refused() -> bool:
                try:
                    carol.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5)
                    return False
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                    return True

            processes.wait_for(refused, 5, "the removed key to be refused", interval=0.05)
            assert time.monotonic() - removed_at <= 1.0, "README: a removed key is refused within 1 s"
            responses = list(stream)
            assert responses[-1].HasField("usage") and responses[-1].usage.completion_tokens == 1500
        finally:
            path.write_text(key_file_text())
    with client_for(frontends[0].target, "carol") as carol:
        processes.wait_for(lambda: _works(carol), 5, "the restored key to work")


def _works(client: Client) -> bool:
    try:
        client.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5)
        return True
    except grpc.RpcError:
        return False


def test_key_name_labels_the_log_line_and_the_metric_and_secrets_are_never_logged(keyed):
    frontends, _, metrics_port = keyed
    with client_for(frontends[0].target, "bob") as bob:
        assert list(bob.inference.Generate(long_request(3), timeout=30))[-1].HasField("usage")
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert 'openengine_frontend_requests_total{code="OK",key="bob",status="finished"}' in body
    log = (processes.LOG_DIR / f"{frontends[0].name}-{frontends[0].port}.log").read_text()
    assert any("request ended" in line and "key=bob" in line for line in log.splitlines())
    for _role, secret in KEYS.values():
        assert secret not in log


def test_a_key_beyond_its_concurrency_limit_is_refused_at_once_and_every_ending_frees_its_count(keyed):
    frontends, path, metrics_port = keyed
    first, second = (f.target for f in frontends)
    path.write_text(key_file_text(options={"alice": "max_in_flight=1"}))  # bob keeps the default (2)
    time.sleep(auth.RELOAD_CHECK_S + 0.1)
    before = processes.scrape(metrics_port)
    refusals = {"alice": 1, "bob": 1}  # the refusals the test asks for; polls below add theirs
    try:
        with (
            client_for(first, "alice") as alice,
            client_for(first, "bob") as bob,
            client_for(first, "ops") as ops,
            client_for(second, "alice") as alice_elsewhere,
        ):
            alice.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5)  # the first call after the change reloads
            bob_requests = [long_request() for _ in range(2)]
            streams = {
                "alice": [alice.inference.Generate(long_request(), timeout=60)],
                "bob": [bob.inference.Generate(r, timeout=60) for r in bob_requests],
            }
            for stream in streams["alice"] + streams["bob"]:
                assert next(stream).HasField("token")
            for client, name, limit, source in (
                (alice, "alice", 1, "its max_in_flight in OPENENGINE_API_KEYS_FILE"),
                (bob, "bob", 2, "OPENENGINE_API_KEY_MAX_IN_FLIGHT"),
            ):
                started = time.monotonic()
                with pytest.raises(grpc.RpcError) as refused:
                    list(client.inference.Generate(long_request(3), timeout=10))
                assert time.monotonic() - started < 1.0
                error = refused.value
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (error.code(), error.details())
                assert error.details() == (
                    f"API key {name!r} has its maximum of {limit} streams open on this frontend "
                    f"worker ({source}); retry in 1000 ms"
                )
                assert ("openengine-retry-after-ms", "1000") in (error.trailing_metadata() or ())
            # counted per frontend worker: alice's stream on the first frontend does not count on the second
            assert list(alice_elsewhere.inference.Generate(long_request(3), timeout=30))[-1].HasField("usage")
            # every ending frees the count: a cancel (the client going away), an Abort, a finished stream
            streams["alice"][0].cancel()
            processes.wait_for(lambda: _generates(alice, refusals, "alice"), 10, "alice's count freed by the cancel")
            reply = ops.control.Abort(lifecycle_pb2.AbortRequest(request_id=bob_requests[0].request_id), timeout=5)
            assert reply.status == lifecycle_pb2.ABORT_STATUS_ABORTED
            assert [r.finished.reason for r in streams["bob"][0] if r.HasField("finished")] == [
                G.FINISH_REASON_CANCELLED
            ]
            processes.wait_for(lambda: _generates(bob, refusals, "bob"), 10, "bob's count freed by the abort")
            for _ in range(2):
                assert _generates(alice, refusals, "alice")
            streams["bob"][1].cancel()
            processes.wait_for(lambda: _generates(bob, refusals, "bob"), 10, "bob's count freed by the cancel")
    finally:
        path.write_text(key_file_text())
    after = processes.scrape(metrics_port)
    for name, refused_calls in refusals.items():  # every refusal counted once, the polls' included
        labels = dict(status="rejected", code="RESOURCE_EXHAUSTED", key=name)
        assert (
            processes.metric(after, "openengine_frontend_requests_total", **labels)
            - processes.metric(before, "openengine_frontend_requests_total", **labels)
            == refused_calls
        )
    reason = dict(reason="key_at_limit")
    assert processes.metric(after, "openengine_frontend_refusals_total", **reason) - processes.metric(
        before, "openengine_frontend_refusals_total", **reason
    ) == sum(refusals.values())
    log = (processes.LOG_DIR / f"{frontends[0].name}-{frontends[0].port}.log").read_text()
    for _role, secret in KEYS.values():
        assert secret not in log


def _generates(client: Client, refusals: dict[str, int], name: str) -> bool:
    """A short stream finished; False when refused because the key is at its limit (counted in `refusals`)."""
    try:
        return list(client.inference.Generate(long_request(3), timeout=30))[-1].HasField("usage")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (exc.code(), exc.details())
        refusals[name] += 1
        return False
