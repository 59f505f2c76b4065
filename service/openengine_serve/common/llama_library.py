"""llama.cpp through llama-cpp-python's low-level bindings, initialised once per process.

Both the engine (the model) and the frontend (the tokenizer of a vocabulary-only
GGUF) use it. llama.cpp logs every load at length on stderr; its warnings and
errors go to this module's logger instead, the rest is dropped. Its last errors
are kept too, so that a failed call can say what llama.cpp refused.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("openengine_serve.llama_cpp")

_GGML_LOG_LEVEL_WARN = 3  # ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
_GGML_LOG_LEVEL_ERROR = 4
_GGML_LOG_LEVEL_CONT = 5
# A KV cache shared by every sequence is larger than the trained context by design; the engine bounds each
# request by the trained context (engine/model_card.py), so this warning says nothing to an operator.
_EXPECTED_WARNINGS = (b"possible training context overflow",)
_GGML_LOG_LEVEL_INFO = 2
_LOADED_BACKEND = b"loaded CPU backend from "  # ggml's line naming the CPU variant it loaded
CPU_VARIANT_ENV = "OPENENGINE_CPU_VARIANT"
_callback = None  # the ctypes callback must outlive every call llama.cpp makes to it
_errors: collections.deque[str] = collections.deque(maxlen=4)  # llama.cpp's last error lines
_loaded_cpu_backend = ""  # the CPU backend library ggml last said it loaded


def take_errors() -> str:
    """llama.cpp's error lines since the last call (e.g. why a model did not load), joined; empty when none."""
    text = "; ".join(_errors)
    _errors.clear()
    return text


@functools.lru_cache(maxsize=1)
def llama_cpp() -> ModuleType:
    """The bindings, with llama.cpp's log routed to `logger` (enough for a vocabulary-only load; weights need
    `cpu_backend()` too)."""
    global _callback
    import llama_cpp as bindings

    @bindings.llama_log_callback
    def log(level: int, text: bytes, _user_data) -> None:
        global _loaded_cpu_backend
        if level == _GGML_LOG_LEVEL_INFO and _LOADED_BACKEND in text:
            _loaded_cpu_backend = text.split(_LOADED_BACKEND, 1)[1].decode("utf-8", "replace").strip()
        elif (
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


@functools.lru_cache(maxsize=1)
def cpu_backend() -> str:
    """Loads llama.cpp's CPU backend, once per process, and returns its variant (e.g. "sapphirerapids"; "built in"
    for a build that links it in). The variant is the best for this CPU, or the one OPENENGINE_CPU_VARIANT names;
    RuntimeError when it is not in the build or cannot run on this CPU."""
    bindings = llama_cpp()
    library_dir = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(str(bindings.__file__)).parent / "lib")
    try:
        # libllama's own ggml, found by its soname: the wheel's libggml.so is a copy, which would load a second
        # ggml with a registry of its own
        ggml = ctypes.CDLL("libggml.so.0")
    except OSError:
        ggml = ctypes.CDLL(str(library_dir / "libggml.so"))
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_load.restype = ctypes.c_void_p
    ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    variants = sorted(p.stem.removeprefix("libggml-cpu-") for p in library_dir.glob("libggml-cpu-*.so"))
    forced = os.environ.get(CPU_VARIANT_ENV, "")
    if ggml.ggml_backend_reg_count() > 0 and not variants:
        if forced:
            raise RuntimeError(f"{CPU_VARIANT_ENV}={forced}: this llama.cpp build has its CPU backend built in")
        return "built in"
    if forced:
        if forced not in variants:
            raise RuntimeError(f"{CPU_VARIANT_ENV}={forced} is not a CPU variant of this build: {', '.join(variants)}")
        if not ggml.ggml_backend_load(str(library_dir / f"libggml-cpu-{forced}.so").encode()):
            raise RuntimeError(f"{CPU_VARIANT_ENV}={forced}: this CPU lacks instructions that variant needs")
    else:
        ggml.ggml_backend_load_all_from_path(str(library_dir).encode())
    if ggml.ggml_backend_reg_count() == 0 or not _loaded_cpu_backend:
        raise RuntimeError(f"no llama.cpp CPU backend in {library_dir} runs on this CPU (variants: {variants})")
    variant = Path(_loaded_cpu_backend).stem.removeprefix("libggml-cpu-")
    logger.info("llama.cpp CPU variant: %s%s", variant, " (forced)" if forced else "")
    return variant


def model_params():
    """llama.cpp's default model parameters, except on a CPU with AMX: there llama.cpp repacks the weights for its
    AMX kernels, which crash on K-quant models such as Gemma 3's Q4_K_M (llama.cpp issue 20824), so the weights
    stay as loaded (no extra buffer types) and run on the CPU's AVX-512 kernels. Loads the CPU backend first."""
    lib = llama_cpp()
    cpu_backend()
    params = lib.llama_model_default_params()
    if b"AMX_INT8 = 1" in lib.llama_print_system_info():
        params.use_extra_bufts = False
    return params
