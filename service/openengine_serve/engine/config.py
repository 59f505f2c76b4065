"""What the node tells its engine worker: one typed config shared by both sides.

The node (node/engine_link.py) builds a WorkerConfig, hands it to the launcher
as JSON on its command line (`--config`), and the launcher broadcasts it to the
worker ranks over MPI. Importing this module pulls in neither MPI nor ZMQ.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

LAUNCHER_MODULE = "openengine_serve.engine.launcher"
WORKER_MODULE = "openengine_serve.engine.worker"


@dataclass(frozen=True)
class WorkerConfig:
    command_address: str  # ZMQ address the node binds for EngineCommand (the worker PULLs)
    step_address: str  # ZMQ address the node binds for EngineStep (the worker PUSHes)
    max_batch: int  # most sequences (outputs) running at once
    engine: str = "simulated"  # "simulated" or "llama.cpp" (engine/worker.py: create_engine)
    step_ms: float = 2.0  # simulated: step period in milliseconds
    ranks: int = 1  # simulated: MPI processes of the worker (they step together)
    model_path: str = ""  # llama.cpp: the GGUF file
    context_size: int = 16384  # llama.cpp: KV cache cells shared by every sequence
    prefill_chunk: int = 256  # llama.cpp: prompt tokens per step, over every admitted prompt
    threads: int = 1  # llama.cpp: CPU threads of the decode
    prefix_cache_tokens: int = 0  # llama.cpp: KV cells the prefix cache may keep (0: no prefix cache)
    max_guided_sequences: int = 32  # llama.cpp: guided outputs running at once
    max_loras: int = 0  # llama.cpp: LoRA adapters held at once (0: LoRA off)
    log_level: str = "info"  # the worker's log lines (on the node's stderr, component=engine-worker)

    def __post_init__(self) -> None:
        if (
            self.max_batch < 1
            or self.ranks < 1
            or self.step_ms <= 0
            or self.context_size < 1
            or self.prefill_chunk < 1
            or self.threads < 1
            or self.prefix_cache_tokens < 0
            or self.max_guided_sequences < 0
            or self.max_loras < 0
        ):
            raise ValueError(
                f"invalid engine worker config: need max_batch >= 1, ranks >= 1, step_ms > 0, "
                f"context_size >= 1, prefill_chunk >= 1, threads >= 1, prefix_cache_tokens >= 0 "
                f"max_guided_sequences >= 0 and max_loras >= 0, got {self}"
            )
        if self.engine not in ("simulated", "llama.cpp"):
            raise ValueError(
                f"invalid engine worker config: engine must be simulated or llama.cpp, got {self.engine!r}"
            )
        if self.engine == "llama.cpp" and (self.ranks != 1 or not self.model_path):
            raise ValueError(
                f"invalid engine worker config: llama.cpp runs in one rank and needs model_path, got {self}"
            )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        values = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown engine worker config keys: {', '.join(sorted(unknown))}")
        return cls(**values)
