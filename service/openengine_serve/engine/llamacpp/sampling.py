"""Per-output sampling on a row of real logits, and logprob records from the same row.

Each output owns its sampler: its seed, penalties over its own history, and
its guide's matcher. The order, as in vLLM: penalties (repetition over the
prompt and the output, frequency and presence over the output), the masks
(no end of generation before `min_tokens` or with `ignore_eos`, no stop token
before `min_tokens`; with a guide, its grammar alone decides when the output
may end), the guide's mask (llguidance: the tokens the grammar allows next),
then temperature, top-k, top-p, min-p and a seeded draw (llama.cpp's sampler
chain); temperature 0 is greedy (the first highest logit). Logprobs are the
log-softmax of the raw row, before any of that, as vLLM reports them.
"""

from __future__ import annotations

import numpy as np

from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.llama_library import llama_cpp

_UINT32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def output_seed(request: cluster_pb2.EngineRequest, output_index: int) -> int:
    """The seed of one output's draws: the request's (folded to 32 bits) for output 0, distinct for the others;
    without a seed, llama.cpp picks a random one."""
    if not request.has_seed:
        return llama_cpp().LLAMA_DEFAULT_SEED
    seed = (request.seed ^ (request.seed >> 32) ^ (output_index * _GOLDEN32)) & _UINT32
    return seed if seed != llama_cpp().LLAMA_DEFAULT_SEED else seed - 1  # that value means "random"


def log_softmax(row: np.ndarray) -> np.ndarray:
    """log p of every token, in float64."""
    values = row.astype(np.float64)
    values -= values.max()
    values -= np.log(np.exp(values).sum())
    return values


def token_record(
    token_id: int, logprobs: np.ndarray | None, candidates: cluster_pb2.Candidates
) -> cluster_pb2.TokenRecord:
    """The record of a token: its logprob and rank (1: the most likely) and the asked candidates."""
    record = cluster_pb2.TokenRecord(token_id=token_id)
    if logprobs is None:
        return record
    logprob = logprobs[token_id]
    record.has_logprob = True
    record.logprob = float(logprob)
    record.rank = int(np.count_nonzero(logprobs > logprob)) + 1
    if candidates.top_n:
        top = np.argpartition(-logprobs, candidates.top_n - 1)[: candidates.top_n]
        top = top[np.lexsort((top, -logprobs[top]))]  # most likely first; ties by id
        for rank, candidate in enumerate(top.tolist(), start=1):
            record.candidates.add(token_id=candidate, logprob=float(logprobs[candidate]), rank=rank)
    if candidates.token_ids:
        asked = np.asarray(candidates.token_ids, np.int64)
        asked_logprobs = logprobs[asked]
        ranks = np.count_nonzero(logprobs[None, :] > asked_logprobs[:, None], axis=1) + 1
        for candidate, candidate_logprob, rank in zip(asked.tolist(), asked_logprobs.tolist(), ranks.tolist()):
            record.candidates.add(token_id=candidate, logprob=candidate_logprob, rank=rank)
    return record


class OutputSampler:
    """The sampling state of one output of a request (see the module docstring)."""

    def __init__(
        self, request: cluster_pb2.EngineRequest, output_index: int, vocab_size: int, end_of_generation: np.ndarray
    ) -> None:
        lib = self._lib = llama_cpp()
        self.guide = None  # the output's llguidance matcher (set once the guide compiled)
        self._vocab_size = vocab_size
        self.greedy = request.temperature == 0 or request.top_k == 1
        self._chain = None
        if not self.greedy:
            chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(request.temperature))
            if request.top_k > 0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(request.top_k))
            if 0 < request.top_p < 1:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(request.top_p, 1))
            if request.min_p > 0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(request.min_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(output_seed(request, output_index)))
            self._chain = chain
        self._repetition = request.repetition_penalty if request.repetition_penalty > 0 else 1.0
        self._frequency = request.frequency_penalty
        self._presence = request.presence_penalty
        self._counts: dict[int, int] = {}  # output token -> times generated
        self._seen = None
        if self._repetition != 1.0:
            self._seen = np.zeros(vocab_size, np.bool_)
            self._seen[np.asarray(request.prompt_token_ids, np.int64)] = True
        self._end_of_generation = end_of_generation
        self._ignore_eos = request.ignore_eos
        self._min_tokens = request.min_tokens
        self._stop_ids = np.asarray(request.stop_token_ids, np.int64)

    def choose(self, model, batch_index: int, row: np.ndarray, generated: int, mask: np.ndarray) -> int:
        """The next token from `row` (the logits at `batch_index`, changed in place), `generated` tokens in;
        `mask`: a buffer for the guide's bitmask."""
        self._penalize(row)
        early = generated < self._min_tokens
        if (early or self._ignore_eos) and self.guide is None:
            row[self._end_of_generation] = -np.inf
        if early and self._stop_ids.size:
            row[self._stop_ids] = -np.inf
        if self.guide is not None:
            self.guide.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            allowed = np.unpackbits(mask.view(np.uint8), count=self._vocab_size, bitorder="little")
            row[allowed == 0] = -np.inf
        if self.greedy:
            return int(row.argmax())
        return self._lib.llama_sampler_sample(self._chain, model.context, batch_index)

    def accept(self, token_id: int) -> str:
        """The token joins the output's history (penalties, the guide's state); the guide's error, if the
        token broke it."""
        self._counts[token_id] = self._counts.get(token_id, 0) + 1
        if self._seen is not None:
            self._seen[token_id] = True
        if self.guide is not None and not self.guide.consume_token(token_id):
            return self.guide.get_error() or f"token {token_id} is not allowed by the guide"
        return ""

    def _penalize(self, row: np.ndarray) -> None:
        if self._seen is not None:
            seen = np.flatnonzero(self._seen)
            values = row[seen]
            row[seen] = np.where(values > 0, values / self._repetition, values * self._repetition)
        if (self._frequency or self._presence) and self._counts:
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float32, len(self._counts))
            row[ids] -= self._frequency * counts + self._presence

    def close(self) -> None:
        if self._chain is not None:
            self._lib.llama_sampler_free(self._chain)
            self._chain = None
