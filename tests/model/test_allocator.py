"""The CPU engine's memory: large step buffers come from the heap, not fresh kernel mappings;
the KV cache sits on transparent huge pages where the kernel offers them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pagedllm.engine.elastic import process_resident_bytes
from pagedllm.worker.allocator import HUGE_PAGE, BlockArena
from pagedllm.worker.kv_cache import KVCacheSpec, allocate_caches

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


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as handle:
            text = handle.read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _huge_kib_of_range(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [start, end)."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as handle:
        for line in handle:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                low, high = (int(x, 16) for x in first.split("-"))
                overlaps = low < end and start < high
            elif overlaps and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


def test_arena_tensors_are_zeroed_aligned_and_contiguous():
    small = BlockArena([((16, 2, 64), torch.bfloat16)], 64, 64).tensors[0]  # 256 KiB
    assert small.shape == (64, 16, 2, 64) and small.dtype == torch.bfloat16 and not small.any()
    arena = BlockArena([((1 << 20,), torch.float32), ((4,), torch.int8)], 3, 8)
    big, scales = arena.tensors
    assert big.shape == (3, 1 << 20) and scales.shape == (3, 4)
    assert big.is_contiguous() and not big.any() and not scales.any()
    if sys.platform.startswith("linux"):
        assert big.data_ptr() % HUGE_PAGE == 0 and scales.data_ptr() % HUGE_PAGE == 0
    big.fill_(1.0)
    assert big.sum().item() == 3 * (1 << 20)


def test_arena_resize_keeps_the_head_and_views_grow_in_place():
    arena = BlockArena([((1024,), torch.float32)] * 2, 6, 16)
    for i, tensor in enumerate(arena.tensors):
        tensor.copy_(torch.arange(6).unsqueeze(1).float() + 10 * i)
    first = arena.tensors[0].data_ptr()
    arena.resize(2)
    assert arena.tensors[0].shape[0] == 2
    arena.resize(12)
    arena.wait_populated()
    assert arena.tensors[0].data_ptr() == first  # no copy, no new mapping
    for i, tensor in enumerate(arena.tensors):
        assert tensor[:2, 0].tolist() == [10 * i, 10 * i + 1]
        assert not tensor[2:].any()  # given back, read back as zeros
    with pytest.raises(ValueError):
        arena.resize(17)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_arena_shrink_returns_resident_memory_at_once():
    mib = 1 << 20
    arena = BlockArena([((mib,), torch.uint8)] * 4, 64, 96)  # 256 MiB committed
    before = process_resident_bytes()
    arena.resize(8)  # gives back 4 x 56 MiB
    after = process_resident_bytes()
    released = 4 * 56 * mib
    assert before - after >= 0.95 * released
    arena.resize(64)
    arena.wait_populated()  # faulted in again by the background thread
    assert process_resident_bytes() - after >= 0.95 * released


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_kv_cache_is_backed_by_huge_pages():
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    caches = allocate_caches(spec, 2048, torch.device("cpu"))  # 4 regions of 8 MiB each
    start = caches[0][0].data_ptr()
    end = caches[-1][1].data_ptr() + caches[-1][1].numel() * 2
    assert end - start == 4 * 2048 * spec.bytes_per_block // (2 * spec.num_layers)
    assert _huge_kib_of_range(start, end) > 0  # faulted in at allocation
    assert all(k.is_contiguous() and v.is_contiguous() and not k.any() for k, v in caches)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_arena_commits_its_blocks_not_whole_huge_pages_past_them():
    mib = 1 << 20
    before = process_resident_bytes()
    arena = BlockArena([((mib // 4,), torch.uint8)] * 8, 5, 64)  # 8 regions, 1.25 MiB each
    committed = process_resident_bytes() - before
    assert committed < 8 * 1.25 * mib + mib  # a huge page at each end would make 16 MiB
    arena.resize(13)  # 3.25 MiB each: one huge page, then small pages to the end
    arena.wait_populated()
    assert process_resident_bytes() - before < 8 * 3.25 * mib + mib
