"""A GGUF file's metadata and tensor index, read in one pass over its header.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every value of every array in
the metadata; a 150k-token vocabulary and its merges take it tens of seconds. This reads
the same header (format version 2 or 3) into plain Python values (``gguf_header``), and maps
the tensors' data from the file (``numpy.memmap``, nothing copied) in the shapes the reader
gives them: quantized tensors as uint8 rows of blocks, float ones typed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.gguf_header import parse_header

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


def read_index(path: str | Path) -> GGUFIndex:
    """The metadata and tensors of the GGUF file at ``path``; ``ValueError`` for a file that
    is not GGUF version 2 or 3."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    header = parse_header(memoryview(mapped), str(path))
    tensors = []
    for info in header.tensors:
        name, dims, kind = info.name, info.dims, GGMLQuantizationType(info.type_code)
        block, size = GGML_QUANT_SIZES[kind]
        rows = dims[::-1]  # slowest first
        count = int(np.prod(dims))
        begin = header.data_start + info.offset
        if kind.name in _FLOAT_TYPES:
            dtype = _FLOAT_TYPES[kind.name]
            data = mapped[begin : begin + count * size].view(dtype).reshape(rows)
        else:
            row_bytes = dims[0] // block * size
            data = mapped[begin : begin + count // block * size].reshape(*rows[:-1], row_bytes)
        tensors.append(GGUFTensor(name, dims, kind, data))
    return GGUFIndex(header.fields, tensors)
