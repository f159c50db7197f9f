"""A GGUF file's metadata and tensor index, read in one pass over its header.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every value of every array in
the metadata; a 150k-token vocabulary and its merges take it tens of seconds. This reads
the same header (format version 2 or 3) with ``struct`` into plain Python values, and maps
the tensors' data from the file (``numpy.memmap``, nothing copied) in the shapes the reader
gives them: quantized tensors as uint8 rows of blocks, float ones typed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types: struct format of the scalars.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: its GGUF name, dims (fastest first, as GGUF lists them), GGML type and
    data (a view of the file)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    """The metadata (key -> value: int, float, bool, str or list) and the tensors."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def read(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buffer, self.offset)[0]
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.read("Q")
        text = bytes(self.buffer[self.offset : self.offset + size]).decode("utf-8", "replace")
        self.offset += size
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.read(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"GGUF: unknown metadata value type {kind}")
        item, count = self.read("I"), self.read("Q")
        if item in _SCALARS:  # a numeric array in one read
            fmt = _SCALARS[item]
            values = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.offset)
            self.offset += count * struct.calcsize(fmt)
            return list(values)
        return [self.value(item) for _ in range(count)]


def read_index(path: str | Path) -> GGUFIndex:
    """The metadata and tensors of the GGUF file at ``path``; ``ValueError`` for a file that
    is not GGUF version 2 or 3."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped))
    if bytes(cursor.buffer[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor.offset = 4
    version = cursor.read("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_fields = cursor.read("Q"), cursor.read("Q")
    fields = {}
    for _ in range(num_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.read("I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.read("Q") for _ in range(cursor.read("I")))
        infos.append((name, dims, GGMLQuantizationType(cursor.read("I")), cursor.read("Q")))
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        rows = dims[::-1]  # slowest first
        count = int(np.prod(dims))
        begin = start + offset
        if kind.name in _FLOAT_TYPES:
            dtype = _FLOAT_TYPES[kind.name]
            data = mapped[begin : begin + count * size].view(dtype).reshape(rows)
        else:
            row_bytes = dims[0] // block * size
            data = mapped[begin : begin + count // block * size].reshape(*rows[:-1], row_bytes)
        tensors.append(GGUFTensor(name, dims, kind, data))
    return GGUFIndex(fields, tensors)
