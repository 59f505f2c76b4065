"""How many of 32 concurrent greedy requests stay identical to llama-cpp-python's own greedy generation.

    python -m openengine_bench.batch_invariance [--streams 32] [--max-tokens 128] [--output DIR]

Starts `openengine-serve up` with the llama.cpp engine (the embedded model, or OPENENGINE_MODEL_PATH), sends
`--streams` greedy requests at once (distinct prompts, EOS ignored), and compares each output with the same
prompt ids generated alone by llama-cpp-python's high-level API on the same GGUF (flash attention, the same
threads). For every output that differs it reports where, and the margin between the two most likely tokens
at that position as the served run saw it (a near tie is where a last-bits difference of the logits flips
the greedy choice). Writes DIR/batch_invariance.json and DIR/batch_invariance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from openengine_serve.api.openengine.v1 import generation_pb2 as G
from openengine_serve.client import AsyncClient, is_serving
from openengine_serve.common.net import free_port
from openengine_serve.engine.model_card import default_model_path
from openengine_serve.local import component_command

SUBJECTS = [
    "the sea",
    "a lighthouse",
    "mountains",
    "a city at night",
    "autumn leaves",
    "a train journey",
    "the moon",
    "a library",
    "coffee",
    "rain",
    "a garden",
    "the desert",
    "winter",
    "a violin",
    "the stars",
    "a market",
    "an old clock",
    "a river",
    "friendship",
    "the first snow",
    "a harbour",
    "bees",
    "a bridge",
    "the wind",
    "a kitchen",
    "a forest path",
    "thunder",
    "a lantern",
    "the ocean floor",
    "a chess game",
    "morning fog",
    "a kite",
]


def prompts(count: int) -> list[str]:
    forms = ["Write a short poem about {}.", "Describe {} in three sentences.", "Tell me a fact about {}."]
    return [forms[i % len(forms)].format(SUBJECTS[i % len(SUBJECTS)]) for i in range(count)]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


async def served(target: str, model: str, prompt_ids: list[list[int]], max_tokens: int) -> list[list]:
    """Every stream at once; per stream its token infos (id, top-2 logprobs)."""
    async with AsyncClient(target) as client:

        async def one(ids: list[int]) -> list:
            req = G.GenerateRequest(
                request_id=f"inv-{uuid.uuid4()}",
                model=model,
                token_ids=G.TokenIds(ids=ids),
                stopping=G.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
                response=G.ResponseOptions(return_output_logprobs=True),
            )
            req.sampling.temperature = 0
            req.response.output_candidates.top_n = 2
            return [
                t
                async for r in client.inference.Generate(req, timeout=600)
                if r.WhichOneof("event") == "token"
                for t in r.token.tokens
            ]

        return await asyncio.gather(*(one(ids) for ids in prompt_ids))


def reference_greedy(llm, ids: list[int], max_tokens: int, end_of_generation: set[int]) -> list[int]:
    """Greedy, with end-of-generation tokens banned as ignore_eos bans them in the engine."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(max_tokens):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        row[list(end_of_generation)] = -np.inf
        token = int(row.argmax())
        out.append(token)
        llm.eval([token])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("docs/bench/batch-invariance"))
    args = parser.parse_args(argv)

    import llama_cpp

    from openengine_serve.common.llama_library import cpu_backend

    cpu_backend()  # the engine's CPU backend variant, before llama-cpp-python loads the weights
    path = os.environ.get("OPENENGINE_MODEL_PATH") or default_model_path()
    llm = llama_cpp.Llama(
        model_path=path, n_ctx=4096, n_threads=args.threads, flash_attn=True, logits_all=True, verbose=False
    )
    texts = [chat(p) for p in prompts(args.streams)]
    prompt_ids = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts]
    vocab = llm._model.vocab
    end_of_generation = {t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}

    port = free_port()
    env = {**os.environ, "OPENENGINE_THREADS": str(args.threads), "OPENENGINE_MAX_BATCH": str(args.streams)}
    stack = subprocess.Popen(
        component_command("up", "127.0.0.1", port, engine="llama.cpp"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not is_serving(f"127.0.0.1:{port}"):
            if time.monotonic() > deadline or stack.poll() is not None:
                raise SystemExit("the stack did not become ready")
            time.sleep(0.5)
        from openengine_serve.client import Client, served_model

        with Client(f"127.0.0.1:{port}") as client:
            model = served_model(client).served_model_name
        outputs = asyncio.run(served(f"127.0.0.1:{port}", model, prompt_ids, args.max_tokens))
    finally:
        stack.send_signal(signal.SIGTERM)
        stack.wait(timeout=60)

    rows = []
    for ids, infos in zip(prompt_ids, outputs):
        reference = reference_greedy(llm, ids, args.max_tokens, end_of_generation)
        tokens = [t.token_id for t in infos]
        diverge = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
        margin = None
        if diverge is not None and len(infos[diverge].candidates) == 2:
            first, second = infos[diverge].candidates
            margin = first.logprob - second.logprob
        rows.append(
            {
                "prompt_tokens": len(ids),
                "identical": diverge is None,
                "diverges_at": diverge,
                "top2_logprob_margin": margin,
            }
        )
    identical = sum(1 for r in rows if r["identical"])
    args.output.mkdir(parents=True, exist_ok=True)
    result = {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "identical": identical,
        "rows": rows,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": args.threads,
    }
    (args.output / "batch_invariance.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Batch invariance: {identical} of {args.streams} concurrent greedy streams identical to the reference",
        "",
        f"{result['date']}; {args.streams} streams x {args.max_tokens} greedy tokens (EOS ignored), "
        f"{args.threads} threads; reference: llama-cpp-python's own API on the same GGUF, each prompt alone.",
        "",
        "| stream | prompt tokens | first different token | top-2 logprob margin there |",
        "|---|---|---|---|",
    ]
    for number, row in enumerate(rows):
        if not row["identical"]:
            margin = "-" if row["top2_logprob_margin"] is None else f"{row['top2_logprob_margin']:.4f}"
            lines.append(f"| {number} | {row['prompt_tokens']} | {row['diverges_at']} | {margin} |")
    margins = [r["top2_logprob_margin"] for r in rows if r["top2_logprob_margin"] is not None]
    if margins:
        lines += [
            "",
            f"Median margin at the divergence: {sorted(margins)[len(margins) // 2]:.4f} "
            f"(a margin of {math.log(2):.3f} is a 2:1 likelihood).",
        ]
    (args.output / "batch_invariance.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
