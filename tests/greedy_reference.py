"""llama-cpp-python's own Llama as the tests' reference, and whether served tokens are a greedy continuation of the
model: checked against its logits.

A greedy output read in another batch shape than the reference's (other requests in its steps, a prompt from the
prefix cache, another CPU's kernels) can take the second most likely token where the two are within a few
hundredths of a logit: the rounding of ggml's sums differs (docs/engines.md, batch invariance). So each served
token must be the reference's top token, or within NEAR_TIE of it, at every position, given the tokens served
before it (teacher forcing: one pass of the reference over the prompt and the output).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# In logits (= in logprobs): the largest gap by which a served token may lie below the reference's top token.
# Measured flips lie within 0.01-0.58 (docs/engines.md; the largest on a plain-AVX2 build reading a prompt from the
# prefix cache); 1.0 is a likelihood ratio of 2.7 to 1, while a token of another prompt's output typically lies
# several logits below the top (6.7 and 12.8 in the swapped-stream checks).
NEAR_TIE = 1.0


@dataclass(frozen=True)
class Gap:
    position: int  # index in the output
    token_id: int
    top_token_id: int
    gap: float  # the top logit minus the served token's logit


THREADS = 2


def llama_reference(model_path: str, **options):
    """llama-cpp-python's own high-level Llama on a GGUF, with the engine's numerics: flash attention, `THREADS`
    threads, and the weights loaded with the engine's model parameters (common/llama_library.py)."""
    import llama_cpp
    import llama_cpp.llama as high_level

    from openengine_serve.common.llama_library import model_params

    default_params = high_level.llama_cpp.llama_model_default_params
    high_level.llama_cpp.llama_model_default_params = model_params
    try:
        return llama_cpp.Llama(
            model_path=model_path, n_threads=THREADS, flash_attn=True, verbose=False, **{"n_ctx": 2048, **options}
        )
    finally:
        high_level.llama_cpp.llama_model_default_params = default_params


def reference_model(n_ctx: int = 2048):
    """The reference on the default GGUF, keeping the logits of every position."""
    from openengine_serve.engine.model_card import default_model_path

    return llama_reference(default_model_path(), n_ctx=n_ctx, logits_all=True)


def end_of_generation_ids(model) -> list[int]:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(model.model)
    return [t for t in range(model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]


def gaps(model, prompt: list[int], output: list[int], ignore_eos: bool = False) -> list[Gap]:
    """For each output token: how far its logit lies below the top logit of the reference's row before it
    (with `ignore_eos`, the top among the tokens that do not end the output, as the engine masks them)."""
    if not output:
        return []
    model.reset()
    model.eval(prompt + output[:-1])
    rows = np.array(model.scores[len(prompt) - 1 : len(prompt) - 1 + len(output)], np.float64)
    if ignore_eos:
        rows[:, end_of_generation_ids(model)] = -np.inf
    return [
        Gap(i, token, int(row.argmax()), float(row.max() - row[token]))
        for i, (row, token) in enumerate(zip(rows, output))
    ]


def first_beyond_near_tie(
    model, prompt: list[int], output: list[int], ignore_eos: bool = False, margin: float = NEAR_TIE
) -> Gap | None:
    """The first output token that is not a greedy choice of the reference within `margin`, or None."""
    return next((g for g in gaps(model, prompt, output, ignore_eos) if g.gap > margin), None)
