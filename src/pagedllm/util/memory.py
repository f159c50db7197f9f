"""This process's memory: its resident set read from /proc, and freed heap pages handed
back to the system. Pure Python (ctypes for glibc's ``malloc_trim``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Resident:
    """The resident set in bytes: ``anonymous`` (heap, tensors, the KV cache) and
    ``file`` (pages of mapped files: shared libraries' code, mapped weights)."""

    total: int
    anonymous: int

    @property
    def file(self) -> int:
        return self.total - self.anonymous


def resident_memory() -> Resident | None:
    """The process's resident set (``/proc/self/smaps_rollup``), or None where there is
    no such file."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/smaps_rollup") as handle:
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


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's ``malloc_trim``): loading
    frees hundreds of MiB of transient objects (a GGUF's blocks being repacked, a
    tokenizer's parsed JSON) that glibc would otherwise keep, counted in the resident set.
    A no-op where the C library has no such call."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
