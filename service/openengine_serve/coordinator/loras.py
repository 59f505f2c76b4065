"""The deployment's LoRA adapters as the coordinator lists them: name, id and file (LoadLora's source_path), and
the models each serves (an adapter fits one base model: the models whose nodes loaded it).

Frontends read the list from every heartbeat reply and accept a request's `lora_name` only when it is on it for
the request's model; the request carries the file, so a node that started after the adapter was loaded loads it
on first use.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from ..api.openengine.v1 import lora_pb2
from ..api.openengine_internal.v1 import cluster_pb2


class LoraTable:
    def __init__(self) -> None:
        self.adapters: dict[str, lora_pb2.LoraAdapter] = {}
        self.models: dict[str, set[str]] = {}  # adapter name -> the model cards it serves
        self._ids = itertools.count(1)

    def holds(self, adapter: lora_pb2.LoraAdapter) -> bool:
        """Listed under its name with its file."""
        listed = self.adapters.get(adapter.lora_name)
        return listed is not None and listed.source_path == adapter.source_path

    def add(self, adapter: lora_pb2.LoraAdapter, models: Iterable[str]) -> tuple[lora_pb2.LoraAdapter, bool]:
        """Lists the adapter with an id of its own for `models` (added to those it served already); returns it,
        and True when it was listed already."""
        name = adapter.lora_name
        self.models.setdefault(name, set()).update(models)
        if self.holds(adapter):
            return self.adapters[name], True
        listed = lora_pb2.LoraAdapter(lora_id=next(self._ids), lora_name=name, source_path=adapter.source_path)
        self.adapters[name] = listed
        return listed, False

    def remove(self, name: str) -> lora_pb2.LoraAdapter | None:
        self.models.pop(name, None)
        return self.adapters.pop(name, None)

    def served_models(self) -> list[cluster_pb2.LoraModels]:
        return [cluster_pb2.LoraModels(lora_name=name, models=sorted(models)) for name, models in self.models.items()]

    def not_found(self, name: str) -> str:
        listed = ", ".join(repr(n) for n in sorted(self.adapters)) or "none"
        return f"no LoRA adapter named {name!r} is loaded (loaded: {listed})"
