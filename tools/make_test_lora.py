"""Writes a small GGUF LoRA adapter for a base GGUF model: deterministic weights, no download, no training.

    python tools/make_test_lora.py BASE.gguf OUT.gguf [--rank 8] [--seed 0] [--targets attn_q,attn_v]

The adapter has, for every layer's target projection W (ggml shape [n_in, n_out]), `lora_a` [n_in, rank] and
`lora_b` [rank, n_out] (the layout llama.cpp's llama_adapter_lora_init expects), drawn from a seeded normal
distribution and scaled so that the update alpha/rank * B·A moves the output visibly but keeps it fluent. The
tests use it to compare the engine with llama-cpp-python's own `Llama(..., lora_path=...)`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

DEFAULT_TARGETS = ("attn_q", "attn_v")
WEIGHT_STD = 0.1  # B·A large enough that greedy output leaves the base model's within a few tokens, still fluent


def base_shapes(base: Path, targets: tuple[str, ...]) -> tuple[str, dict[str, tuple[int, int]]]:
    """The base model's architecture and the ggml shapes (n_in, n_out) of its target weights, by tensor name."""
    reader = gguf.GGUFReader(str(base))
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    shapes = {
        tensor.name: (int(tensor.shape[0]), int(tensor.shape[1]))
        for tensor in reader.tensors
        if tensor.name.startswith("blk.") and tensor.name.split(".")[2] in targets and len(tensor.shape) == 2
    }
    if not shapes:
        raise ValueError(f"{base} has no weights named blk.N.{{{','.join(targets)}}}.weight")
    return architecture, shapes


def write_adapter(
    base: Path, out: Path, rank: int = 8, seed: int = 0, targets: tuple[str, ...] = DEFAULT_TARGETS
) -> Path:
    architecture, shapes = base_shapes(base, targets)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), arch=architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))  # alpha/rank = 1: the update is B·A itself
    for name, (n_in, n_out) in sorted(shapes.items()):
        # numpy's shape is ggml's reversed: lora_a [n_in, rank] is (rank, n_in)
        writer.add_tensor(f"{name}.lora_a", rng.normal(0.0, WEIGHT_STD, (rank, n_in)).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", rng.normal(0.0, WEIGHT_STD, (n_out, rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    args = parser.parse_args(argv)
    write_adapter(args.base, args.out, args.rank, args.seed, tuple(args.targets.split(",")))
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
