"""engine/llamacpp/runtime.py: LoRA adapters on the real SmolLM2 GGUF, with the adapter tools/make_test_lora.py
writes. Greedy decoding through LlamaModel with the adapter must follow llama-cpp-python's own Llama with
`lora_path` (teacher-forced: each token the reference's top token or within NEAR_TIE of it), leave the base
model's output, and two sequences of one context decoded one set at a time must not mix."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from openengine_serve.engine.llamacpp.runtime import LlamaError, LlamaModel, TokenBatch
from openengine_serve.engine.model_card import default_model_path

from ..greedy_reference import NEAR_TIE, THREADS, llama_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from make_test_lora import write_adapter  # noqa: E402

PROMPT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
TOKENS = 16


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> str:
    return str(write_adapter(default_model_path(), tmp_path_factory.mktemp("lora") / "sea.gguf"))


@pytest.fixture(scope="module")
def model(adapter):
    loaded = LlamaModel(str(default_model_path()), context_size=1024, batch_tokens=256, sequences=4, threads=THREADS)
    loaded.load_adapter("sea", adapter)
    yield loaded
    loaded.close()


def greedy(model: LlamaModel, prompt: list[int], seq_id: int, adapters) -> list[int]:
    batch = TokenBatch(256)
    model.forget(seq_id)
    tokens, out = list(prompt), []
    position = 0
    for _ in range(TOKENS):
        batch.clear()
        run = tokens[position:]
        index = batch.add(run, position, seq_id, len(run) - 1)
        model.apply_adapters(adapters)
        model.decode(batch)
        token = int(np.argmax(model.logits(index + len(run) - 1)))
        position = len(tokens)
        tokens.append(token)
        out.append(token)
    return out


def reference_gaps(lora_path: str | None, prompt: list[int], output: list[int]) -> list[float]:
    reference = llama_reference(str(default_model_path()), n_ctx=1024, logits_all=True, lora_path=lora_path)
    reference.eval(prompt + output)
    logits = np.array(reference.scores[len(prompt) - 1 : len(prompt) - 1 + len(output)])
    return [float(row.max() - row[token]) for row, token in zip(logits, output, strict=True)]


def test_greedy_output_with_the_adapter_follows_llama_cpp_python_with_lora_path(model, adapter):
    prompt = list(model_tokens(PROMPT))
    base = greedy(model, prompt, 0, ())
    adapted = greedy(model, prompt, 1, (("sea", 1.0),))
    assert adapted != base, "the adapter changes what the model says"
    assert max(reference_gaps(adapter, prompt, adapted)) <= NEAR_TIE
    assert max(reference_gaps(None, prompt, base)) <= NEAR_TIE
    # the same again, interleaved: one context, the adapter set switched between the two sequences' decodes
    assert greedy(model, prompt, 2, (("sea", 1.0),)) == adapted


def test_an_adapter_of_another_shape_is_refused_naming_llama_cpps_reason(model, tmp_path):
    not_lora = tmp_path / "model-copy.gguf"
    not_lora.write_bytes(Path(default_model_path()).read_bytes()[: 1 << 20])
    with pytest.raises(LlamaError, match="could not load the LoRA adapter"):
        model.load_adapter("broken", str(not_lora))


def model_tokens(text: str) -> list[int]:
    reference = llama_reference(str(default_model_path()), n_ctx=256, vocab_only=True)
    return reference.tokenize(text.encode(), add_bos=False, special=True)
