"""What the engine's runtime knows of an architecture, on real files: Gemma 3's sliding window bounds which cached
prefixes a new sequence may share (llama.cpp reuses the cells that fell out of a sequence's window); a model
without one shares any prefix. The prefix cache asks the model before sharing an entry."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from openengine_serve.common.llama_library import llama_cpp
from openengine_serve.engine.llamacpp.prefix_cache import PrefixCache
from openengine_serve.engine.llamacpp.runtime import LlamaModel, TokenBatch
from openengine_serve.engine.model_card import default_model_path

GEMMA_PATH = Path(sys.prefix) / "models" / "gemma-3-270m-q4_k_m.gguf"


def loaded(path: str) -> LlamaModel:
    return LlamaModel(path, context_size=2048, batch_tokens=256, sequences=4, threads=2)


def read(model: LlamaModel, seq_id: int, tokens: list[int]) -> None:
    batch = TokenBatch(256)
    for start in range(0, len(tokens), 256):
        batch.clear()
        batch.add(tokens[start : start + 256], start, seq_id, None)
        model.decode(batch)


@pytest.fixture(scope="module")
def gemma():
    model = loaded(str(GEMMA_PATH))
    yield model
    model.close()


def test_gemma_has_a_512_token_window_and_no_recurrent_state(gemma):
    assert (gemma.sliding_window, gemma.recurrent) == (512, False)


def test_a_prefix_is_shared_only_where_its_window_is_still_held(gemma):
    read(gemma, 0, [2] + [236770] * 699)  # 700 positions
    assert gemma.can_share_prefix(0, 600)
    # as when llama.cpp reused the cells of positions 0..99 (out of the sequence's window)
    llama_cpp().llama_memory_seq_rm(llama_cpp().llama_get_memory(gemma.context), 0, 0, 100)
    assert gemma.can_share_prefix(0, 612)  # the next token's window starts at 100
    assert not gemma.can_share_prefix(0, 600)  # it would attend to positions 88..99, gone
    gemma.forget(0)


def test_a_model_without_a_window_shares_any_prefix():
    model = loaded(default_model_path())
    try:
        assert (model.sliding_window, model.recurrent) == (0, False)
        read(model, 0, [1] * 300)
        llama_cpp().llama_memory_seq_rm(llama_cpp().llama_get_memory(model.context), 0, 200, -1)
        assert model.can_share_prefix(0, 150)
    finally:
        model.close()


class _Model:
    """The two calls the prefix cache makes to its model."""

    def __init__(self, shareable: dict[int, int]) -> None:
        self.shareable = shareable  # seq id -> the shortest prefix it can share

    def can_share_prefix(self, seq_id: int, length: int) -> bool:
        return length >= self.shareable[seq_id]

    def forget(self, seq_id: int) -> None:
        pass


def test_the_prefix_cache_skips_an_entry_the_model_cannot_share():
    cache = PrefixCache(_Model({1: 0, 2: 10_000}), max_tokens=10_000, max_entries=8)
    cache.keep(1, "", list(range(40)))
    cache.keep(2, "", list(range(20)) + [7] * 60)  # shares more with the prompt, but not from where it is held
    prompt = list(range(20)) + [7] * 40
    entry, length = cache.lookup("", prompt, len(prompt) - 1)
    assert entry is not None and (entry.seq_id, length) == (1, 20)
    assert np.array_equal(entry.tokens, np.arange(40))
