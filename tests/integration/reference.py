"""What a stream must contain, computed without the serving path: the simulated engine's model called directly.

A `Case` holds the parameters of one request. It builds both the public GenerateRequest (every sampling field
the model's token choice depends on set explicitly, the prompt as token ids so no tokenizer is involved) and the
model's own EngineRequest, then runs the model output by output to the end. `mismatch` compares the responses
of a stream with that reference: every token id of every output, its text, how it finished, and the usage.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from openengine_serve.api.openengine.v1 import error_pb2
from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.api.openengine_internal.v1 import cluster_pb2
from openengine_serve.common.vocab import BPE_RANKS, load_encoding
from openengine_serve.engine.simulated import model

from .conftest import MODEL, by_output


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
        engine_request = cluster_pb2.EngineRequest(
            prompt_token_ids=self.prompt_ids,
            num_sequences=self.num_sequences,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            top_p=1.0,
            top_k=0,
            seed=self.seed or 0,
            has_seed=self.seed is not None,
        )
        state = model.RequestState(engine_request)
        outputs = {}
        for index, sequence in list(state.outputs.items()):
            ids, finish = [], model.ENGINE_FINISH_NONE
            while finish == model.ENGINE_FINISH_NONE:
                token_id, finish, _ = state.next_token(sequence)
                ids.append(token_id)
            eos = finish == model.ENGINE_FINISH_EOS
            outputs[index] = Expected(ids[:-1] if eos else ids, eos, len(ids))
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
        if got["text"] != load_encoding().decode(want.ids):
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
