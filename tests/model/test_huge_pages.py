"""Weights read back from the layout cache land on transparent huge pages
(``util.memory.on_huge_pages``): on 4 KiB pages a decode step's TLB misses cost
Gemma-3-270M ~25% of its speed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.util.memory import HUGE_PAGE, on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_on_advice() -> bool:
    """Whether this kernel gives transparent huge pages to memory advised to have them."""
    try:
        setting = THP.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_a_copy_is_bit_identical_and_its_storage_exactly_its_bytes(dtype):
    source = (
        torch.randn(3 << 18, 3).to(dtype)
        if dtype != torch.uint8
        else torch.randint(0, 255, (3 << 20,), dtype=dtype)
    )
    copy = on_huge_pages(source)
    assert copy.data_ptr() != source.data_ptr()
    assert copy.untyped_storage().nbytes() == source.numel() * source.element_size()
    assert copy.dtype == source.dtype and copy.shape == source.shape
    assert torch.equal(copy.view(torch.uint8), source.contiguous().view(torch.uint8))


def test_a_small_tensor_is_left_where_it_is():
    source = torch.ones(1000)
    assert on_huge_pages(source) is source


def test_the_copy_is_on_huge_pages_where_the_kernel_gives_them():
    if not thp_on_advice():
        pytest.skip(f"transparent huge pages are off here ({THP} says never or is missing)")
    copy = on_huge_pages(torch.ones(8 << 20, dtype=torch.uint8))
    assert huge_bytes_at(copy.data_ptr()) >= HUGE_PAGE
