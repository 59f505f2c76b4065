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
    step_ms: float = 2.0  # step period in milliseconds
    ranks: int = 1  # MPI processes of the worker (they step together)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.ranks < 1 or self.step_ms <= 0:
            raise ValueError(f"invalid engine worker config: need max_batch >= 1, ranks >= 1 and step_ms > 0, "
                             f"got {self}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerConfig":
        values = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown engine worker config keys: {', '.join(sorted(unknown))}")
        return cls(**values)
