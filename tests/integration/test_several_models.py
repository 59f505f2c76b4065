"""Several models in one deployment: `openengine-serve up --nodes 2` with SmolLM2 on node 0 and Gemma 3 270M on
node 1, on both gRPC servers. One frontend answers both models, each tokenized with its own tokenizer and run on
its own node (greedy output equals llama-cpp-python's on that model's file); ServerInfo, ModelInfo and the HTTP
API's model list name both; an unknown model gets NOT_FOUND naming both. A LoRA adapter made for SmolLM2 serves
SmolLM2's requests only (Gemma's node refuses its file)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from google.protobuf import json_format

from openengine_serve.api.openengine.v1 import lora_pb2, model_pb2, server_pb2
from openengine_serve.client import Client
from openengine_serve.engine.model_card import default_model_path

from ..greedy_reference import llama_reference
from . import processes
from .conftest import REAL_MODEL, SERVERS, generate, make_request, output_ids
from .test_architectures import GEMMA, GEMMA_PATH
from .test_local_stack import first_line

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from make_test_lora import write_adapter  # noqa: E402

MAX_TOKENS = 12


@dataclass
class TwoModels:
    target: str
    http_url: str


@pytest.fixture(scope="module", params=SERVERS)
def two_models(request, tmp_path_factory):
    assert GEMMA_PATH.is_file(), f"{GEMMA_PATH} is missing: run scripts/bootstrap.sh dev"
    port, http_port = processes.free_port(), processes.free_port()
    log = (tmp_path_factory.mktemp("up") / "up.log").open("w")
    lora_dir = tmp_path_factory.mktemp("loras")
    write_adapter(Path(default_model_path()), lora_dir / "sea.gguf")  # SmolLM2's shapes
    proc = subprocess.Popen(
        [sys.executable, "-m", "openengine_serve", "up", "--port", str(port), "--http-port", str(http_port)]
        + ["--nodes", "2", "--grpc-server", request.param]
        + ["--model-path", str(default_model_path()), "--model-path", str(GEMMA_PATH)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=os.environ | {"OPENENGINE_LORA_DIR": str(lora_dir)},
    )
    try:
        assert "ready on" in first_line(proc)
        target = f"127.0.0.1:{port}"

        def both_loaded() -> bool:
            with Client(target) as client:
                info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
            return {REAL_MODEL, GEMMA} <= set(info.supported_models)

        processes.wait_for(both_loaded, 60, "the frontend to load both models")
        yield TwoModels(target, f"http://127.0.0.1:{http_port}/v1")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def references():
    return {REAL_MODEL: llama_reference(str(default_model_path())), GEMMA: llama_reference(str(GEMMA_PATH))}


def reference_greedy(reference, ids: list[int]) -> list[int]:
    out = []
    for token in reference.generate(ids, temp=0.0, reset=True):
        if reference.token_eos() == token or len(out) == MAX_TOKENS:
            break
        out.append(token)
    return out


TEXTS = ("The three primary colors are", "def fibonacci(n):", "Once upon a time")


def test_one_frontend_answers_both_models_each_with_its_own_tokenizer(two_models, references):
    """Each model's requests (3 each, alternating: a request on the other model's node would be caught) are
    tokenized with its tokenizer and continued as llama-cpp-python continues them on its file."""
    for text in TEXTS:
        for model, reference in references.items():
            ids = reference.tokenize(text.encode(), add_bos=True, special=True)
            req = make_request(text, max_tokens=MAX_TOKENS)
            req.model = model
            responses = generate(two_models.target, req)
            assert responses[-1].usage.prompt_tokens == len(ids), f"{model}: tokenized with its own tokenizer"
            served = output_ids(responses)
            expected = reference_greedy(reference, ids)
            assert served == expected[: len(served)] and served, f"{model} {text!r}: {served} vs {expected}"


def test_server_and_model_info_name_both_and_an_unknown_model_is_refused_naming_them(two_models):
    with Client(two_models.target) as client:
        info = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5)
        assert info.parallelism.data_parallel_size == 2
        vocab = {}
        for model in (REAL_MODEL, GEMMA):
            model_info = client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model=model), timeout=5)
            assert model_info.served_model_name == model
            vocab[model] = model_info.extra["vocab_size"]
        assert vocab == {REAL_MODEL: 49152, GEMMA: 262144}
        load = client.control.GetLoad(server_pb2.GetLoadRequest(), timeout=5)
        per_model = json_format.MessageToDict(load.attributes)["models"]
        assert {model: figures["data_parallel_ranks"] for model, figures in per_model.items()} == {
            REAL_MODEL: [0],
            GEMMA: [1],
        }, "GetLoad per model: node i serves --model-path i"
        assert sum(figures["running_requests"] for figures in per_model.values()) == load.running_requests
        req = make_request("Hello", max_tokens=2)
        req.model = "no-such-model"
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert repr(REAL_MODEL) in err.value.details() and repr(GEMMA) in err.value.details()


def test_the_http_api_lists_and_serves_both_models(two_models):
    sdk = openai.OpenAI(base_url=two_models.http_url, api_key="unused", max_retries=0)
    listed = {m.id for m in sdk.models.list().data}
    assert {REAL_MODEL, GEMMA} <= listed
    for model in (REAL_MODEL, GEMMA):
        answer = sdk.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert answer.model == model and answer.usage.completion_tokens >= 1


def test_an_adapter_serves_only_the_model_it_was_made_for(two_models):
    """The adapter loads on SmolLM2's node and is listed for SmolLM2; Gemma's node refuses its file, which only
    leaves Gemma out: a Gemma request naming it gets NOT_FOUND naming the model it serves."""
    with Client(two_models.target) as client:
        adapter = lora_pb2.LoraAdapter(lora_name="sea", source_path="sea.gguf")
        client.control.LoadLora(lora_pb2.LoadLoraRequest(adapter=adapter), timeout=60)
        try:
            assert "sea" in [a.lora_name for a in client.control.ListLoras(lora_pb2.ListLorasRequest()).adapters]
            req = make_request("Once upon a time", max_tokens=4)
            req.model, req.lora_name = REAL_MODEL, "sea"
            assert output_ids(generate(two_models.target, req))
            req.model = GEMMA
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(req, timeout=30))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert f"serves the model(s) {REAL_MODEL}, not {GEMMA!r}" in err.value.details()
        finally:
            client.control.UnloadLora(lora_pb2.UnloadLoraRequest(lora_name="sea"), timeout=60)
