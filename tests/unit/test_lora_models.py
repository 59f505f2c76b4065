"""An adapter fits one base model: the coordinator lists it for the models whose nodes loaded it (coordinator/
server.py adapter_fits, coordinator/loras.py), and a frontend accepts its name only on a request for one of them
(frontend/coordinator_client.py lora_for)."""

from __future__ import annotations

import grpc
import pytest

from openengine_serve.api.openengine.v1 import lora_pb2
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.coordinator.loras import LoraTable
from openengine_serve.coordinator.server import adapter_fits
from openengine_serve.frontend.nodes import NodeConnections
from openengine_serve.frontend.refusal import NotServed
from openengine_serve.frontend.tasks import BackgroundTasks

from .frontend_fakes import FakeCoordinatorStub, coordinator_client, rpc_error

REFUSED = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "could not load the LoRA adapter")
AT_LIMIT = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "this node holds 8 adapters")


def node(node_id: str, model: str) -> cluster_pb2.NodeEntry:
    return cluster_pb2.NodeEntry(node_id=node_id, model=cluster_pb2.ModelCard(name=model))


def test_the_models_whose_nodes_all_loaded_it_take_it():
    fits, failure = adapter_fits([(node("a0", "A"), None), (node("a1", "A"), None), (node("b0", "B"), REFUSED)])
    assert fits == {"A"} and failure is None


def test_one_node_of_a_model_refusing_leaves_that_model_out():
    fits, failure = adapter_fits([(node("a0", "A"), None), (node("a1", "A"), REFUSED), (node("b0", "B"), None)])
    assert fits == {"B"} and failure is None


def test_no_model_taking_it_or_a_node_at_its_limit_fails_the_load():
    results = [(node("a0", "A"), REFUSED), (node("b0", "B"), REFUSED)]
    assert adapter_fits(results) == (set(), results[0])
    results = [(node("a0", "A"), None), (node("b0", "B"), AT_LIMIT)]
    fits, failure = adapter_fits(results)
    assert failure == results[1], "a node's trouble is not a model refusing the file"


def test_the_table_lists_an_adapter_for_each_model_that_took_it():
    table = LoraTable()
    sea = lora_pb2.LoraAdapter(lora_name="sea", source_path="/l/sea.gguf")
    listed, already = table.add(sea, {"A"})
    assert not already and listed.lora_id == 1
    assert table.add(sea, {"C"}) == (listed, True)
    assert [(m.lora_name, list(m.models)) for m in table.served_models()] == [("sea", ["A", "C"])]
    table.remove("sea")
    assert table.served_models() == [] and not table.adapters


@pytest.fixture
async def client():
    nodes = NodeConnections("fe-test", BackgroundTasks(), connect_timeout_s=1.0, call_timeout_s=1.0)
    return coordinator_client(FakeCoordinatorStub(), nodes)


async def test_a_frontend_accepts_an_adapter_only_for_its_models(client):
    sea = lora_pb2.LoraAdapter(lora_id=1, lora_name="sea", source_path="/l/sea.gguf")
    reply = cluster_pb2.HeartbeatReply(
        known=True, loras=[sea], lora_models=[cluster_pb2.LoraModels(lora_name="sea", models=["A"])]
    )
    client._heartbeat_answered(client.shards[0], reply)
    assert client.lora_for("sea", "A") == sea
    with pytest.raises(NotServed, match="'sea' serves the model.s. A, not 'B'"):
        client.lora_for("sea", "B")
    with pytest.raises(NotServed, match=r"no LoRA adapter named 'lake' is loaded \(loaded: 'sea'\)"):
        client.lora_for("lake", "A")
    client._heartbeat_answered(client.shards[0], cluster_pb2.HeartbeatReply(known=True, loras=[sea]))
    assert client.lora_for("sea", "B") == sea, "a coordinator that names no models: any model"
