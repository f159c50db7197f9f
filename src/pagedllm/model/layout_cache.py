"""The repacked layout of a GGUF's kept weights, cached for the next load.

Repacking a file's blocks into the kernels' layout (``kernels/quant.py``) is most of a
GGUF's start-up (Qwen2.5-Coder-0.5B: ~460 MiB, seconds to tens of seconds on two busy
cores); reading the result back is a file copy. The first load writes every kept weight,
as repacked, into one safetensors file under ``<cache>/layouts``, named by the GGUF's
path, size and modification time and by the layout's code (``kernels/quant.py`` and
``quant_layout.py``: a changed layout is repacked afresh); later loads read it instead of
repacking. Written whole or not at all (a temporary file renamed into place); a file that
cannot be read back is a miss (removed and repacked), a write that fails only costs the
next load its repacking, and writing a new layout removes the GGUF's older ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from pagedllm import quant_layout
from pagedllm.kernels import quant
from pagedllm.kernels.quant import QuantWeight
from pagedllm.util.memory import on_huge_pages

_META_KEY = "pagedllm_layouts"

logger = logging.getLogger(__name__)


def layout_cache_file(path: Path, cache: Path) -> Path:
    """Where the repacked weights of the GGUF at ``path`` are kept."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    for source in (quant.__file__, quant_layout.__file__):
        key.update(Path(source).read_bytes())
    return cache / f"{path.stem}-{key.hexdigest()[:16]}.safetensors"


def load_layouts(file: Path) -> dict[str, QuantWeight] | None:
    """The weights saved in ``file`` by name, or None where there is no such file or it
    cannot be read back (then it is removed: the caller repacks and writes it again)."""
    if not file.is_file():
        return None
    from safetensors import safe_open

    try:
        # Read, not mapped: a mapping lives while any weight viewing it does, and keeps
        # resident every page read, those of the q/k/v and gate/up parts the loader fuses
        # into new tensors included (each weight's bytes counted twice). Then onto huge
        # pages, as the fresh repacking's numpy buffers are.
        with safe_open(str(file), framework="pt", backend="pread") as handle:
            meta = json.loads((handle.metadata() or {})[_META_KEY])
            return {
                name: QuantWeight(format, on_huge_pages(handle.get_tensor(name)), stored)
                for name, (format, stored) in meta.items()
            }
    except Exception as error:  # any unreadable file is a miss, never a failed load
        logger.warning("layout cache %s unreadable (%s): repacking", file, error)
        file.unlink(missing_ok=True)
        return None


def save_layouts(file: Path, weights: dict[str, QuantWeight]) -> None:
    """Write ``weights`` to ``file`` whole (a concurrent writer may win the rename), then
    remove the same GGUF's older layouts; a failed write is logged, not raised."""
    try:
        _write(file, weights)
    except OSError as error:
        logger.warning("layout cache %s not written (%s)", file, error)
        return
    for older in file.parent.glob(f"{file.stem.rsplit('-', 1)[0]}-*.safetensors"):
        if older != file:
            older.unlink(missing_ok=True)


def _write(file: Path, weights: dict[str, QuantWeight]) -> None:
    from safetensors.torch import save_file

    meta = {name: (w.format, w.stored) for name, w in weights.items()}
    file.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".layout-", suffix=".tmp", dir=file.parent)
    os.close(handle)
    try:
        tensors = {name: w.data.contiguous() for name, w in weights.items()}
        save_file(tensors, temporary, metadata={_META_KEY: json.dumps(meta)})
        os.replace(temporary, file)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
