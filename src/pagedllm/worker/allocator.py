"""Where the CPU engine's memory comes from: step buffers from the heap, the KV cache on
huge pages (``BlockArena``: resizable at run time, the tail given back to the kernel).

Step buffers (``keep_step_buffers``): kept in the heap instead of fresh pages from the kernel.

glibc serves allocations above its mmap threshold (128 KiB, rising to at most 32 MiB as
large blocks are freed) with fresh ``mmap`` pages, and gives freed heap tops back to the
kernel. A model step allocates the same activation buffers every time (a 2048-token prefill
step: 2-13 MB each), so each step pays page faults and zeroing on every one of them, which
slows the step's large products. This is what vLLM's CPU backend gets from preloading
tcmalloc; ``mallopt`` does it in-process.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
from collections.abc import Sequence

import torch

from pagedllm.util.memory import libc

logger = logging.getLogger(__name__)

# mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap (activations of the largest step); larger
# ones (the KV cache, weights) still get their own mapping.
MMAP_THRESHOLD = 64 << 20
# Freed heap memory kept for the next step before any is returned to the kernel.
TRIM_THRESHOLD = 512 << 20
# A transparent huge page (x86-64 Linux).
HUGE_PAGE = 2 << 20


def keep_step_buffers() -> bool:
    """Tune glibc's malloc as described above; False (and nothing changed) where the C
    library is not glibc. Process-wide and idempotent."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    ok = mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD)) == 1
    ok = mallopt(ctypes.c_int(M_TRIM_THRESHOLD), ctypes.c_int(TRIM_THRESHOLD)) == 1 and ok
    if not ok:
        logger.info("mallopt refused the step-buffer settings; keeping malloc's defaults")
    return ok


# madvise advice numbers (Linux, asm-generic/mman-common.h); mmap lacks some of them.
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_POPULATE_WRITE = 23  # Linux 5.14+
MAP_NORESERVE = 0x4000  # Linux: address space only, no commit charge
PAGE = mmap.PAGESIZE


class BlockArena:
    """Per-block tensors (K and V of every layer, scales of a quantized cache, ...) whose
    number of blocks changes at run time, in one anonymous mapping on huge pages.

    Huge pages: a decode step reads every context through its block table, one random
    block after another; with 4 KiB pages nearly every block costs a TLB miss, while one
    2 MiB entry covers many blocks. The first ``num_blocks`` are committed (zeroed) at
    start-up, as a fixed cache is, so page faults do not land in the first steps.

    Each tensor gets its own region, sized for ``capacity`` blocks of address space
    (``MAP_NORESERVE``: nothing is committed by the reservation) and starting on a 2 MiB
    boundary; ``tensors`` are views of the first ``num_blocks`` blocks of each region.
    Shrinking gives the pages past the new end back to the kernel at once
    (``madvise(MADV_DONTNEED)``: resident memory drops; they read as zeros later);
    growing only lengthens the views, so it takes no copy and no restart, and a
    background thread faults the new pages in (``MADV_POPULATE_WRITE``, which leaves
    their contents alone) so the steps do not pay for it.
    """

    def __init__(
        self,
        layouts: Sequence[tuple[tuple[int, ...], torch.dtype]],
        num_blocks: int,
        capacity: int,
    ) -> None:
        if not 0 < num_blocks <= capacity:
            raise ValueError(f"need 0 < num_blocks <= capacity, got {num_blocks}, {capacity}")
        self.capacity = capacity
        self.block_bytes = [_numel(shape) * _itemsize(dtype) for shape, dtype in layouts]
        sizes = [-(-capacity * b // HUGE_PAGE) * HUGE_PAGE for b in self.block_bytes]
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        if sys.platform.startswith("linux"):
            flags |= MAP_NORESERVE
        self._map = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=flags)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE_PAGE
        _madvise(raw.data_ptr(), len(self._map), MADV_HUGEPAGE)
        self._regions = []
        for (shape, dtype), size in zip(layouts, sizes, strict=True):
            region = raw[start : start + size].view(dtype)
            self._regions.append(region[: capacity * _numel(shape)].view(capacity, *shape))
            start += size
        self._populating: threading.Thread | None = None
        self.num_blocks = 0
        self.tensors: list[torch.Tensor] = []
        self.resize(num_blocks, populate=False)
        for tensor in self.tensors:  # committed now (zeros), as a fixed cache is
            tensor.zero_()

    @property
    def nbytes_per_block(self) -> int:
        return sum(self.block_bytes)

    def resize(self, num_blocks: int, *, populate: bool = True) -> None:
        """Views of ``num_blocks`` blocks; blocks past a smaller size are given back to the
        kernel (their data is lost), blocks past a larger one are zeros or stale data of
        blocks dropped earlier, faulted in by a background thread (``populate``)."""
        if not 0 < num_blocks <= self.capacity:
            raise ValueError(f"num_blocks must be in [1, {self.capacity}], got {num_blocks}")
        old = self.num_blocks
        self.wait_populated()
        for region, block_bytes in zip(self._regions, self.block_bytes, strict=True):
            if num_blocks < old:
                low = -(-num_blocks * block_bytes // PAGE) * PAGE  # keep the shared page
                high = -(-old * block_bytes // PAGE) * PAGE
                if high > low:
                    _madvise(region.data_ptr() + low, high - low, MADV_DONTNEED)
        if num_blocks > old:
            self._small_pages_at_end(num_blocks)
        self.tensors = [region[:num_blocks] for region in self._regions]
        self.num_blocks = num_blocks
        if populate and num_blocks > old:
            ranges = [
                (region.data_ptr() + old * b, (num_blocks - old) * b)
                for region, b in zip(self._regions, self.block_bytes, strict=True)
            ]
            self._populating = threading.Thread(
                target=_populate, args=(ranges,), name="kv-populate", daemon=True
            )
            self._populating.start()

    def _small_pages_at_end(self, num_blocks: int) -> None:
        """4 KiB pages for the 2 MiB span holding each region's end: a huge page there
        would commit the whole span, most of it past the last block (a 64 MiB cache of
        60 tensors held 120 MiB)."""
        for region, block_bytes in zip(self._regions, self.block_bytes, strict=True):
            end = region.data_ptr() + num_blocks * block_bytes  # regions start on huge pages
            if end % HUGE_PAGE:
                _madvise(end - end % HUGE_PAGE, HUGE_PAGE, MADV_NOHUGEPAGE)

    def wait_populated(self) -> None:
        """Wait for the background fault-in of the last growth (tests, benchmarks)."""
        if self._populating is not None:
            self._populating.join()
            self._populating = None


def total_memory_bytes() -> int:
    """Physical memory of the machine."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _populate(ranges: Sequence[tuple[int, int]]) -> None:
    for address, length in ranges:
        start = address - address % PAGE
        _madvise(start, address + length - start, MADV_POPULATE_WRITE)


def _madvise(address: int, length: int, advice: int) -> bool:
    """``madvise`` through ctypes (which lets other threads run meanwhile); False where
    it is unavailable or refused (then the memory simply stays as it is)."""
    library = libc()
    if library is None or length <= 0:
        return False
    start = address - address % PAGE
    return (
        library.madvise(
            ctypes.c_void_p(start), ctypes.c_size_t(address + length - start), ctypes.c_int(advice)
        )
        == 0
    )


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
