"""llama.cpp through llama-cpp-python's low-level bindings, initialised once per process.

Both the engine (the model) and the frontend (the tokenizer of a vocabulary-only
GGUF) use it. llama.cpp logs every load at length on stderr; its warnings and
errors go to this module's logger instead, the rest is dropped.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

logger = logging.getLogger("openengine_serve.llama_cpp")

_GGML_LOG_LEVEL_WARN = 3  # ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
_GGML_LOG_LEVEL_CONT = 5
# A KV cache shared by every sequence is larger than the trained context by design; the engine bounds each
# request by the trained context (engine/model_card.py), so this warning says nothing to an operator.
_EXPECTED_WARNINGS = (b"possible training context overflow",)
_callback = None  # the ctypes callback must outlive every call llama.cpp makes to it


@functools.lru_cache(maxsize=1)
def llama_cpp() -> ModuleType:
    """The bindings, with the backend initialised and llama.cpp's log routed to `logger`."""
    global _callback
    import llama_cpp as bindings

    @bindings.llama_log_callback
    def log(level: int, text: bytes, _user_data) -> None:
        if (
            level >= _GGML_LOG_LEVEL_WARN
            and level != _GGML_LOG_LEVEL_CONT
            and text
            and not any(expected in text for expected in _EXPECTED_WARNINGS)
        ):
            logger.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

    _callback = log
    bindings.llama_log_set(log, None)
    bindings.llama_backend_init()
    return bindings
