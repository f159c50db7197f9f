"""Input batch flattening and the KV tensors (sizes, copies, swaps), by hand-checked ids."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.worker.input_batch import build_input_batch, build_input_batch_reference
from pagedllm.worker.kv_cache import (
    KVCache,
    KVCacheSpec,
    available_memory_bytes,
    num_blocks_from_budget,
)


def test_input_batch_exact_ids() -> None:
    scheduled = [
        ScheduledSequence("a", (10, 11, 12), 0, (7, 2), num_samples=1),
        ScheduledSequence("b", (20, 21), 5, (3, 9, 4), num_samples=0),  # chunk 5..6
        ScheduledSequence("c", (30,), 8, (1, 6, 5), num_samples=2),  # decode at 8
    ]
    batch = build_input_batch(scheduled, block_size=4)
    assert batch.input_ids.tolist() == [10, 11, 12, 20, 21, 30]
    assert batch.positions.tolist() == [0, 1, 2, 5, 6, 8]
    # slot = table[p // 4] * 4 + p % 4
    assert batch.meta.slot_mapping.tolist() == [28, 29, 30, 37, 38, 20]
    assert batch.meta.query_start_loc.tolist() == [0, 3, 5, 6]
    assert batch.meta.seq_lens.tolist() == [3, 7, 9]
    assert batch.meta.block_tables.tolist() == [[7, 2, 0], [3, 9, 4], [1, 6, 5]]
    assert batch.meta.query_lens_list == [3, 2, 1]
    assert batch.meta.seq_lens_list == [3, 7, 9]
    assert (batch.meta.max_query_len, batch.meta.max_seq_len) == (3, 9)
    assert batch.logits_indices.tolist() == [2, 5]
    assert batch.meta.slot_mapping.dtype == torch.int64
    assert batch.meta.block_tables.dtype == torch.int32


def test_input_batch_scores_every_draft_position() -> None:
    scheduled = [
        ScheduledSequence("a", (10, 11, 12), 0, (7, 2), num_samples=1),
        ScheduledSequence("s", (30, 31, 32), 8, (1, 6, 5), num_draft_tokens=2),  # 30 + 2 drafts
        ScheduledSequence("b", (20, 21), 5, (3, 9, 4), num_samples=0),
    ]
    batch = build_input_batch(scheduled, block_size=4)
    assert batch.positions.tolist() == [0, 1, 2, 8, 9, 10, 5, 6]
    assert batch.logits_indices.tolist() == [2, 3, 4, 5]
    assert build_input_batch_reference(scheduled, 4).logits_indices.tolist() == [2, 3, 4, 5]


def test_input_batch_refuses_short_block_table() -> None:
    with pytest.raises(ValueError, match="block table"):
        build_input_batch([ScheduledSequence("a", (1, 2, 3), 2, (0,))], block_size=4)


def test_input_batch_refuses_block_outside_cache() -> None:
    scheduled = [ScheduledSequence("a", (1, 2), 0, (3,))]
    assert build_input_batch(scheduled, block_size=4, num_blocks=4).num_tokens == 2
    with pytest.raises(ValueError, match="block id 3 >= num_blocks 3"):
        build_input_batch(scheduled, block_size=4, num_blocks=3)


def test_input_batch_refuses_empty() -> None:
    with pytest.raises(ValueError):
        build_input_batch([], block_size=4)
    with pytest.raises(ValueError, match="no tokens"):
        build_input_batch([ScheduledSequence("a", (), 0, (0,))], block_size=4)


def test_spec_sizes() -> None:
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert spec.bytes_per_block == spec.bytes_per_token * 16
    half = KVCacheSpec(30, 3, 64, 16, torch.bfloat16)
    assert half.bytes_per_token == spec.bytes_per_token // 2
    assert spec.num_blocks_for_bytes(spec.bytes_per_block * 10 + 5) == 10


def test_budget_sizing() -> None:
    spec = KVCacheSpec(2, 2, 8, 4)
    assert num_blocks_from_budget(spec, kv_cache_memory=spec.bytes_per_block * 7) == 7
    free = available_memory_bytes()
    assert free > 0
    by_fraction = num_blocks_from_budget(spec, memory_fraction=0.001)
    assert abs(by_fraction - free * 0.001 // spec.bytes_per_block) <= 0.1 * by_fraction + 2
    with pytest.raises(ValueError, match="memory_fraction"):
        num_blocks_from_budget(spec, memory_fraction=1.5)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        num_blocks_from_budget(spec, kv_cache_memory=0)


def filled_cache(num_blocks: int = 6, num_host_blocks: int = 3) -> KVCache:
    cache = KVCache(KVCacheSpec(2, 1, 2, 2), num_blocks, num_host_blocks)
    for layer, (k, v) in enumerate(cache.device_caches):
        for block in range(num_blocks):
            k[block] = 100 * layer + block
            v[block] = -(100 * layer + block)
    return cache


def test_kv_shapes_allocated_once() -> None:
    cache = KVCache(KVCacheSpec(3, 2, 8, 16, torch.bfloat16), num_blocks=5, num_host_blocks=2)
    assert len(cache.device_caches) == 3
    for k, v in cache.device_caches:
        assert k.shape == v.shape == (5, 16, 2, 8)
        assert k.dtype == torch.bfloat16
    assert cache.host_caches[0][0].shape == (2, 16, 2, 8)


def test_copy_blocks_copies_every_layer_k_and_v() -> None:
    cache = filled_cache()
    cache.copy_blocks([(1, 4), (2, 5)])
    for layer, (k, v) in enumerate(cache.device_caches):
        assert k[:, 0, 0, 0].tolist() == [100 * layer + b for b in (0, 1, 2, 3, 1, 2)]
        assert torch.equal(v, -k)


def test_copy_blocks_reads_before_writing() -> None:
    cache = filled_cache()
    cache.copy_blocks([(1, 2), (2, 3)])  # block 3 gets the old block 2, not the new one
    assert cache.device_caches[0][0][:, 0, 0, 0].tolist() == [0, 1, 1, 2, 4, 5]


def test_swap_round_trip() -> None:
    cache = filled_cache()
    cache.swap_out([(4, 0), (1, 2)])
    for layer, (k, v) in enumerate(cache.host_caches):
        assert k[[0, 2], 0, 0, 0].tolist() == [100 * layer + 4, 100 * layer + 1]
        assert torch.equal(v[[0, 2]], -k[[0, 2]])
    for k, v in cache.device_caches:
        k.zero_()
        v.zero_()
    cache.swap_in([(2, 5), (0, 3)])
    for layer, (k, v) in enumerate(cache.device_caches):
        assert k[:, 0, 0, 0].tolist() == [0, 0, 0, 100 * layer + 4, 0, 100 * layer + 1]
        assert torch.equal(v, -k)


def test_swap_without_host_tier_is_refused() -> None:
    cache = filled_cache(num_host_blocks=0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        cache.swap_out([(0, 0)])


@pytest.mark.parametrize("max_num_blocks", [None, 8])
def test_resize_keeps_the_kept_blocks_of_every_tensor(max_num_blocks) -> None:
    cache = KVCache(KVCacheSpec(2, 1, 2, 2), 6, 0, max_num_blocks=max_num_blocks)
    for layer, (k, v) in enumerate(cache.device_caches):
        for block in range(6):
            k[block] = 100 * layer + block
            v[block] = -(100 * layer + block)
    cache.resize(3)
    assert all(t.shape[0] == 3 for t in cache.device_tensors)
    cache.resize(12)  # past the arena's capacity when it is 8: a new arena, blocks copied
    assert cache.num_blocks == 12 and len(cache.device_caches) == 2
    for layer, (k, v) in enumerate(cache.device_caches):
        assert k.shape[0] == 12
        assert k[:3, 0, 0, 0].tolist() == [100 * layer + b for b in range(3)]
        assert torch.equal(v[:3], -k[:3])
        k[11] = 7  # the new blocks are usable
    cache.copy_blocks([(11, 0)])
    assert cache.device_caches[1][0][0, 0, 0, 0].item() == 7
