"""keep_step_buffers: large step buffers come from the heap, not fresh kernel mappings."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import ctypes, ctypes.util, sys

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.mallinfo2.restype = MallInfo2

    def mapped_by(size):
        before = libc.mallinfo2().hblkhd
        ptr = libc.malloc(size)
        grew = libc.mallinfo2().hblkhd - before
        libc.free(ptr)
        return grew

    size = 12 << 20  # a [2048, 3072] bf16 activation
    if sys.argv[1] == "tuned":
        from pagedllm.worker.allocator import keep_step_buffers
        assert keep_step_buffers()
    print(mapped_by(size) >= size)
    """
)


def _mapped(mode: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return out.stdout.strip() == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_step_sized_buffers_stay_in_the_heap():
    assert _mapped("default")  # glibc maps a fresh 12 MB block by default...
    assert not _mapped("tuned")  # ...and serves it from the heap once tuned
