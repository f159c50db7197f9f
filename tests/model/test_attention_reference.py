"""The reference paged attention equals plain causal SDPA on contiguous tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention import ReferenceAttention
from pagedllm.attention.base import write_kv
from pagedllm.core.outputs import ScheduledSequence
from pagedllm.worker.input_batch import build_input_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def contiguous_attention(q, k, v, query_len: int) -> torch.Tensor:
    """q [query_len, H, D]; k, v [seq_len, KV, D]: the last query_len positions, causal."""
    seq_len = k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).transpose(0, 1)
    v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * HEAD_DIM**-0.5
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return (F.softmax(scores, dim=-1) @ v).transpose(0, 1)


def run_case(block_size: int, cached: list[int], new: list[int], seed: int = 0) -> None:
    """Sequences with `cached[i]` tokens already in the cache compute `new[i]` more."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, new, strict=True)) + 3
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (
        torch.randn(shape, generator=generator),
        torch.randn(shape, generator=generator),
    )
    free = torch.randperm(num_blocks, generator=generator).tolist()
    scheduled, full_k, full_v = [], [], []
    for i, (num_cached, num_new) in enumerate(zip(cached, new, strict=True)):
        seq_len = num_cached + num_new
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        prefix = (
            ScheduledSequence(f"s{i}", (0,) * num_cached, 0, tuple(table)) if num_cached else None
        )
        if prefix is not None:  # put the cached prefix into its slots first
            meta = build_input_batch([prefix], block_size).meta
            write_kv(k[:num_cached], v[:num_cached], k_cache, v_cache, meta.slot_mapping)
        scheduled.append(ScheduledSequence(f"s{i}", (0,) * num_new, num_cached, tuple(table)))
        full_k.append(k)
        full_v.append(v)
    meta = build_input_batch(scheduled, block_size).meta
    q = torch.randn(sum(new), NUM_HEADS, HEAD_DIM, generator=generator)
    step_k = torch.cat([k[c:] for k, c in zip(full_k, cached, strict=True)])
    step_v = torch.cat([v[c:] for v, c in zip(full_v, cached, strict=True)])
    out = ReferenceAttention().forward(q, step_k, step_v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    start = 0
    for num_new, k, v in zip(new, full_k, full_v, strict=True):
        expected = contiguous_attention(q[start : start + num_new], k, v, num_new)
        torch.testing.assert_close(out[start : start + num_new], expected, rtol=1e-5, atol=1e-5)
        start += num_new


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_prefill_batch_matches_contiguous(block_size: int) -> None:
    run_case(block_size, cached=[0, 0, 0], new=[5, 1, 19])


@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_query_after_cached_prefix(block_size: int) -> None:
    run_case(block_size, cached=[8, 13, 3], new=[5, 1, 9])


def test_decode_batch(block_size: int = 4) -> None:
    run_case(block_size, cached=[1, 7, 30], new=[1, 1, 1])


def test_write_kv_puts_rows_in_their_slots() -> None:
    k_cache = torch.zeros(4, 2, 1, 1)
    v_cache = torch.zeros(4, 2, 1, 1)
    key = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    write_kv(key, -key, k_cache, v_cache, torch.tensor([5, 0, 6]))
    assert k_cache.flatten().tolist() == [2.0, 0, 0, 0, 0, 1.0, 3.0, 0]
    assert v_cache.flatten().tolist() == [-2.0, 0, 0, 0, 0, -1.0, -3.0, 0]


def test_padding_blocks_are_never_read() -> None:
    """Block 0 pads short tables; poisoning it must not change a short sequence's output."""
    block_size = 2
    generator = torch.Generator().manual_seed(3)
    shape = (6, block_size, NUM_KV_HEADS, HEAD_DIM)
    scheduled = [
        ScheduledSequence("short", (1, 2, 3), 0, (5, 4)),
        ScheduledSequence("long", (1, 2, 3, 4, 5, 6, 7), 0, (1, 2, 3, 0)),
    ]
    meta = build_input_batch(scheduled, block_size).meta
    q = torch.randn(10, NUM_HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(10, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(10, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    outs = []
    for fill in (0.0, 1e4):
        k_cache, v_cache = torch.full(shape, fill), torch.full(shape, fill)
        outs.append(ReferenceAttention().forward(q, k, v, k_cache, v_cache, meta, 0.3)[:3])
    torch.testing.assert_close(outs[0], outs[1])
