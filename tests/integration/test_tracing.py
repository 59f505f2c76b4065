"""OpenTelemetry spans from all three processes reach a real OTLP receiver as one tree per Generate call."""

from __future__ import annotations

import os

import grpc
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from openengine_serve.client import Client

from . import processes
from .conftest import MODEL, SERVERS, request
from .otlp import Receiver

SERVER, CLIENT = trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CLIENT
GENERATE = "openengine.v1.Inference/Generate"
RESERVE = "openengine_internal.v1.Coordinator/Reserve"
SUBMIT = "openengine_internal.v1.Node/Submit"


class TracedCluster:
    """A coordinator and a node exporting to `receiver`; one frontend per gRPC server, started on first use."""

    def __init__(self, receiver: Receiver, coordinator: processes.Component) -> None:
        self.receiver, self.coordinator = receiver, coordinator
        self.frontends: dict[tuple[str, str], processes.Component] = {}

    def frontend(self, server: str, keys_file: str = "") -> processes.Component:
        """The frontend on `server` (API keys on with `keys_file`)."""
        if (server, keys_file) not in self.frontends:
            keys = {"OPENENGINE_API_KEYS_FILE": keys_file, "OPENENGINE_ALLOW_PLAINTEXT_KEYS": "1"} if keys_file else {}
            env = {**self.receiver.env(), **keys}
            fe = processes.frontend(self.coordinator.target, server, **env).start()
            self.frontends[(server, keys_file)] = fe
            fe.wait_ready(60)
            # the node is known to the frontend: the first request is not refused for want of one
            processes.wait_for(lambda: _ready_ranks(fe.target, keys_file) == 1, 20, "the node ready")
        return self.frontends[(server, keys_file)]


KEY_NAME, KEY_SECRET = "team-a", "s3cret-team-a"
KEY_METADATA = (("authorization", f"Bearer {KEY_SECRET}"),)


def _ready_ranks(target: str, keys_file: str = "") -> int:
    from openengine_serve.api.openengine.v1 import server_pb2

    with Client(target) as client:
        return client.control.GetServerInfo(
            server_pb2.GetServerInfoRequest(), timeout=2, metadata=KEY_METADATA if keys_file else ()
        ).parallelism.data_parallel_size


@pytest.fixture(scope="module")
def traced():
    with Receiver() as receiver:
        coord = processes.coordinator(**receiver.env())
        coord.name = "traced-coordinator"
        node = processes.node(coord.target, 0, **receiver.env())
        node.name = "traced-node0"
        cluster = TracedCluster(receiver, coord)
        try:
            coord.start().wait_ready()
            node.start().wait_ready(90)
            yield cluster
        finally:
            for fe in cluster.frontends.values():
                fe.stop()
            node.stop()
            coord.stop()


def by_name(spans, name, service):
    matches = [s for s in spans if s.name == name and s.service == service]
    assert len(matches) == 1, f"{name} from {service}: {[(s.service, s.name) for s in spans]}"
    return matches[0]


@pytest.mark.parametrize("server", SERVERS)
def test_one_tree_across_the_three_processes_under_the_clients_trace(traced, server):
    trace_id, client_span = os.urandom(16), os.urandom(8)
    req = request(max_tokens=12)
    with Client(traced.frontend(server).target) as client:
        responses = list(
            client.inference.Generate(
                req,
                timeout=30,
                metadata=(
                    ("traceparent", f"00-{trace_id.hex()}-{client_span.hex()}-01"),
                    ("tracestate", "vendor=opaque"),
                ),
            )
        )
    assert responses[-1].usage.completion_tokens == 12

    spans = traced.receiver.wait_for(trace_id, 5)
    assert len(spans) == 5  # nothing per token
    generate = by_name(spans, GENERATE, "openengine-frontend")
    reserve_client = by_name(spans, RESERVE, "openengine-frontend")
    submit_client = by_name(spans, SUBMIT, "openengine-frontend")
    reserve_server = by_name(spans, RESERVE, "openengine-coordinator")
    submit_server = by_name(spans, SUBMIT, "openengine-node")
    # the tree: client -> Generate -> (Reserve -> coordinator's Reserve, Submit -> node's Submit)
    assert generate.span.parent_span_id == client_span and generate.span.kind == SERVER
    for child in (reserve_client, submit_client):
        assert child.span.parent_span_id == generate.span.span_id and child.span.kind == CLIENT
    assert reserve_server.span.parent_span_id == reserve_client.span.span_id and reserve_server.span.kind == SERVER
    assert submit_server.span.parent_span_id == submit_client.span.span_id and submit_server.span.kind == SERVER
    assert {s.span.trace_state for s in spans} == {"vendor=opaque"}  # the client's tracestate is kept

    attributes = generate.attributes
    assert attributes["openengine.request_id"] == req.request_id
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.usage.input_tokens"] == responses[-1].usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == 12
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["rpc.system"] == "grpc" and attributes["openengine.grpc_server"] == server
    assert "openengine.key_name" not in attributes  # API keys are off
    assert generate.events == ["queued", "first_token", "finished"]
    assert generate.span.status.code != trace_pb2.Status.STATUS_CODE_ERROR
    assert reserve_server.attributes["openengine.request_id"] == req.request_id
    assert submit_server.attributes["openengine.request_id"] == req.request_id
    assert reserve_server.attributes["openengine.node_id"] == submit_server.attributes["openengine.node_id"]
    # the child spans lie within the request's span
    for child in (reserve_client, submit_client):
        assert generate.span.start_time_unix_nano <= child.span.start_time_unix_nano
        assert child.span.end_time_unix_nano <= generate.span.end_time_unix_nano


@pytest.mark.parametrize("server", SERVERS)
def test_a_call_without_traceparent_starts_a_trace_and_a_refusal_is_an_error_span(traced, server):
    req = request(max_tokens=3)
    refused = request(max_tokens=3)
    refused.model = "no-such-model"
    with Client(traced.frontend(server).target, retries=False) as client:
        list(client.inference.Generate(req, timeout=30))
        with pytest.raises(grpc.RpcError) as error:
            list(client.inference.Generate(refused, timeout=30))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND

    def generate_span(request_id):
        found = processes.wait_for(
            lambda: [
                s
                for s in traced.receiver.all_spans()
                if s.name == GENERATE and s.attributes.get("openengine.request_id") == request_id
            ],
            10,
            f"the span of {request_id}",
        )
        return found[0]

    root = generate_span(req.request_id)
    assert root.span.parent_span_id == b""  # a new trace
    spans = traced.receiver.wait_for(root.span.trace_id, 5)
    assert {(s.service, s.name) for s in spans} == {
        ("openengine-frontend", GENERATE),
        ("openengine-frontend", RESERVE),
        ("openengine-frontend", SUBMIT),
        ("openengine-coordinator", RESERVE),
        ("openengine-node", SUBMIT),
    }

    rejected = generate_span(refused.request_id)
    assert rejected.span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert "no-such-model" in rejected.span.status.message
    assert rejected.attributes["rpc.grpc.status_code"] == "NOT_FOUND"
    assert rejected.events == []  # refused before it was queued
    assert traced.receiver.spans(rejected.span.trace_id) == [rejected]


@pytest.mark.parametrize("server", SERVERS)
def test_a_trace_the_client_did_not_sample_is_recorded_nowhere(traced, server):
    """flags 00: the frontend records nothing and passes the unsampled context on, so neither the coordinator
    nor the node records its part (spans of a later sampled call arriving show the pipeline was flushed)."""
    unsampled, sampled = os.urandom(16), os.urandom(16)
    with Client(traced.frontend(server).target) as client:
        for trace_id, flags in ((unsampled, "00"), (sampled, "01")):
            list(
                client.inference.Generate(
                    request(max_tokens=4),
                    timeout=30,
                    metadata=(("traceparent", f"00-{trace_id.hex()}-{os.urandom(8).hex()}-{flags}"),),
                )
            )
    assert len(traced.receiver.wait_for(sampled, 5)) == 5
    assert traced.receiver.spans(unsampled) == []


@pytest.mark.parametrize("server", SERVERS)
def test_the_callers_key_name_is_on_the_span_when_keys_are_on(traced, server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"user {KEY_NAME} {KEY_SECRET}\n")
    trace_id = os.urandom(16)
    with Client(traced.frontend(server, str(keys)).target) as client:
        list(
            client.inference.Generate(
                request(max_tokens=3),
                timeout=30,
                metadata=KEY_METADATA + (("traceparent", f"00-{trace_id.hex()}-{os.urandom(8).hex()}-01"),),
            )
        )
    spans = traced.receiver.wait_for(trace_id, 5)
    assert by_name(spans, GENERATE, "openengine-frontend").attributes["openengine.key_name"] == KEY_NAME
    assert KEY_SECRET not in repr([s.span for s in spans])  # the name, never the secret
