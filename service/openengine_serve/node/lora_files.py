"""Where a node reads LoRA adapters: only GGUF files under its OPENENGINE_LORA_DIR.

A LoadLora names its file relative to that directory (or as an absolute path inside it); the node resolves
symbolic links and `..` before it looks, so no name reaches a file outside the directory.
"""

from __future__ import annotations

import os

import grpc

from ..common import gguf


class LoraFileError(Exception):
    """The named file may not or cannot be loaded: the message says why, `code` is the status to answer."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


def lora_file(lora_dir: str, source_path: str) -> str:
    """The absolute path of the adapter file `source_path` names; raises LoraFileError."""
    if not lora_dir:
        raise LoraFileError(
            "LoRA is off on this node: set OPENENGINE_LORA_DIR to the directory of the adapters",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    if not source_path:
        raise LoraFileError("adapter.source_path is empty: name the adapter's GGUF file in OPENENGINE_LORA_DIR")
    root = os.path.realpath(lora_dir)
    path = os.path.realpath(os.path.join(root, source_path))
    if os.path.commonpath([root, path]) != root:
        raise LoraFileError(
            f"adapter.source_path {source_path!r} is outside the adapter directory (OPENENGINE_LORA_DIR); name a "
            f"file in it"
        )
    if not os.path.isfile(path):
        raise LoraFileError(f"adapter.source_path {source_path!r}: no such file in the adapter directory")
    try:
        kind = gguf.read_header(path).get("general.type")
    except gguf.GgufError as exc:
        raise LoraFileError(f"adapter.source_path {source_path!r}: {exc}") from None
    if kind != "adapter":
        raise LoraFileError(
            f"adapter.source_path {source_path!r} is a GGUF of type {kind!r}, not a LoRA adapter (general.type "
            f"'adapter')"
        )
    return path
