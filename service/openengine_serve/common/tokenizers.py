"""The served model's tokenizer, as the frontend uses it: encode a prompt, the bytes of output tokens.

Two kinds, named by the nodes' ModelCard:
- `gguf`: llama.cpp's own tokenizer, loaded from the vocabulary-only GGUF a
  node hands out (no weights). Prompts are tokenized exactly as llama.cpp's
  server tokenizes them (`llama_tokenize` with the model's special tokens
  added and special-token text parsed), so the ids equal the engine's own.
- `qwen3`: the simulated engine's Qwen3 vocabulary (common/vocab.py), run by
  tiktoken: NFC-normalized text, special-token text parsed.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import unicodedata
from collections.abc import Sequence
from typing import Protocol

from ..api.openengine_internal.v1 import cluster_pb2
from . import gguf

GGUF = "gguf"
QWEN3 = "qwen3"


class Tokenizer(Protocol):
    mode: str  # ModelInfo.tokenizer_modes
    n_vocab: int
    end_of_generation: tuple[int, ...]  # the ids that end a generation (EOS, end of turn)
    chat_template: str  # Jinja2 (tokenizer.chat_template), "" when the model has none
    bos_token: str
    eos_token: str

    def encode(self, text: str) -> list[int]: ...

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes: ...

    def decode_single_token_bytes(self, token_id: int) -> bytes: ...


class Qwen3Tokenizer:
    """The simulated engine's vocabulary (tiktoken)."""

    mode = "qwen3-bpe"
    # Qwen's ChatML turns (without its tool and thinking parts): the simulated model chats like the model it stands for
    chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    bos_token = ""
    eos_token = "<|im_end|>"

    def __init__(self) -> None:
        from .vocab import EOS_TOKEN_ID, load_encoding

        self._encoding = load_encoding()
        self.n_vocab = self._encoding.n_vocab
        self.end_of_generation: tuple[int, ...] = (EOS_TOKEN_ID,)
        self.decode_bytes = self._encoding.decode_bytes
        self.decode_single_token_bytes = self._encoding.decode_single_token_bytes

    def encode(self, text: str) -> list[int]:
        """NFC first; special-token text (e.g. ``<|im_start|>`` from a chat template) becomes its id."""
        return self._encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")


class GgufTokenizer:
    """llama.cpp's tokenizer of a GGUF model, from its vocabulary-only copy (common/gguf.py)."""

    def __init__(self, vocab_only_gguf: bytes) -> None:
        from .llama_library import llama_cpp

        lib = self._lib = llama_cpp()
        # llama.cpp loads models from paths only: a private temporary file, removed once loaded.
        with tempfile.NamedTemporaryFile(suffix=".gguf", prefix="openengine-vocab-") as file:
            file.write(vocab_only_gguf)
            file.flush()
            header = gguf.read_header(file.name)
            params = lib.llama_model_default_params()
            params.vocab_only = True
            self._model = lib.llama_model_load_from_file(os.fsencode(file.name), params)
        if not self._model:
            raise ValueError("llama.cpp could not load the model's vocabulary")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.n_vocab = lib.llama_vocab_n_tokens(self._vocab)
        self.mode = f"llama.cpp:{header.get('tokenizer.ggml.model', 'unknown')}"
        self.chat_template = str(header.get("tokenizer.chat_template", ""))
        self._pieces = self._all_pieces()
        self.end_of_generation = tuple(t for t in range(self.n_vocab) if lib.llama_vocab_is_eog(self._vocab, t))
        self.bos_token = self._piece_text(lib.llama_vocab_bos(self._vocab))
        self.eos_token = self._piece_text(lib.llama_vocab_eos(self._vocab))

    def _all_pieces(self) -> tuple[bytes, ...]:
        """Every token's bytes, special tokens as their text (as llama.cpp's server streams them)."""
        lib, vocab = self._lib, self._vocab
        buffer = ctypes.create_string_buffer(256)
        pieces = []
        for token_id in range(self.n_vocab):
            size = lib.llama_token_to_piece(vocab, token_id, buffer, len(buffer), 0, True)
            if size < 0:  # longer than the buffer: its size, negated
                bigger = ctypes.create_string_buffer(-size)
                size = lib.llama_token_to_piece(vocab, token_id, bigger, len(bigger), 0, True)
                pieces.append(bigger.raw[:size])
            else:
                pieces.append(buffer.raw[:size])
        return tuple(pieces)

    def _piece_text(self, token_id: int) -> str:
        return self._pieces[token_id].decode("utf-8", "replace") if 0 <= token_id < self.n_vocab else ""

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        capacity = len(data) + 16  # a token holds at least one byte, plus the special tokens added
        tokens = (ctypes.c_int32 * capacity)()
        count = self._lib.llama_tokenize(self._vocab, data, len(data), tokens, capacity, True, True)
        if count < 0:
            tokens = (ctypes.c_int32 * -count)()
            count = self._lib.llama_tokenize(self._vocab, data, len(data), tokens, -count, True, True)
        return tokens[:count]

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        pieces = self._pieces
        return b"".join([pieces[token_id] for token_id in token_ids])

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    def guide_tokenizer(self):
        """llguidance's view of this vocabulary, to compile guides against."""
        from .guides import vocabulary

        return vocabulary(self._vocab)


def tokenizer_for(card: cluster_pb2.ModelCard) -> Tokenizer:
    """The tokenizer a ModelCard (from Node.GetModel) describes; ValueError when this frontend does not know it."""
    if card.tokenizer == GGUF:
        return GgufTokenizer(card.tokenizer_data)
    if card.tokenizer == QWEN3:
        return Qwen3Tokenizer()
    raise ValueError(f"unknown tokenizer kind {card.tokenizer!r} of model {card.name!r} (known: {GGUF}, {QWEN3})")
