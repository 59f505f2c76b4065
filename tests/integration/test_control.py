"""openengine.v1.Control and grpc.health.v1 on the public frontend."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from openengine_serve.api.openengine.v1 import kv_pb2, lifecycle_pb2, lora_pb2, model_pb2, server_pb2

from .processes import wait_for


def only_the_shared_nodes(client) -> None:
    """Other tests may add a node of their own to the shared coordinator and stop it: it stays listed while
    it drains and until it expires. Wait for the table to hold only the two shared nodes."""

    def ranks():
        return sorted(
            r.data_parallel_rank
            for r in client.control.GetLoad(server_pb2.GetLoadRequest(include_per_rank=True), timeout=5).ranks
        )

    wait_for(lambda: ranks() == [0, 1], 15, "only ranks 0 and 1 in the node table")


def test_server_info(stack):
    with stack.client() as client:
        only_the_shared_nodes(client)
        info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
        again = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
    assert info.schema_revision == 1 and info.minimum_client_revision == 1
    assert info.schema_release == "openengine@4def7c50b05e0674a0c3b26917399155535966e4"
    assert info.engine_role == server_pb2.ENGINE_ROLE_AGGREGATED
    assert info.instance_id and info.instance_id == again.instance_id
    assert "Qwen/Qwen3-0.6B" in info.supported_models
    assert info.kv_connector.HasField("enabled") and info.kv_connector.enabled is False
    assert info.parallelism.data_parallel_size == 2
    assert info.capacity.max_running_requests == 2 * 256
    assert info.extra["grpc_server"] == stack.server


def test_model_info_reports_every_capability(stack):
    with stack.client() as client:
        info = client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model="qwen3"), timeout=5)
        with pytest.raises(grpc.RpcError) as missing:
            client.control.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as unknown:
            client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model="llama"), timeout=5)
    assert missing.value.code() == unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.served_model_name == "Qwen/Qwen3-0.6B"
    assert info.max_context_length == 40960 and info.max_output_tokens == 8192
    assert info.supports_text_input and info.supports_token_ids_input
    assert info.HasField("supports_lora") and not info.supports_lora
    assert info.HasField("supports_multimodal") and not info.supports_multimodal
    gen = info.generation
    assert gen.guided_decoding.HasField("supported") and not gen.guided_decoding.supported
    assert gen.output_logprobs.supported and gen.prompt_logprobs.supported
    assert gen.max_num_sequences == 8


@pytest.mark.parametrize(
    "call,req",
    [
        ("LoadLora", lora_pb2.LoadLoraRequest()),
        ("UnloadLora", lora_pb2.UnloadLoraRequest(lora_name="x")),
        ("ListLoras", lora_pb2.ListLorasRequest()),
    ],
)
def test_lora_is_not_enabled(stack, call, req):
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as err:
            getattr(client.control, call)(req, timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "LoRA" in err.value.details()


def test_kv_calls(stack):
    with stack.client() as client:
        assert list(client.control.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest(), timeout=5).sources) == []
        with pytest.raises(grpc.RpcError) as err:
            list(client.control.SubscribeKvEvents(kv_pb2.SubscribeKvEventsRequest(), timeout=5))
        with pytest.raises(grpc.RpcError) as session:
            client.control.Abort(lifecycle_pb2.AbortRequest(kv_session=kv_pb2.KvSessionRef(session_id="s")), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert session.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_ready_with_inference_probe(stack):
    with stack.client() as client:
        plain = client.control.Health(lifecycle_pb2.HealthRequest(), timeout=10)
        probed = client.control.Health(lifecycle_pb2.HealthRequest(include_inference_probe=True), timeout=10)
        statuses = {
            s: client.health.Check(health_pb2.HealthCheckRequest(service=s), timeout=5).status
            for s in ("liveness", "readiness", "openengine.v1.Inference", "openengine.v1.Control")
        }
    assert plain.state == lifecycle_pb2.HEALTH_STATE_READY
    assert [c.name for c in plain.checks] == ["grpc", "coordinator", "scheduler", "model"]
    assert probed.state == lifecycle_pb2.HEALTH_STATE_READY
    assert probed.checks[-1].name == "inference_probe"
    assert set(statuses.values()) == {health_pb2.HealthCheckResponse.SERVING}


def test_get_load_has_timestamp_and_ranks(stack):
    with stack.client() as client:
        only_the_shared_nodes(client)
        load = client.control.GetLoad(server_pb2.GetLoadRequest(include_per_rank=True), timeout=5)
    assert load.HasField("timestamp_unix_nanos") and load.HasField("running_requests")
    assert sorted(r.data_parallel_rank for r in load.ranks) == [0, 1]


def test_reflection_lists_public_services(stack):
    with grpc.insecure_channel(stack.frontend.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(
            stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        )
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"openengine.v1.Inference", "openengine.v1.Control", "grpc.health.v1.Health"} <= names
