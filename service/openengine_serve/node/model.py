"""The node's model: which engine, which file, and the ModelCard it registers with.

Everything here runs at start, before the node binds its port: a missing model
file, a file that is not GGUF, a GGUF that llama.cpp refuses (an architecture it
does not know, a broken vocabulary: its own message), a missing llama.cpp or a CPU
backend variant it lacks (OPENENGINE_CPU_VARIANT) stop the node with one line
saying what to do (exit 2), not with a worker that fails to spawn.
"""

from __future__ import annotations

import importlib.util
import os

from ..api.openengine_internal.v1 import cluster_pb2
from ..common import gguf
from ..common.config import ConfigError, NodeConfig
from ..common.cpu_budget import cpu_budget
from ..common.extras import DependencyError
from ..engine.model_card import LLAMA_CPP, ModelNotFound, default_model_path, gguf_card, simulated_card


def model_path(config: NodeConfig) -> str:
    """The GGUF file a llama.cpp node serves: OPENENGINE_MODEL_PATH, else the embedded SmolLM2."""
    if config.model_path:
        return config.model_path
    try:
        return default_model_path()
    except ModelNotFound as exc:
        raise ConfigError(str(exc)) from None


def load_card(config: NodeConfig) -> cluster_pb2.ModelCard:
    """The card of the model this node serves, with its tokenizer; ConfigError or DependencyError saying what
    is missing."""
    if config.engine != LLAMA_CPP:
        return simulated_card()
    if importlib.util.find_spec("llama_cpp") is None:
        raise DependencyError(
            "the llama.cpp engine needs llama-cpp-python, which is not installed: "
            "pip install 'openengine-serve[node]' (it compiles llama.cpp), or run this node with "
            "OPENENGINE_ENGINE=simulated"
        )
    path = model_path(config)
    try:
        card = gguf_card(path, config.context_size)
    except gguf.GgufError as exc:
        raise ConfigError(f"OPENENGINE_MODEL_PATH: {exc}") from None
    _check_llama_loads(path, config.cpu_variant)
    card.guided_decoding = config.max_guided_sequences > 0
    card.prefix_cache = config.prefix_cache_tokens > 0
    card.max_loras = config.max_loras if config.lora_dir else 0
    return card


def _check_llama_loads(path: str, cpu_variant: str) -> None:
    """llama.cpp's own verdict on the file, given before the worker loads the weights: a vocabulary-only load
    reads the architecture, its hyperparameters and the tokenizer. Loads the CPU backend variant the worker
    will load too (the same files, CPU and environment), so the node logs it and refuses one that cannot run."""
    from ..common.llama_library import CPU_VARIANT_ENV, cpu_backend, llama_cpp, take_errors

    if cpu_variant:
        os.environ[CPU_VARIANT_ENV] = cpu_variant  # the engine worker inherits the node's environment
    try:
        cpu_backend()
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None
    lib = llama_cpp()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    take_errors()
    model = lib.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise ConfigError(f"OPENENGINE_MODEL_PATH: llama.cpp cannot load {path}: {take_errors() or 'no reason logged'}")
    lib.llama_model_free(model)


def engine_options(config: NodeConfig, card: cluster_pb2.ModelCard) -> dict:
    """The WorkerConfig fields of the node's engine."""
    if card.engine != LLAMA_CPP:
        return {"engine": card.engine, "log_level": config.log_level}
    threads = config.threads or max(1, int(cpu_budget().cpus))
    return {
        "engine": LLAMA_CPP,
        "model_path": model_path(config),
        "context_size": config.context_size,
        "prefill_chunk": config.prefill_chunk,
        "threads": threads,
        "prefix_cache_tokens": config.prefix_cache_tokens,
        "max_guided_sequences": config.max_guided_sequences,
        "max_loras": card.max_loras,
        "log_level": config.log_level,
    }
