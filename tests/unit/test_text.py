"""Prompt encoding, incremental detokenization and stop-string matching."""

from __future__ import annotations

import random

import pytest

from openengine_serve.common.tokenizers import Qwen3Tokenizer
from openengine_serve.common.vocab import EOS_TOKEN_ID, VOCAB_SIZE, load_encoding, token_bytes
from openengine_serve.frontend.text import IncrementalDetokenizer, StopStringMatcher


@pytest.fixture(scope="module")
def encoding():
    return load_encoding()


@pytest.fixture(scope="module")
def byte_token_ids(encoding) -> list[int]:
    """The 256 single-byte tokens: sequences of them split characters anywhere."""
    return [encoding.encode_single_token(bytes([b])) for b in range(256)]


def detokenize_in_chunks(encoding, token_ids: list[int], rng: random.Random) -> list[str]:
    """Pushes the ids in random-sized chunks; returns every delta, the flush last."""
    detokenizer = IncrementalDetokenizer(encoding)
    deltas = []
    position = 0
    while position < len(token_ids):
        size = rng.randint(0, 4)  # 0: an empty push must be harmless too
        deltas.append(detokenizer.push(token_ids[position : position + size]))
        position += size
    deltas.append(detokenizer.flush())
    return deltas


# --- Qwen3Tokenizer.encode -------------------------------------------------------------


def test_qwen3_encode_matches_plain_tiktoken_for_ordinary_text(encoding):
    text = "Hello, world! 你好 🎉"
    assert Qwen3Tokenizer().encode(text) == encoding.encode(text)


def test_qwen3_encode_parses_special_tokens_as_specials(encoding):
    ids = Qwen3Tokenizer().encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == encoding.encode_single_token("<|im_start|>")
    assert ids[-1] == EOS_TOKEN_ID


def test_qwen3_encode_normalizes_to_nfc(encoding):
    decomposed = "cafe\u0301"  # e + combining acute accent
    assert Qwen3Tokenizer().encode(decomposed) == encoding.encode("caf\u00e9")


# --- IncrementalDetokenizer ----------------------------------------------------


@pytest.mark.parametrize(
    "text", ["🎉", " 🎉!", "你", "naïve 你好 👩‍👩‍👧"], ids=["emoji", "emoji-in-text", "cjk", "mixed"]
)
def test_character_split_across_byte_tokens_is_held_until_complete(encoding, byte_token_ids, text):
    token_ids = [byte_token_ids[b] for b in text.encode("utf-8")]
    detokenizer = IncrementalDetokenizer(encoding)
    deltas = [detokenizer.push([token_id]) for token_id in token_ids]
    assert "".join(deltas) + detokenizer.flush() == text
    assert all("\ufffd" not in delta for delta in deltas)
    # A character appears exactly when its last byte arrives (dropping the
    # incomplete tail of a valid UTF-8 prefix leaves the complete characters).
    for index in range(len(deltas)):
        assert "".join(deltas[: index + 1]) == text.encode("utf-8")[: index + 1].decode("utf-8", errors="ignore")


def test_emoji_split_by_the_real_tokenizer(encoding):
    token_ids = encoding.encode("party 🎉")
    pieces = [token_bytes(encoding, token_id) for token_id in token_ids]
    assert any(not piece.decode("utf-8", errors="ignore") for piece in pieces), "expected a split emoji"
    detokenizer = IncrementalDetokenizer(encoding)
    deltas = [detokenizer.push([token_id]) for token_id in token_ids]
    assert deltas[-1].endswith("🎉")
    assert "".join(deltas) + detokenizer.flush() == "party 🎉"


def test_flush_replaces_an_unfinished_character(encoding, byte_token_ids):
    token_ids = [byte_token_ids[b] for b in "a🎉".encode()[:-1]]
    detokenizer = IncrementalDetokenizer(encoding)
    assert detokenizer.push(token_ids) == "a"
    assert detokenizer.flush() == "\ufffd" == encoding.decode(token_ids)[1:]


def test_special_tokens_decode_to_their_text(encoding):
    detokenizer = IncrementalDetokenizer(encoding)
    assert detokenizer.push([EOS_TOKEN_ID]) == "<|im_end|>"


@pytest.mark.parametrize("source", ["whole-vocabulary", "byte-tokens-and-specials"])
def test_deltas_concatenate_to_the_full_decode(encoding, byte_token_ids, source):
    rng = random.Random(f"detokenizer-{source}")
    specials = list(range(VOCAB_SIZE - 26, VOCAB_SIZE))
    for _ in range(400):
        length = rng.randint(0, 30)
        if source == "whole-vocabulary":
            token_ids = [rng.randrange(VOCAB_SIZE) for _ in range(length)]
        else:
            token_ids = [rng.choice(byte_token_ids if rng.random() < 0.9 else specials) for _ in range(length)]
        deltas = detokenize_in_chunks(encoding, token_ids, rng)
        assert "".join(deltas) == encoding.decode(token_ids), token_ids


# --- StopStringMatcher ---------------------------------------------------------


def test_stop_string_split_across_three_feeds():
    matcher = StopStringMatcher(["STOP"], include_stop=False)
    assert matcher.feed("abc ST") == ("abc ", None)
    assert matcher.feed("O") == ("", None)
    assert matcher.feed("P and more") == ("", "STOP")


@pytest.mark.parametrize(
    ("include_stop", "expected"),
    [(False, [("say ", None), ("", "</s>")]), (True, [("say ", None), ("</s>", "</s>")])],
    ids=["stop-removed", "stop-included"],
)
def test_include_stop(include_stop, expected):
    matcher = StopStringMatcher(["</s>"], include_stop=include_stop)
    assert [matcher.feed("say </"), matcher.feed("s> tail")] == expected


@pytest.mark.parametrize(
    ("stops", "text", "emitted", "matched"),
    [
        (["world", "lo"], "hello world", "hel", "lo"),
        (["xyz", "abc"], "-abc-xyz", "-", "abc"),
        # "bc" completes before "abcd" could: the stream stops there.
        (["abcd", "bc"], "xabcd", "xa", "bc"),
        # Both complete at the same character: the longer one starts earlier.
        (["cd", "abcd"], "xabcd", "x", "abcd"),
    ],
    ids=["earlier-in-text", "list-order-irrelevant", "inner-stop-completes-first", "same-end-earlier-start"],
)
def test_earliest_match_wins(stops, text, emitted, matched):
    assert StopStringMatcher(stops, include_stop=False).feed(text) == (emitted, matched)


def test_holds_back_only_the_longest_suffix_that_starts_a_stop_string():
    matcher = StopStringMatcher(["abab", "zz"], include_stop=False)
    assert matcher.feed("ab x") == ("ab x", None)
    assert matcher.feed("xaba") == ("x", None)
    assert matcher.feed("c") == ("abac", None)
    assert matcher.feed("ababz") == ("", "abab")


def test_flush_releases_held_text_without_a_match():
    matcher = StopStringMatcher(["STOP"], include_stop=False)
    assert matcher.feed("hello ST") == ("hello ", None)
    assert matcher.flush() == "ST"


def test_nothing_is_emitted_after_a_match():
    matcher = StopStringMatcher(["."], include_stop=True)
    assert matcher.feed("one. two") == ("one.", ".")
    assert matcher.feed("three.") == ("", None)
    assert matcher.flush() == ""


def test_without_stop_strings_text_passes_through():
    matcher = StopStringMatcher([], include_stop=False)
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""], include_stop=False)


def reference_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """Brute force: (start, end, stop) of the match completing first, earliest start on ties."""
    for end in range(len(text) + 1):
        found = [(end - len(s), end, s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if found:
            return min(found)
    return None


@pytest.mark.parametrize("include_stop", [False, True], ids=["stop-removed", "stop-included"])
def test_feed_boundaries_never_change_the_result(include_stop):
    rng = random.Random(f"stops-{include_stop}")
    for _ in range(500):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 20)))
        matcher = StopStringMatcher(stops, include_stop=include_stop)
        emitted, matched, position = [], None, 0
        while position < len(text) and matched is None:
            size = rng.randint(0, 5)
            piece, matched = matcher.feed(text[position : position + size])
            emitted.append(piece)
            position += size
        emitted.append(matcher.flush())

        expected = reference_stop(text, stops)
        if expected is None:
            assert (("".join(emitted)), matched) == (text, None), (stops, text)
        else:
            start, end, stop = expected
            assert ("".join(emitted), matched) == (text[: end if include_stop else start], stop), (stops, text)
