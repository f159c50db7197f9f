"""The C++ ``quant_write`` gives ``write_step``'s bits (its reference): the windows, the sealed
blocks with their scales and minimums, and the staging slots, over random steps."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.quant import write_step
from pagedllm.core.outputs import ScheduledSequence
from pagedllm.kernels.build import load_library
from pagedllm.kv_dtypes import QUANTIZED_KV_DTYPES
from pagedllm.worker.input_batch import build_input_batch
from pagedllm.worker.kv_cache import KVCacheSpec
from pagedllm.worker.kv_quant import QuantizedKVCache

KV_HEADS = 2
NUM_BLOCKS = 96


@pytest.fixture(autouse=True)
def _library() -> None:
    if not load_library():
        pytest.skip("the C++ kernels could not be built")


def quant_write(key, value, k_cache, v_cache, step):
    return torch.ops.pagedllm.quant_write(
        key, value, *k_cache.write_args(), *v_cache.write_args(), *step.write_args()
    )


def rows(n: int, dim: int, dtype: torch.dtype, rng: torch.Generator) -> torch.Tensor:
    """[n, KV_HEADS, dim] values of many sizes: some heads zero, some beyond fp16, some
    tiny (their scales subnormal or zero), cut from a wider tensor as a qkv split is."""
    wide = torch.randn(n, 3 * KV_HEADS, dim, generator=rng)
    wide[:, : 2 * KV_HEADS] *= 10.0 ** torch.randint(-9, 6, (n, 2 * KV_HEADS, 1), generator=rng)
    wide[:, KV_HEADS][torch.rand(n, generator=rng) < 0.1] = 0.0
    return wide.to(dtype)[:, KV_HEADS : 2 * KV_HEADS]


def random_steps(block: int, seed: int, num_steps: int):
    """Steps of random sequences: prompt chunks starting anywhere in a block (sealing none,
    one or several blocks), decode steps, sequences joining and finishing."""
    py = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    py.shuffle(free)
    live: dict[str, tuple[int, list[int]]] = {}
    for n in range(num_steps):
        if not live or (len(live) < 4 and py.random() < 0.6):
            live[f"s{n}"] = (0, [])
        scheduled = []
        for name, (done, table) in list(live.items()):
            if py.random() < 0.2 and scheduled:
                continue
            count = 1 if py.random() < 0.5 else py.randint(1, 3 * block + 2)
            while len(table) * block < done + count:
                table.append(free.pop())
            scheduled.append(ScheduledSequence(name, tuple(range(count)), done, tuple(table)))
            live[name] = (done + count, table)
        yield scheduled
        for name, (done, table) in list(live.items()):
            if done > 6 * block and py.random() < 0.3:
                free.extend(table)
                del live[name]


def pool_tensors(cache: QuantizedKVCache) -> list[torch.Tensor]:
    return [
        t for k, v in cache.device_caches for side in (k, v) for t in (*side.parts(), side.stage)
    ]


@pytest.mark.parametrize("quantization", QUANTIZED_KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 5])
@pytest.mark.parametrize("first_block", [False, True])
def test_quant_write_gives_write_step_s_bits(
    quantization: str, dtype: torch.dtype, block: int, first_block: bool
) -> None:
    dim = 64 if block == 16 else 40  # int4 V: groups of 32, or the whole head
    spec = KVCacheSpec(
        1, KV_HEADS, dim, block, dtype, quantization=quantization,
        unquantized_first_block=first_block,
    )  # fmt: skip
    caches = [QuantizedKVCache(spec, num_blocks=NUM_BLOCKS) for _ in range(2)]
    rng = torch.Generator().manual_seed(block + first_block)
    seals = loads = 0
    for scheduled in random_steps(block, seed=block * 2 + first_block, num_steps=24):
        num_tokens = sum(len(s.token_ids) for s in scheduled)
        key, value = rows(num_tokens, dim, dtype, rng), rows(num_tokens, dim, dtype, rng)
        windows = []
        for cache, write in zip(caches, (write_step, quant_write), strict=True):
            meta = build_input_batch(scheduled, block).meta
            step = cache.plan_step(meta)
            k_cache, v_cache = cache.device_caches[0]
            windows.append(write(key, value, k_cache, v_cache, step))
            cache.finish_step()
        seals += step.seal_window.numel()
        loads += step.load_window.numel()
        for mine, theirs in zip(windows[1], windows[0], strict=True):
            assert mine.dtype == theirs.dtype
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
        for mine, theirs in zip(pool_tensors(caches[1]), pool_tensors(caches[0]), strict=True):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    # The steps sealed blocks, and started in blocks already begun (their rows staged).
    assert seals > 10 and loads > 10


def test_quant_write_checks_every_index_before_writing() -> None:
    spec = KVCacheSpec(1, KV_HEADS, 8, 4, torch.float32, quantization="int8")
    cache = QuantizedKVCache(spec, num_blocks=8)
    meta = build_input_batch([ScheduledSequence("a", (1,) * 6, 0, (3, 4))], 4).meta
    step = cache.plan_step(meta)
    k_cache, v_cache = cache.device_caches[0]
    before = [t.clone() for t in pool_tensors(cache)]
    bad = step.seal_blocks.clone()
    bad[0] = NUM_BLOCKS
    args = list(step.write_args())
    args[5] = bad
    x = torch.randn(6, KV_HEADS, 8)
    with pytest.raises(RuntimeError, match="seal_blocks .* out of range"):
        torch.ops.pagedllm.quant_write(x, x, *k_cache.write_args(), *v_cache.write_args(), *args)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_tensors(cache), strict=True))
