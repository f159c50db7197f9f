"""This process's memory: its resident set read from /proc, freed heap pages handed back to
the system, weights placed on transparent huge pages. Pure Python (ctypes for glibc's
``malloc_trim``; torch imported only by ``on_huge_pages``)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Resident:
    """The resident set in bytes: ``anonymous`` (heap, tensors, the KV cache) and
    ``file`` (pages of mapped files: shared libraries' code, mapped weights)."""

    total: int
    anonymous: int

    @property
    def file(self) -> int:
        return self.total - self.anonymous


def resident_memory(pid: int | None = None) -> Resident | None:
    """The resident set of this process (or of ``pid``: ``/proc/PID/smaps_rollup``), or
    None where there is no such file."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{'self' if pid is None else pid}/smaps_rollup") as handle:
            for line in handle:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        return None
    if "Rss" not in fields:
        return None
    return Resident(fields["Rss"], fields.get("Anonymous", 0))


def resident_bytes() -> int | None:
    """The process's resident set in bytes (``VmRSS``), or None off Linux."""
    resident = resident_memory()
    return None if resident is None else resident.total


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, loaded once (``find_library`` alone takes milliseconds), or None off
    Linux or where it does not load."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's ``malloc_trim``): loading
    frees hundreds of MiB of transient objects (a GGUF's blocks being repacked, a
    tokenizer's parsed JSON), and an engine that goes idle leaves its steps' buffers
    (worker/allocator.py keeps them between steps), that glibc would otherwise keep, counted
    in the resident set. A no-op where the C library has no such call."""
    with contextlib.suppress(AttributeError):
        library = libc()
        if library is not None:
            library.malloc_trim(0)


HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels


def on_huge_pages(tensor: Any) -> Any:
    """A CPU tensor of a megabyte or more copied into fresh memory advised onto
    transparent huge pages before any page is touched (the tensor itself where that
    cannot be had). Weights a decode step streams through whole: on 4 KiB pages their
    TLB misses cost a Gemma-3-270M step ~25% (54 against 74 tok/s, docs/performance.md)."""
    import torch

    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < HUGE_PAGE // 2 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return tensor
    # Private: a shared anonymous mapping is shmem, which the THP setting does not cover.
    # Exactly the tensor's bytes (its storage is what the held-weights count reads): the
    # 2 MiB-aligned stretches inside get huge pages, the ends at most 2 MiB each do not.
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        area.close()
        return tensor
    raw = torch.frombuffer(area, dtype=torch.uint8)  # keeps the mapping alive
    out = raw.view(tensor.dtype).view(tensor.shape)
    return out.copy_(tensor)
