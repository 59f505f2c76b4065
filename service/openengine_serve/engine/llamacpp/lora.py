"""The engine's LoRA adapters: which are loaded, from which file, and which running requests use each.

An adapter is loaded by a LoadLora (the node's LoraCommand) or, on a node that started after it, by the first
request naming it (the request carries the file). At most `max_loras` are held. Unloading one that running
requests still use frees it once the last of them leaves the batch: nothing already accepted is lost.
"""

from __future__ import annotations

from collections import Counter

from openengine_serve.engine.llamacpp.runtime import LlamaError, LlamaModel


class LoraError(Exception):
    """What stops a load: the message names it, `code` is its grpc.StatusCode value."""

    INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED = 3, 9, 8

    def __init__(self, message: str, code: int = INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


class Adapters:
    def __init__(self, model: LlamaModel, max_loras: int) -> None:
        self._model = model
        self.max_loras = max_loras
        self.paths: dict[str, str] = {}  # name -> file, loaded
        self.users: Counter[str] = Counter()  # name -> running requests using it
        self._unloading: set[str] = set()  # unloaded while in use: freed when its last user leaves

    def load(self, name: str, path: str) -> bool:
        """Loads `name` from `path`; True when it was loaded from that file already. Raises LoraError."""
        if not self.max_loras:
            raise LoraError("LoRA is off on this node (OPENENGINE_LORA_DIR is not set)", LoraError.FAILED_PRECONDITION)
        loaded = self.paths.get(name)
        if loaded == path:
            self._unloading.discard(name)
            return True
        if loaded is not None:
            raise LoraError(
                f"the adapter {name!r} is loaded from another file ({loaded}); unload it first",
                LoraError.FAILED_PRECONDITION,
            )
        if len(self.paths) >= self.max_loras:
            raise LoraError(
                f"this node holds {len(self.paths)} adapters, its most (OPENENGINE_MAX_LORAS={self.max_loras}); "
                f"unload one first",
                LoraError.RESOURCE_EXHAUSTED,
            )
        try:
            self._model.load_adapter(name, path)
        except LlamaError as exc:
            raise LoraError(str(exc)) from None
        self.paths[name] = path
        return False

    def unload(self, name: str) -> None:
        """Frees the adapter now, or when the running requests using it have left (unknown names: nothing)."""
        if name not in self.paths:
            return
        if self.users[name]:
            self._unloading.add(name)
            return
        self._free(name)

    def acquire(self, name: str) -> None:
        self.users[name] += 1

    def release(self, name: str) -> None:
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]
            if name in self._unloading:
                self._free(name)

    def running(self) -> list[str]:
        return sorted(self.users)

    def apply(self, name: str) -> None:
        """The adapter the next decode runs with ("": the base model)."""
        self._model.apply_adapters(((name, 1.0),) if name else ())

    def _free(self, name: str) -> None:
        self._unloading.discard(name)
        del self.paths[name]
        self._model.unload_adapter(name)
