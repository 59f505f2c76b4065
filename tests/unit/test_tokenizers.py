"""The frontend's tokenizer of a GGUF model (from the vocabulary-only copy a node hands out) against a tokenizer
that is not llama.cpp's code (Hugging Face `tokenizers`, built from the GGUF's own vocabulary and merges), and
the GGUF header reader and writer it relies on."""

from __future__ import annotations

import random
import struct

import pytest

from openengine_serve.common import gguf
from openengine_serve.common.tokenizers import GgufTokenizer, Qwen3Tokenizer, tokenizer_for
from openengine_serve.engine.model_card import default_model_path, gguf_card, served_name, simulated_card

FRAGMENTS = {
    "unicode": [
        "héllo wörld",
        "naïve café",
        "日本語のテキスト",
        "中文字符",
        "한국어",
        "Ελληνικά",
        "русский текст",
        "עברית",
        "العربية",
        "हिन्दी",
        "ไทย",
        "e\u0301",
        "ﬁ ligature",
        "\u00a0nbsp",
        "zero\u200bwidth",
        "∑∫√∞≠",
        "½ ¾ ⅓",
        "Ångström",
        "ß ẞ",
    ],
    "emoji": ["🎉", "👩‍👩‍👧", "🇫🇷🇯🇵", "👍🏽", "❤️", "🤖🚀✨", "😀😃😄😁", "🏳️‍🌈"],
    "code": [
        "def f(x):\n    return x ** 2\n",
        "for (int i = 0; i < n; ++i) { a[i] += 1; }",
        '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
        "SELECT * FROM t WHERE id = 42;",
        '#include <stdio.h>\nint main(void) { printf("%d\\n", 1); }',
        "x = [i for i in range(10) if i % 2]",
        '<div class="a">&amp;</div>',
        "λx.λy.x",
        "a->b->c; p != NULL && q || !r",
        "0x1F 0b1010 1e-9 3.14159",
    ],
    "whitespace": [
        "   ",
        "\t\t",
        "\n\n\n",
        " \n \n",
        "\r\n",
        "a  b   c    d",
        "   leading",
        "trailing   ",
        "\t mixed \n\t whitespace \r\n",
        "                                ",
    ],
    "plain": [
        "The capital of France is",
        "Once upon a time",
        "Hello, world!",
        "It's 5 o'clock.",
        "Numbers: 1234567890",
        "UPPER lower MiXeD",
        "end.",
    ],
}


def special_token_texts(header: gguf.GgufHeader) -> list[str]:
    """Every control token's text (token type 3), e.g. <|im_start|>."""
    tokens, types = header.get("tokenizer.ggml.tokens"), header.get("tokenizer.ggml.token_type")
    return [text for text, kind in zip(tokens, types) if kind == 3]


def prompts(header: gguf.GgufHeader) -> list[str]:
    """Fragments alone, then random mixes of them and of special-token text (fixed seed): 250+ prompts."""
    fragments = [f for group in FRAGMENTS.values() for f in group]
    specials = special_token_texts(header)
    rng = random.Random(20261203)
    mixes = []
    for _ in range(170):
        parts = rng.sample(fragments, rng.randint(2, 5)) + rng.sample(specials, rng.randint(0, 2))
        rng.shuffle(parts)
        mixes.append(rng.choice(["", " ", "\n", "  "]).join(parts))
    return fragments + specials + [f"{s}text{s}" for s in specials] + mixes


@pytest.fixture(scope="module")
def header():
    return gguf.read_header(default_model_path())


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizer_for(gguf_card(default_model_path(), 16384))


@pytest.fixture(scope="module")
def hf_tokenizer(header):
    """Hugging Face `tokenizers` (Rust) from the GGUF's vocabulary and merges, set up as the model's published
    tokenizer.json is (SmolLM2: byte-level BPE; digits split one by one, then GPT-2's pattern, no prefix space;
    control tokens split out whole; no BOS added, as tokenizer.ggml.add_bos_token says)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    assert (header.get("tokenizer.ggml.model"), header.get("tokenizer.ggml.pre")) == ("gpt2", "smollm")
    assert header.get("tokenizer.ggml.add_bos_token") is False
    tokens = header.get("tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ")) for merge in header.get("tokenizer.ggml.merges")]
    hf = Tokenizer(models.BPE(vocab={text: i for i, text in enumerate(tokens)}, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special_token_texts(header)])
    return lambda text: hf.encode(text, add_special_tokens=False).ids


def test_the_ids_equal_hugging_face_tokenizers_on_250_prompts(header, tokenizer, hf_tokenizer):
    cases = prompts(header)
    assert len(cases) >= 250
    assert sum(any(s in case for s in special_token_texts(header)) for case in cases) >= 80
    mismatches = [case for case in cases if tokenizer.encode(case) != hf_tokenizer(case)]
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ, e.g. {mismatches[:3]!r}"


def test_special_token_text_becomes_the_special_token(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


def test_decoding_the_ids_gives_the_text_back(header, tokenizer):
    for case in prompts(header):
        assert tokenizer.decode_bytes(tokenizer.encode(case)).decode("utf-8") == case


def test_the_tokenizer_reports_the_model(tokenizer):
    assert (tokenizer.mode, tokenizer.n_vocab, tokenizer.end_of_generation) == ("llama.cpp:gpt2", 49152, (0, 2, 4))
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template.startswith("{% for message in messages %}")


def test_the_simulated_card_names_the_built_in_qwen3_tokenizer():
    card = simulated_card()
    assert (card.name, card.tokenizer, card.tokenizer_data) == ("Qwen/Qwen3-0.6B", "qwen3", b"")
    assert isinstance(tokenizer_for(card), Qwen3Tokenizer)


# ------------------------------------------------------------------ the GGUF header


def test_the_vocabulary_only_copy_has_the_pairs_and_no_tensors(header, tmp_path):
    copy = tmp_path / "vocab.gguf"
    copy.write_bytes(gguf.vocab_only(header))
    again = gguf.read_header(str(copy))
    assert header.tensor_count > 0 and again.tensor_count == 0
    assert again.metadata == header.metadata
    assert copy.stat().st_size < 3_000_000, "the tokenizer, not the weights"
    assert isinstance(GgufTokenizer(copy.read_bytes()), GgufTokenizer)


def test_a_file_that_is_not_gguf_is_refused_with_what_it_is(tmp_path):
    text = tmp_path / "model.bin"
    text.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(gguf.GgufError, match="is not a GGUF file"):
        gguf.read_header(str(text))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gguf.MAGIC + struct.pack("<IQQ", 3, 0, 5) + b"\x10\x00")
    with pytest.raises(gguf.GgufError, match="ends early"):
        gguf.read_header(str(truncated))
    with pytest.raises(gguf.GgufError, match="cannot read the model file"):
        gguf.read_header(str(tmp_path / "missing.gguf"))


def test_any_architecture_gets_a_card_llama_cpp_judges_the_file(tmp_path):
    """The card reads any architecture's header; whether llama.cpp runs it is the node's check
    (tests/integration/test_architectures.py)."""
    pairs = b""
    for key, value in ((b"general.architecture", b"mamba"),):
        pairs += struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value)) + value  # 8: a string
    key = b"mamba.context_length"
    pairs += struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, 2048)  # 4: uint32
    path = tmp_path / "mamba.gguf"
    path.write_bytes(gguf.MAGIC + struct.pack("<IQQ", 3, 0, 2) + pairs)
    assert gguf.read_header(str(path)).architecture == "mamba"
    card = gguf_card(str(path), 4096)
    assert (card.name, card.context_length) == ("mamba", 2048)


@pytest.mark.parametrize(
    "file_name, name",
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("llama-3.2-1b-instruct-q8_0.gguf", "llama-3.2-1b-instruct"),
        ("TinyLlama.F16.gguf", "TinyLlama"),
        ("my-model.gguf", "my-model"),
    ],
)
def test_the_served_name_is_the_file_name_without_quantization(file_name, name):
    assert served_name(f"/models/{file_name}") == name


def test_the_card_of_the_embedded_model():
    card = gguf_card(default_model_path(), 4096)
    assert (card.name, list(card.aliases), card.engine) == (
        "SmolLM2-135M-Instruct",
        ["SmolLM2-135M-Instruct.Q4_1"],
        "llama.cpp",
    )
    assert (card.context_length, card.max_output_tokens) == (4096, 4096), "the KV cache bounds the context"
    assert gguf_card(default_model_path(), 65536).context_length == 8192, "and so does the trained context"
