"""The frontend's served model (frontend/served_model.py): learned from a node's GetModel over real gRPC on
loopback, with the operator's overrides, reloaded when every ready node serves another model."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from openengine_serve.api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from openengine_serve.common.config import FrontendConfig
from openengine_serve.common.tokenizers import Qwen3Tokenizer
from openengine_serve.engine.model_card import simulated_card
from openengine_serve.frontend import served_model
from openengine_serve.frontend.served_model import ServedModel

READY, DOWN = cluster_pb2.NODE_STATE_READY, cluster_pb2.NODE_STATE_DOWN


class FakeNode(cluster_pb2_grpc.NodeServicer):
    def __init__(self, card: cluster_pb2.ModelCard) -> None:
        self.card = card
        self.calls = 0
        self.refuse = False

    async def GetModel(self, request, context):
        self.calls += 1
        if self.refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not now")
        return self.card


@contextlib.asynccontextmanager
async def serving(card: cluster_pb2.ModelCard):
    """A fake node answering GetModel with `card` on a loopback port: (its servicer, its address)."""
    servicer = FakeNode(card)
    server = grpc.aio.server()
    cluster_pb2_grpc.add_NodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture
async def node():
    async with serving(simulated_card()) as served:
        yield served


def table(address: str, card: cluster_pb2.ModelCard, state=READY, node_id="n0") -> dict:
    summary = cluster_pb2.ModelCard()
    summary.CopyFrom(card)
    summary.ClearField("tokenizer_data")
    return {node_id: cluster_pb2.NodeEntry(node_id=node_id, address=address, state=state, model=summary)}


async def loaded(model: ServedModel) -> None:
    await asyncio.wait_for(model.changed.wait(), 10)
    model.changed.clear()


async def test_the_model_of_a_ready_node_is_loaded_with_its_limits(node):
    servicer, address = node
    model = ServedModel(FrontendConfig(), grpc.aio.insecure_channel)
    model.on_node_table(table(address, servicer.card, state=DOWN))
    await asyncio.sleep(0.3)
    assert model.loaded is None and servicer.calls == 0, "only a ready node's model"
    nodes = table(address, servicer.card)
    assert not model.ready_on(nodes.values())
    model.on_node_table(nodes)
    await loaded(model)
    limits = model.loaded.limits
    assert isinstance(model.loaded.tokenizer, Qwen3Tokenizer)
    assert (limits.served_model_name, limits.aliases) == ("Qwen/Qwen3-0.6B", ("qwen3",))
    assert (limits.max_context_length, limits.max_output_tokens, limits.vocab_size) == (40960, 8192, 151669)
    assert limits.max_prompt_bytes == 512 * 1024, "16 per token of the context, at most what Generate messages carry"
    assert model.ready_on(nodes.values())
    model.on_node_table(nodes)
    assert servicer.calls == 1, "the same model is not fetched again"


async def test_the_operators_settings_override_the_card_and_the_context_only_shrinks(node):
    servicer, address = node
    config = FrontendConfig(
        model="my-name", model_aliases="a,b", max_context_length=100_000, max_output_tokens=64, max_prompt_bytes=5000
    )
    model = ServedModel(config, grpc.aio.insecure_channel)
    model.on_node_table(table(address, servicer.card))
    await loaded(model)
    limits = model.loaded.limits
    assert (limits.served_model_name, limits.aliases) == ("my-name", ("a", "b"))
    assert (limits.max_context_length, limits.max_output_tokens, limits.max_prompt_bytes) == (40960, 64, 5000)


async def test_a_failed_fetch_is_tried_again_at_the_next_table(node):
    servicer, address = node
    servicer.refuse = True
    model = ServedModel(FrontendConfig(), grpc.aio.insecure_channel)
    model.on_node_table(table(address, servicer.card))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if servicer.calls:
            break
    await asyncio.sleep(0.1)
    assert model.loaded is None
    servicer.refuse = False
    model.on_node_table(table(address, servicer.card))
    await loaded(model)
    assert servicer.calls == 2


async def test_nodes_of_another_model_make_the_frontend_load_it(node):
    servicer, address = node
    model = ServedModel(FrontendConfig(), grpc.aio.insecure_channel)
    model.on_node_table(table(address, servicer.card))
    await loaded(model)
    other = cluster_pb2.ModelCard()
    other.CopyFrom(servicer.card)
    other.name, other.tokenizer_digest = "other-model", "f" * 64
    servicer.card = other
    nodes = table(address, other, node_id="n1")
    assert not model.ready_on(nodes.values()), "the ready node serves a model this frontend has not loaded"
    model.on_node_table(nodes)
    await loaded(model)
    assert model.for_name("other-model") is not None and model.ready_on(nodes.values())


async def test_a_model_card_beyond_the_bound_is_refused_before_it_is_kept(node, monkeypatch):
    """A node (or a container posing as one) cannot make the frontend take a tokenizer of any size."""
    monkeypatch.setattr(served_model, "MAX_MODEL_CARD_BYTES", 1 << 20)  # (64 MiB by default)
    servicer, address = node
    big = cluster_pb2.ModelCard()
    big.CopyFrom(servicer.card)
    big.tokenizer_data = b"\0" * (1 << 20)
    servicer.card = big
    model = ServedModel(FrontendConfig(), grpc.aio.insecure_channel)
    model.on_node_table(table(address, big))
    await asyncio.wait_for(model._loading[big.name][1], 30)
    assert servicer.calls == 1 and model.loaded is None


@pytest.fixture
async def other_node():
    card = cluster_pb2.ModelCard()
    card.CopyFrom(simulated_card())
    card.name, card.tokenizer_digest, card.context_length = "other-model", "f" * 64, 1024
    del card.aliases[:]
    async with serving(card) as served:
        yield served


async def test_nodes_of_two_models_make_two_models_each_with_its_limits(node, other_node):
    (first, first_address), (second, second_address) = node, other_node
    model = ServedModel(FrontendConfig(model="renamed", max_output_tokens=64), grpc.aio.insecure_channel)
    nodes = table(first_address, first.card)
    model.on_node_table(nodes)
    await loaded(model)
    assert model.names() == ["renamed", "qwen3"], "the operator's name applies to a deployment of one model"
    nodes |= table(second_address, second.card, node_id="n1")
    model.on_node_table(nodes)
    while len(model.models) < 2:
        await loaded(model)
    assert model.names() == ["Qwen/Qwen3-0.6B", "qwen3", "other-model"], "with several, each keeps its card's"
    assert model.for_name("qwen3") is model.models["Qwen/Qwen3-0.6B"] is model.loaded
    other = model.for_name("other-model")
    assert other is not None and other.limits.max_context_length == 1024 and other.limits.max_output_tokens == 64
    assert model.for_name("renamed") is None
    model.on_node_table({})  # a coordinator that restarted: an empty table first
    assert model.names() == ["Qwen/Qwen3-0.6B", "qwen3", "other-model"], "the models stay"
