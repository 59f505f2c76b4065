"""GGUF metadata without llama.cpp: read a model file's key/value header, write a vocabulary-only copy.

A GGUF file is a header (magic, version, tensor count, key/value count), the
key/value pairs, the tensor descriptions and the tensor data. The node reads
the pairs (model name, context length, chat template) and hands frontends a
copy of the file with the same pairs and no tensors: llama.cpp loads it with
`vocab_only`, so the frontend tokenizes exactly as the engine does without
holding the weights. Only the header is read, never the tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# value type -> struct format of one scalar (GGUF's gguf_type enum)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """The file is not a GGUF model this reader understands; the message says what is wrong."""


@dataclass(frozen=True)
class GgufHeader:
    version: int
    tensor_count: int
    metadata: dict[str, Any]  # every key/value pair; arrays as lists
    metadata_bytes: bytes  # the key/value pairs exactly as stored in the file

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Reader:
    """Reads from a file and keeps the bytes it read, so that the pairs can be copied verbatim."""

    def __init__(self, file: BinaryIO, path: str) -> None:
        self._file = file
        self._path = path
        self.recorded = bytearray()

    def read(self, size: int) -> bytes:
        data = self._file.read(size)
        if len(data) != size:
            raise GgufError(f"{self._path}: the GGUF header ends early (truncated file?)")
        self.recorded += data
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.scalar("<Q")
        if size > 1 << 30:
            raise GgufError(f"{self._path}: a GGUF string of {size} bytes; the header is corrupt")
        return self.read(size).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if count > 1 << 28:
                raise GgufError(f"{self._path}: a GGUF array of {count} items; the header is corrupt")
            if item_type in _SCALARS:  # one read for the whole array
                fmt = _SCALARS[item_type]
                return list(struct.unpack(f"<{count}{fmt[1]}", self.read(count * struct.calcsize(fmt))))
            return [self.value(item_type) for _ in range(count)]
        raise GgufError(f"{self._path}: unknown GGUF value type {value_type}")


def read_header(path: str) -> GgufHeader:
    """The version, tensor count and key/value pairs of a GGUF file; GgufError when it is not one."""
    try:
        with open(path, "rb") as file:
            head = file.read(4)
            if head != MAGIC:
                raise GgufError(f"{path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
            reader = _Reader(file, path)
            version = reader.scalar("<I")
            if version not in _SUPPORTED_VERSIONS:
                raise GgufError(
                    f"{path}: GGUF version {version} is not supported (supported: "
                    f"{', '.join(map(str, _SUPPORTED_VERSIONS))})"
                )
            tensor_count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
            reader.recorded.clear()
            metadata = {}
            for _ in range(kv_count):
                key = reader.string()
                metadata[key] = reader.value(reader.scalar("<I"))
            return GgufHeader(version, tensor_count, metadata, bytes(reader.recorded))
    except OSError as exc:
        raise GgufError(f"cannot read the model file {path}: {exc.strerror or exc}") from None


def vocab_only(header: GgufHeader) -> bytes:
    """A GGUF file with the same key/value pairs and no tensors (what llama.cpp loads with `vocab_only`)."""
    body = MAGIC + struct.pack("<IQQ", header.version, 0, len(header.metadata)) + header.metadata_bytes
    alignment = int(header.get("general.alignment", _DEFAULT_ALIGNMENT)) or _DEFAULT_ALIGNMENT
    return body + b"\0" * (-len(body) % alignment)
