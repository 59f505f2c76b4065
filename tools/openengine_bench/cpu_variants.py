"""Decode speed of llama.cpp's CPU backend variants, against each other and against another build.

    python -m openengine_bench.cpu_variants [--variants best,haswell] [--build NAME=DIR ...]
                                           [--rounds 3] [--steps 64] [--output DIR]

Each measurement is a fresh process that loads the model with the engine's own code (engine/llamacpp/runtime.py:
its context parameters, flash attention, the node's default threads) and times greedy decode steps of 1 and of
32 sequences. `--variants` are CPU variants of the installed wheel (`best`: the one llama.cpp picks for this
CPU); `--build NAME=DIR` adds a llama.cpp library directory built otherwise (e.g. for this CPU only, with
CMAKE_ARGS="-DGGML_NATIVE=ON"), loaded through LLAMA_CPP_LIB_PATH. Rounds are interleaved, so the machine's
drift touches every subject alike. Prints a table of median tokens/s [range]; writes DIR/cpu_variants.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from openengine_serve.common.cpu_budget import cpu_budget
from openengine_serve.common.llama_library import CPU_VARIANT_ENV

BATCHES = (1, 32)
PROMPT = [504, 2670, 282, 260, 9019, 2766, 5084]  # a few SmolLM2 tokens: the speed of decode, not of prompts

MEASURE = """
import json, sys, time
import numpy as np
from openengine_serve.common.llama_library import cpu_backend
from openengine_serve.engine.llamacpp.runtime import LlamaModel, TokenBatch
from openengine_serve.engine.model_card import default_model_path

steps, threads, batches, prompt = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
model = LlamaModel(default_model_path(), context_size=16384, batch_tokens=512, sequences=max(batches), threads=threads)
batch = TokenBatch(512)
out = {"variant": cpu_backend()}
for streams in batches:
    batch.clear()
    for s in range(streams):
        model.forget(s)
        batch.add(prompt, 0, s, len(prompt) - 1)
    model.decode(batch)
    tokens = [int(np.argmax(model.logits(s * len(prompt) + len(prompt) - 1))) for s in range(streams)]
    started = time.perf_counter()
    for step in range(steps):
        batch.clear()
        for s in range(streams):
            batch.add([tokens[s]], len(prompt) + step, s, 0)
        model.decode(batch)
        tokens = [int(np.argmax(model.logits(s))) for s in range(streams)]
    out[str(streams)] = steps * streams / (time.perf_counter() - started)
print(json.dumps(out))
"""


def measure(env: dict[str, str], steps: int, threads: int) -> dict:
    args = [str(steps), str(threads), json.dumps(BATCHES), json.dumps(PROMPT)]
    done = subprocess.run([sys.executable, "-c", MEASURE, *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cpu_variants: the measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def subjects(variants: list[str], builds: list[str]) -> dict[str, dict[str, str]]:
    """Subject name -> the environment of its process."""
    base = {k: v for k, v in os.environ.items() if k not in (CPU_VARIANT_ENV, "LLAMA_CPP_LIB_PATH")}
    out = {v: base if v == "best" else base | {CPU_VARIANT_ENV: v} for v in variants}
    for build in builds:
        name, _, directory = build.partition("=")
        if not directory:
            raise SystemExit(f"cpu_variants: --build wants NAME=DIR, got {build!r}")
        out[name] = base | {"LLAMA_CPP_LIB_PATH": str(Path(directory).resolve())}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="best,haswell", help="comma-separated; best: llama.cpp's choice")
    parser.add_argument("--build", action="append", default=[], metavar="NAME=DIR", help="another llama.cpp build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    threads = max(1, int(cpu_budget().cpus))
    envs = subjects([v for v in args.variants.split(",") if v], args.build)
    runs: dict[str, list[dict]] = {name: [] for name in envs}
    for _ in range(args.rounds):
        for name, env in envs.items():
            runs[name].append(measure(env, args.steps, threads))
    rows = ["| subject | variant loaded | " + " | ".join(f"{b} sequences, tokens/s" for b in BATCHES) + " |"]
    rows.append("|---|---|" + "---|" * len(BATCHES))
    summary = {}
    for name, results in runs.items():
        cells = {str(b): [r[str(b)] for r in results] for b in BATCHES}
        summary[name] = {"variant": results[0]["variant"], **{b: statistics.median(v) for b, v in cells.items()}}
        shown = " | ".join(f"{statistics.median(v):.1f} [{min(v):.1f}–{max(v):.1f}]" for v in cells.values())
        rows.append(f"| {name} | {results[0]['variant']} | {shown} |")
    table = "\n".join(rows)
    print(f"threads {threads}, {args.steps} decode steps, median [range] of {args.rounds} interleaved rounds\n")
    print(table)
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        result = {"threads": threads, "steps": args.steps, "rounds": runs, "median": summary, "table": table}
        (args.output / "cpu_variants.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
