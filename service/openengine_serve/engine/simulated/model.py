"""The simulated model: deterministic token choice over the real Qwen3 vocabulary.

Pure computation, no I/O. The token an output produces at a position is a
function of the prompt token ids, the seed (0 without one), the sampling
parameters, the output index (not for greedy sampling) and the position only,
never of the request id, so two servers stream identical tokens for identical
requests.

Each output owns a Mersenne Twister seeded with a key hashed from those inputs;
one 64-bit draw per position decides everything about that position's token:

    bits  0..15  EOS (probability 1/48, only where EOS is allowed)
    bits 16..23  which pool: readable words, punctuation, or any BPE token
    bits 24..47  index into that pool
    bits 48..55  where the logprob falls inside its rank's band
    bits 56..63  rank (1..5, rank 1 most likely; always 1 for greedy)

Candidate selection supports `top_n` and `token_ids`; `all` (the whole
vocabulary per token) is not produced, so it must not be advertised.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import random
import re
import struct

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.api.openengine_internal.v1.cluster_pb2 import (
    ENGINE_FINISH_EOS,
    ENGINE_FINISH_LENGTH,
    ENGINE_FINISH_NONE,
    ENGINE_FINISH_STOP_TOKEN,
)
from openengine_serve.common.vocab import BPE_RANKS, EOS_TOKEN_ID, load_encoding, token_bytes

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant (splitmix64's): spreads small integers

_EOS_CUTOFF = 65536 // 48  # bits 0..15 below this: EOS
_WORD_CUTOFF = 200  # bits 16..23 below this: a readable word (78%)
_PUNCTUATION_CUTOFF = 218  # ... below this: punctuation (7%); the rest (15%): any BPE token

_READABLE_WORD = re.compile(rb" [a-z]{2,9}")
_PUNCTUATION = (",", ".", ";", ":", "?", "!", "\n")

# Rank of the sampled token from 8 bits: 1 in 60%, 2 in 18%, 3 in 10%, 4 in 7%, 5 in 5%.
_RANK_BY_BYTE = bytes([1] * 154 + [2] * 46 + [3] * 26 + [4] * 18 + [5] * 12)
# Ranks 1..5 split [-6, -0.01] into equal, non-overlapping bands, so a higher
# rank always has a lower logprob.
_TOP_RANKS = 5
_BAND_WIDTH = (6.0 - 0.01) / _TOP_RANKS
_PRIME_STRIDE = 1_000_003


class _Pools:
    """Token id pools drawn from; built once per process from the vocabulary."""

    def __init__(self) -> None:
        encoding = load_encoding()
        self.words = tuple(
            token_id for token_id in range(BPE_RANKS) if _READABLE_WORD.fullmatch(token_bytes(encoding, token_id))
        )
        self.punctuation = tuple(encoding.encode_single_token(text) for text in _PUNCTUATION)

    def pick(self, bits: int) -> int:
        """The (non-EOS) token a 64-bit draw picks."""
        pool_choice = (bits >> 16) & 0xFF
        index = (bits >> 24) & 0xFFFFFF
        if pool_choice < _WORD_CUTOFF:
            return self.words[index % len(self.words)]
        if pool_choice < _PUNCTUATION_CUTOFF:
            return self.punctuation[index % len(self.punctuation)]
        return index % BPE_RANKS


@functools.lru_cache(maxsize=1)
def _pools() -> _Pools:
    return _Pools()


def warm_up() -> None:
    """Builds the token pools now (about half a second) instead of on the first request."""
    _pools()


def _mix64(value: int) -> int:
    """splitmix64's finalizer: a stable, well-spread 64-bit hash of a 64-bit value."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _digest64(*parts: bytes) -> int:
    hasher = hashlib.blake2b(digest_size=8)
    for part in parts:
        hasher.update(part)
    return int.from_bytes(hasher.digest(), "little")


def _prompt_bytes(prompt_token_ids) -> bytes:
    return struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)


def output_key(request: cluster_pb2.EngineRequest, output_index: int) -> int:
    """The 64-bit key every token of one output derives from."""
    seed = request.seed if request.has_seed else 0
    sampling = struct.pack(
        "<QddiI", seed, request.temperature, request.top_p, request.top_k, len(request.prompt_token_ids)
    )
    key = _digest64(b"output", sampling, _prompt_bytes(request.prompt_token_ids))
    if request.temperature == 0:
        return key  # greedy: every output is the same
    return _mix64(key ^ ((output_index + 1) * _GOLDEN & _MASK64))


def _prompt_key(request: cluster_pb2.EngineRequest) -> int:
    # Prompt logprobs depend on the prompt alone, as a real model's would.
    return _digest64(b"prompt", _prompt_bytes(request.prompt_token_ids))


def logprob_for_rank(rank: int, fraction: float) -> float:
    """A logprob consistent with `rank`: strictly lower for every higher rank.

    Ranks 1..5 fall in [-6, -0.01] (`fraction` in [0, 1) places it inside the
    rank's band); ranks above 5 fall below -6 and no longer use `fraction`.
    """
    if rank <= _TOP_RANKS:
        return -0.01 - _BAND_WIDTH * (rank - 1 + fraction)
    return -6.0 - math.log(rank - _TOP_RANKS + 1)


def _fill_logprobs(
    record: cluster_pb2.TokenRecord, token_id: int, bits: int, greedy: bool, candidates: cluster_pb2.Candidates
) -> None:
    """Sets logprob, rank and candidates of a record, all derived from `bits`."""
    rank = 1 if greedy else _RANK_BY_BYTE[(bits >> 56) & 0xFF]
    fraction = ((bits >> 48) & 0xFF) / 256.0
    logprob = logprob_for_rank(rank, fraction)
    record.has_logprob = True
    record.logprob = logprob
    record.rank = rank
    if candidates.top_n:
        _add_top_candidates(record, token_id, rank, logprob, fraction, bits, candidates.top_n)
    for asked_id in candidates.token_ids:
        if asked_id == token_id:
            record.candidates.add(token_id=asked_id, logprob=logprob, rank=rank)
        else:
            # Any other asked token ranks below the top five, at a spot fixed by (draw, token).
            asked_rank = _TOP_RANKS + 1 + _mix64(bits ^ asked_id) % 4096
            record.candidates.add(token_id=asked_id, logprob=logprob_for_rank(asked_rank, 0.0), rank=asked_rank)


def _add_top_candidates(
    record: cluster_pb2.TokenRecord, token_id: int, rank: int, logprob: float, fraction: float, bits: int, top_n: int
) -> None:
    words = _pools().words
    # A prime stride larger than the pool walks it without repeating: distinct alternatives.
    start = _mix64(bits) % len(words)
    alternatives = (words[(start + step * _PRIME_STRIDE) % len(words)] for step in itertools.count())
    for candidate_rank in range(1, top_n + 1):
        if candidate_rank == rank:
            record.candidates.add(token_id=token_id, logprob=logprob, rank=rank)
            continue
        alternative = next(alternatives)
        if alternative == token_id:
            alternative = next(alternatives)
        record.candidates.add(
            token_id=alternative, logprob=logprob_for_rank(candidate_rank, fraction), rank=candidate_rank
        )


class SequenceState:
    """One output of a request: its own token stream and the position it reached."""

    __slots__ = ("output_index", "position", "draw")

    def __init__(self, output_index: int, key: int) -> None:
        self.output_index = output_index
        self.position = 0  # tokens produced so far
        # A private generator advanced one 64-bit draw per token: far cheaper
        # than hashing per token, and still a function of (key, position) alone.
        self.draw = random.Random(key).getrandbits


class RequestState:
    """A request inside the engine: its sampling rules and its open outputs.

    `next_token` produces one token of one output; the caller owns batching and
    events. `outputs` holds only the outputs that are still open.
    """

    __slots__ = (
        "request",
        "order",
        "request_id",
        "lane",
        "prompt_length",
        "outputs",
        "_prompt_pending",
        "_min_tokens",
        "_max_tokens",
        "_stop_token_ids",
        "_eos_enabled",
        "_greedy",
        "_logprobs",
        "_candidates",
        "_pick",
    )

    def __init__(self, request: cluster_pb2.EngineRequest) -> None:
        self.request = request
        self.order: tuple[int, int] = (0, 0)  # (-priority, arrival): its place in the engine's queue
        self.request_id = request.request_id
        self.lane = request.frontend_id
        self.prompt_length = len(request.prompt_token_ids)
        self.outputs: dict[int, SequenceState] = {
            index: SequenceState(index, output_key(request, index)) for index in range(max(1, request.num_sequences))
        }
        self._prompt_pending = request.prompt_logprobs
        self._min_tokens = request.min_tokens
        self._max_tokens = max(1, request.max_tokens)
        self._stop_token_ids = frozenset(request.stop_token_ids)
        self._eos_enabled = not request.ignore_eos
        self._greedy = request.temperature == 0
        self._logprobs = request.output_logprobs
        self._candidates = request.output_candidates
        self._pick = _pools().pick

    def take_prompt_records(self, output_index: int) -> list[cluster_pb2.TokenRecord] | None:
        """The prompt logprob records, once, for the first event of output 0 (None otherwise)."""
        if output_index != 0 or not self._prompt_pending:
            return None
        self._prompt_pending = False
        return prompt_token_records(self.request)

    def next_token(
        self, sequence: SequenceState
    ) -> tuple[int, cluster_pb2.EngineFinish, cluster_pb2.TokenRecord | None]:
        """(token id, EngineFinish, record) of the sequence's next token.

        `record` carries the logprobs and is None when they were not asked. A
        finishing token closes the sequence (it leaves `outputs`).
        """
        position = sequence.position + 1
        sequence.position = position
        bits = sequence.draw(64)
        # Before min_tokens neither EOS nor a stop token may end the output.
        stops_allowed = position >= self._min_tokens
        if stops_allowed and self._eos_enabled and (bits & 0xFFFF) < _EOS_CUTOFF:
            token_id = EOS_TOKEN_ID
        else:
            token_id = self._pick(bits)
        record = None
        if self._logprobs:
            record = cluster_pb2.TokenRecord(token_id=token_id)
            _fill_logprobs(record, token_id, bits, self._greedy, self._candidates)
        if token_id == EOS_TOKEN_ID:
            finish = ENGINE_FINISH_EOS
        elif stops_allowed and token_id in self._stop_token_ids:
            finish = ENGINE_FINISH_STOP_TOKEN
        elif position >= self._max_tokens:
            finish = ENGINE_FINISH_LENGTH
        else:
            return token_id, ENGINE_FINISH_NONE, record
        del self.outputs[sequence.output_index]
        return token_id, finish, record


def prompt_token_records(request: cluster_pb2.EngineRequest) -> list[cluster_pb2.TokenRecord]:
    """One record per prompt token from `prompt_logprob_start` on.

    The first prompt token has nothing before it to be predicted from: no logprob, rank 0.
    """
    next_draw = random.Random(_prompt_key(request)).getrandbits
    records = []
    for index, token_id in enumerate(request.prompt_token_ids):
        bits = next_draw(64)  # drawn for every index so a later start sees the same values
        if index < request.prompt_logprob_start:
            continue
        record = cluster_pb2.TokenRecord(token_id=token_id)
        if index > 0:
            _fill_logprobs(record, token_id, bits, False, request.prompt_candidates)
        records.append(record)
    return records
