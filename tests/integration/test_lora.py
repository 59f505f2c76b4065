"""LoRA adapters on the real model (llama.cpp engine), through the public API on both gRPC servers: LoadLora,
ListLoras, Generate with `lora_name`, UnloadLora. The adapter is written by tools/make_test_lora.py for SmolLM2;
greedy output with it must follow llama-cpp-python's own `Llama(..., lora_path=...)` (teacher-forced, within
NEAR_TIE), requests with and without it running together must each follow their own reference, and no file
outside the node's OPENENGINE_LORA_DIR is read."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest

from openengine_serve.api.openengine.v1 import kv_pb2, lora_pb2, model_pb2, server_pb2
from openengine_serve.client import AsyncClient, Client
from openengine_serve.common.kv_blocks import block_hashes, cache_namespace
from openengine_serve.engine.model_card import default_model_path

from ..greedy_reference import first_beyond_near_tie, llama_reference, reference_model
from . import processes
from .conftest import REAL_MODEL, SERVERS, generate, make_request, output_ids, real_cluster_with
from .processes import engine_worker_pids, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from make_test_lora import write_adapter  # noqa: E402

PROMPT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
TOKENS = 16


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("loras")
    write_adapter(Path(default_model_path()), directory / "sea.gguf")
    (directory / "notes.gguf").write_text("not a GGUF file")
    (directory.parent / "outside.gguf").write_bytes((directory / "sea.gguf").read_bytes())
    return directory


@pytest.fixture(scope="module")
def lora_cluster(lora_dir):
    with real_cluster_with("--lora-dir", str(lora_dir), "--max-loras", "2") as cluster:
        yield cluster


@pytest.fixture(params=SERVERS)
def lora_target(request, lora_cluster) -> str:
    return lora_cluster.frontends[request.param].target


@pytest.fixture(scope="module")
def references(lora_dir):
    """llama-cpp-python's greedy reference without and with the adapter, keeping every position's logits."""
    return reference_model(), llama_reference(
        str(default_model_path()), n_ctx=2048, logits_all=True, lora_path=str(lora_dir / "sea.gguf")
    )


@pytest.fixture
def adapter(lora_target):
    """A freshly loaded adapter (a name of its own per test), unloaded afterwards."""
    name = f"sea-{uuid.uuid4().hex[:8]}"
    with Client(lora_target) as client:
        loaded = client.control.LoadLora(
            lora_pb2.LoadLoraRequest(adapter=lora_pb2.LoraAdapter(lora_name=name, source_path="sea.gguf")),
            timeout=60,
        )
        yield loaded
        try:
            client.control.UnloadLora(lora_pb2.UnloadLoraRequest(lora_name=name), timeout=60)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND  # the test unloaded it itself


def prompt_ids(reference) -> list[int]:
    return reference.tokenize(PROMPT.encode(), add_bos=True, special=True)


def test_load_list_and_describe(lora_target, adapter):
    assert adapter.adapter.lora_id > 0 and adapter.adapter.source_path == "sea.gguf" and not adapter.already_loaded
    with Client(lora_target) as client:
        listed = client.control.ListLoras(lora_pb2.ListLorasRequest(), timeout=5).adapters
        assert adapter.adapter in listed
        again = client.control.LoadLora(lora_pb2.LoadLoraRequest(adapter=adapter.adapter), timeout=60)
        assert again.already_loaded and again.adapter.lora_id == adapter.adapter.lora_id
        info = client.control.GetModelInfo(model_pb2.GetModelInfoRequest(model=REAL_MODEL), timeout=5)
        assert info.supports_lora
        assert client.control.GetServerInfo(server_pb2.GetServerInfoRequest(), timeout=5).capacity.max_loras == 2


def test_greedy_output_with_the_adapter_follows_llama_cpp_python_with_lora_path(lora_target, adapter, references):
    base_reference, lora_reference = references
    ids = prompt_ids(base_reference)
    base = output_ids(generate(lora_target, make_request(ids, max_tokens=TOKENS)))
    req = make_request(ids, max_tokens=TOKENS)
    req.lora_name = adapter.adapter.lora_name
    adapted = output_ids(generate(lora_target, req))
    assert adapted != base, "the adapter changes what the model says"
    assert first_beyond_near_tie(lora_reference, ids, adapted) is None
    assert first_beyond_near_tie(base_reference, ids, base) is None
    after = output_ids(generate(lora_target, make_request(ids, max_tokens=TOKENS)))
    assert first_beyond_near_tie(base_reference, ids, after) is None, "the adapter must not outlast its requests"


def test_requests_with_and_without_the_adapter_run_together_without_mixing(lora_target, adapter, references):
    base_reference, lora_reference = references
    ids = prompt_ids(base_reference)

    async def run() -> list[list[int]]:
        async with AsyncClient(lora_target) as client:

            async def one(lora_name: str) -> list[int]:
                req = make_request(ids, max_tokens=TOKENS)
                req.lora_name = lora_name
                return output_ids([r async for r in client.inference.Generate(req, timeout=120)])

            return await asyncio.gather(*(one(adapter.adapter.lora_name if i % 2 else "") for i in range(6)))

    outputs = asyncio.run(run())
    for i, output in enumerate(outputs):
        reference = lora_reference if i % 2 else base_reference
        assert first_beyond_near_tie(reference, ids, output) is None, f"request {i} (adapter: {bool(i % 2)})"
    assert outputs[0] != outputs[1]


def test_the_prefix_cache_keeps_an_adapters_kv_apart(lora_target, adapter, references):
    ids = prompt_ids(references[0]) + [28, 29] * 40  # long enough for the cache to share it

    def cached(lora_name: str) -> int:
        req = make_request(ids, max_tokens=2, kv__cache_salt=f"lora-test-{adapter.adapter.lora_id}")
        req.lora_name = lora_name
        return generate(lora_target, req)[-1].usage.cached_prompt_tokens

    assert cached(adapter.adapter.lora_name) == 0
    assert cached("") == 0, "the base model must not read the adapter's KV"
    assert cached(adapter.adapter.lora_name) > 0
    # KV events name the adapter, and its blocks' hashes are those of its namespace
    salt, name = f"lora-test-{adapter.adapter.lora_id}", adapter.adapter.lora_name
    with Client(lora_target, retries=False) as client:
        snapshot = next(iter(client.control.SubscribeKvEvents(kv_pb2.SubscribeKvEventsRequest(include_snapshot=True))))
    stored = {
        (event.block_stored.lora_name, hash_.value)
        for event in snapshot.batch.events
        if event.HasField("block_stored")
        for hash_ in event.block_stored.block_hashes
    }
    assert {(name, h) for h in block_hashes(cache_namespace(salt, name), ids)} <= stored
    assert {("", h) for h in block_hashes(salt, ids)} <= stored


def test_unloaded_and_unknown_adapters_are_refused_naming_those_loaded(lora_target, adapter):
    name = adapter.adapter.lora_name
    with Client(lora_target) as client:
        req = make_request("Hello", max_tokens=2)
        req.lora_name = "no-such-adapter"
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and repr(name) in err.value.details()
        unloaded = client.control.UnloadLora(lora_pb2.UnloadLoraRequest(lora_name=name), timeout=60)
        assert unloaded.adapter.lora_name == name
        assert name not in [a.lora_name for a in client.control.ListLoras(lora_pb2.ListLorasRequest()).adapters]
        req.lora_name = name
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            client.control.UnloadLora(lora_pb2.UnloadLoraRequest(lora_name=name), timeout=60)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    ("source_path", "says"),
    [
        ("../outside.gguf", "outside the adapter directory"),
        ("/etc/passwd", "outside the adapter directory"),
        ("missing.gguf", "no such file"),
        ("notes.gguf", "not a GGUF file"),
    ],
)
def test_a_file_outside_the_directory_or_not_an_adapter_is_refused(lora_target, lora_dir, source_path, says):
    if source_path.startswith("../"):
        assert (lora_dir / source_path).is_file()  # there, but outside the directory
    with Client(lora_target) as client, pytest.raises(grpc.RpcError) as err:
        client.control.LoadLora(
            lora_pb2.LoadLoraRequest(adapter=lora_pb2.LoraAdapter(lora_name="bad", source_path=source_path)),
            timeout=60,
        )
        assert "bad" not in [a.lora_name for a in client.control.ListLoras(lora_pb2.ListLorasRequest()).adapters]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()


def test_the_node_reports_the_adapters_of_its_requests(lora_cluster, lora_target, adapter, references):
    """openengine_node_lora_requests_info (vLLM's lora_requests_info) names the adapter while its request runs."""
    name = adapter.adapter.lora_name
    seen: list[dict[str, str]] = []

    async def run() -> None:
        async with AsyncClient(lora_target) as client:
            req = make_request(prompt_ids(references[0]), max_tokens=200, ignore_eos=True)
            req.lora_name = name
            stream = client.inference.Generate(req, timeout=120)
            async for _ in stream:
                if not seen:
                    samples = processes.scrape(lora_cluster.node_metrics)
                    seen.extend(
                        dict(labels) for metric, labels in samples if metric == "openengine_node_lora_requests_info"
                    )

    asyncio.run(run())
    assert any(labels["running_lora_adapters"] == name and labels["max_lora"] == "2" for labels in seen), seen


def test_a_new_engine_worker_loads_a_listed_adapter_when_a_request_names_it(
    lora_cluster, lora_target, adapter, references
):
    """As a node started after the LoadLora: the engine worker is replaced (killed, respawned) and holds no
    adapter, and the first request naming the adapter loads it from the file the request carries."""
    ids = prompt_ids(references[0])
    os.kill(engine_worker_pids(lora_cluster.node.proc.pid)[0], signal.SIGKILL)
    req = make_request(ids, max_tokens=TOKENS)
    req.lora_name = adapter.adapter.lora_name

    def served() -> list[int] | None:
        try:
            responses = generate(lora_target, req)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc  # the worker restarting, nothing else
            return None
        errors = [r.error for r in responses if r.HasField("error")]
        if errors:  # the worker was lost under the request: a retryable failure, nothing else
            assert all(error.retryable for error in errors), errors
            return None
        return output_ids(responses)

    adapted = wait_for(served, 60, "the new worker to serve the adapter")
    assert first_beyond_near_tie(references[1], ids, adapted) is None


def test_the_command_line_loads_lists_uses_and_unloads_an_adapter(lora_target, references):
    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "openengine_serve", *args, "--target", lora_target],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    name = f"cli-{uuid.uuid4().hex[:8]}"
    assert cli("lora", "load", name, "sea.gguf").startswith(f"{name}\tid=")
    assert f"{name}\t" in cli("lora", "list")
    generate_args = ("generate", "--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0")
    with_adapter = cli(*generate_args, "--lora", name)
    assert with_adapter and with_adapter != cli(*generate_args)
    cli("lora", "unload", name)
    assert f"{name}\t" not in cli("lora", "list")
