"""llama.cpp through llama-cpp-python's low-level bindings, initialised once per process.

Both the engine (the model) and the frontend (the tokenizer of a vocabulary-only
GGUF) use it. llama.cpp logs every load at length on stderr; its warnings and
errors go to this module's logger instead, the rest is dropped. Its last errors
are kept too, so that a failed call can say what llama.cpp refused.
"""

from __future__ import annotations

import collections
import functools
import logging
from types import ModuleType

logger = logging.getLogger("openengine_serve.llama_cpp")

_GGML_LOG_LEVEL_WARN = 3  # ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
_GGML_LOG_LEVEL_ERROR = 4
_GGML_LOG_LEVEL_CONT = 5
# A KV cache shared by every sequence is larger than the trained context by design; the engine bounds each
# request by the trained context (engine/model_card.py), so this warning says nothing to an operator.
_EXPECTED_WARNINGS = (b"possible training context overflow",)
_callback = None  # the ctypes callback must outlive every call llama.cpp makes to it
_errors: collections.deque[str] = collections.deque(maxlen=4)  # llama.cpp's last error lines


def take_errors() -> str:
    """llama.cpp's error lines since the last call (e.g. why a model did not load), joined; empty when none."""
    text = "; ".join(_errors)
    _errors.clear()
    return text


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
            line = text.decode("utf-8", "replace").rstrip()
            logger.warning("llama.cpp: %s", line)
            if level == _GGML_LOG_LEVEL_ERROR:
                _errors.append(line)

    _callback = log
    bindings.llama_log_set(log, None)
    bindings.llama_backend_init()
    return bindings


def model_params():
    """llama.cpp's default model parameters, except on a CPU with AMX: there llama.cpp repacks the weights for its
    AMX kernels, which crash on K-quant models such as Gemma 3's Q4_K_M (llama.cpp issue 20824), so the weights
    stay as loaded (no extra buffer types) and run on the CPU's AVX-512 kernels."""
    lib = llama_cpp()
    params = lib.llama_model_default_params()
    if b"AMX_INT8 = 1" in lib.llama_print_system_info():
        params.use_extra_bufts = False
    return params
