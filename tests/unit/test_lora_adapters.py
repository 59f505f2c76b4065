"""engine/llamacpp/lora.py: which adapters the engine holds, with a stand-in for the model's native calls."""

from __future__ import annotations

import pytest

from openengine_serve.engine.llamacpp.lora import Adapters, LoraError
from openengine_serve.engine.llamacpp.runtime import LlamaError


class FakeModel:
    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.applied: tuple = ()

    def load_adapter(self, name: str, path: str) -> None:
        if path.endswith("broken.gguf"):
            raise LlamaError(f"llama.cpp could not load the LoRA adapter {path}: bad tensor shapes")
        self.loaded[name] = path

    def unload_adapter(self, name: str) -> None:
        del self.loaded[name]

    def apply_adapters(self, adapters: tuple) -> None:
        self.applied = adapters


def test_a_load_again_from_the_same_file_is_already_loaded_and_another_file_is_refused():
    model = FakeModel()
    adapters = Adapters(model, max_loras=2)
    assert adapters.load("a", "/l/a.gguf") is False
    assert adapters.load("a", "/l/a.gguf") is True
    with pytest.raises(LoraError, match="loaded from another file") as refused:
        adapters.load("a", "/l/other.gguf")
    assert refused.value.code == LoraError.FAILED_PRECONDITION
    assert model.loaded == {"a": "/l/a.gguf"}


def test_at_most_max_loras_are_held_and_llama_cpps_refusal_is_named():
    adapters = Adapters(FakeModel(), max_loras=1)
    adapters.load("a", "/l/a.gguf")
    with pytest.raises(LoraError, match="OPENENGINE_MAX_LORAS=1") as full:
        adapters.load("b", "/l/b.gguf")
    assert full.value.code == LoraError.RESOURCE_EXHAUSTED
    adapters.unload("a")
    with pytest.raises(LoraError, match="bad tensor shapes") as broken:
        adapters.load("b", "/l/broken.gguf")
    assert broken.value.code == LoraError.INVALID_ARGUMENT
    assert "b" not in adapters.paths


def test_an_adapter_in_use_is_freed_when_its_last_request_leaves():
    model = FakeModel()
    adapters = Adapters(model, max_loras=2)
    adapters.load("a", "/l/a.gguf")
    adapters.acquire("a")
    adapters.acquire("a")
    adapters.unload("a")
    assert "a" in model.loaded and adapters.running() == ["a"]
    adapters.release("a")
    assert "a" in model.loaded
    adapters.release("a")
    assert model.loaded == {} and adapters.paths == {} and adapters.running() == []


def test_loading_again_before_the_last_user_leaves_keeps_it():
    model = FakeModel()
    adapters = Adapters(model, max_loras=2)
    adapters.load("a", "/l/a.gguf")
    adapters.acquire("a")
    adapters.unload("a")
    assert adapters.load("a", "/l/a.gguf") is True
    adapters.release("a")
    assert model.loaded == {"a": "/l/a.gguf"}


def test_lora_off_refuses_every_load():
    with pytest.raises(LoraError, match="OPENENGINE_LORA_DIR") as off:
        Adapters(FakeModel(), max_loras=0).load("a", "/l/a.gguf")
    assert off.value.code == LoraError.FAILED_PRECONDITION
