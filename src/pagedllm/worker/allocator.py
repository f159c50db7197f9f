"""Keep step-sized buffers in the heap instead of fresh pages from the kernel.

glibc serves allocations above its mmap threshold (128 KiB, rising to at most 32 MiB as
large blocks are freed) with fresh ``mmap`` pages, and gives freed heap tops back to the
kernel. A model step allocates the same activation buffers every time (a 2048-token prefill
step: 2-13 MB each), so each step pays page faults and zeroing on every one of them:
measured here, a [2048, 512] x [512, 3072] bf16 matmul ran at 0.50 TFLOP/s with the default
settings and 0.71 with the settings below, and the LM head on [2048, 512] twice as fast.
This is what vLLM's CPU backend gets from preloading tcmalloc; ``mallopt`` does it in-process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap (activations of the largest step); larger
# ones (the KV cache, weights) still get their own mapping.
MMAP_THRESHOLD = 64 << 20
# Freed heap memory kept for the next step before any is returned to the kernel.
TRIM_THRESHOLD = 512 << 20


def keep_step_buffers() -> bool:
    """Tune glibc's malloc as described above; False (and nothing changed) where the C
    library is not glibc. Process-wide and idempotent."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.info("mallopt refused the step-buffer settings; keeping malloc's defaults")
    return ok
