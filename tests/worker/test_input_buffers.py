"""InputBuffers (the runner's block tables kept from step to step) against the plain
builder, over batches that grow, shrink, reorder and change their tables."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.worker.input_batch import (
    InputBatch,
    InputBuffers,
    build_input_batch,
    build_input_batch_reference,
)


def assert_same_batch(got: InputBatch, expected: InputBatch) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(got, name), getattr(expected, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        a, b = getattr(got.meta, name), getattr(expected.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("query_lens_list", "seq_lens_list", "max_query_len", "max_seq_len"):
        assert getattr(got.meta, name) == getattr(expected.meta, name), name


class Sequences:
    """Live sequences as a scheduler would hand them on: a table keeps its tuple object
    until it changes (as ``KVCacheManager.block_table_tuple`` does)."""

    def __init__(self, rng: random.Random, block_size: int) -> None:
        self.rng = rng
        self.block_size = block_size
        self.next_id = 0
        self.next_block = 0
        self.live: dict[str, tuple[int, tuple[int, ...]]] = {}  # id -> (computed, table)

    def step(self) -> list[ScheduledSequence]:
        rng = self.rng
        for rid in list(self.live):
            if rng.random() < 0.15:
                del self.live[rid]
        for _ in range(rng.choice([0, 0, 1, 3])):
            self.live[f"r{self.next_id}"] = (0, ())
            self.next_id += 1
        if not self.live:
            self.live[f"r{self.next_id}"] = (0, ())
            self.next_id += 1
        order = list(self.live)
        if rng.random() < 0.2:
            rng.shuffle(order)  # rows move
        return [self._schedule(rid) for rid in order]

    def _schedule(self, rid: str) -> ScheduledSequence:
        rng = self.rng
        computed, table = self.live[rid]
        num_new = rng.randint(1, 40) if computed == 0 else 1
        drafts = rng.choice([0, 0, 0, 2, 5]) if computed else 0  # speculative decoding
        num_new += drafts
        needed = -(-(computed + num_new) // self.block_size)
        if needed > len(table):
            table = (*table, *self._blocks(needed - len(table)))
        elif rng.random() < 0.1:  # copy-on-write: same length, a new last block
            table = (*table[:-1], *self._blocks(1))
        elif rng.random() < 0.1:  # same content, a new tuple
            table = tuple(list(table))
        self.live[rid] = (computed + num_new, table)
        tokens = tuple(rng.randint(0, 999) for _ in range(num_new))
        samples = 1 if drafts else rng.choice([0, 1, 1, 2])
        return ScheduledSequence(rid, tokens, computed, table, samples, num_draft_tokens=drafts)

    def _blocks(self, n: int) -> tuple[int, ...]:
        self.next_block += n
        return tuple(range(self.next_block - n, self.next_block))


@pytest.mark.parametrize("seed", range(12))
def test_buffers_reused_across_steps_equal_a_fresh_build(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    sequences = Sequences(rng, block_size)
    buffers = InputBuffers()
    for _ in range(40):
        batch = sequences.step()
        got = buffers.build(batch, block_size, num_blocks=sequences.next_block)
        assert_same_batch(got, build_input_batch_reference(batch, block_size))
        assert_same_batch(got, build_input_batch(batch, block_size))


def test_a_row_taken_by_a_shorter_table_is_padded_with_zeros() -> None:
    buffers = InputBuffers()
    long = ScheduledSequence("a", (1,), 10, tuple(range(1, 9)))
    short = ScheduledSequence("b", (2,), 0, (9,))
    buffers.build([long, short], block_size=2)
    batch = [short, ScheduledSequence("c", (3,), 0, (10, 11))]
    assert_same_batch(buffers.build(batch, 2), build_input_batch_reference(batch, 2))


def test_buffers_refuse_what_the_plain_builder_refuses() -> None:
    buffers = InputBuffers()
    with pytest.raises(ValueError):
        buffers.build([], block_size=4)
    with pytest.raises(ValueError, match="cannot hold"):
        buffers.build([ScheduledSequence("a", (1, 2, 3), 2, (0,))], block_size=4)
    with pytest.raises(ValueError, match="num_blocks"):
        buffers.build([ScheduledSequence("a", (1,), 0, (7,))], block_size=4, num_blocks=4)
    batch = [ScheduledSequence("a", (1,), 0, (3,))]  # still right after refusals
    assert_same_batch(buffers.build(batch, 4, num_blocks=4), build_input_batch_reference(batch, 4))


def test_a_batch_ramping_up_one_sequence_at_a_time_keeps_the_buffer_small() -> None:
    # A server's batch grows a request at a time; each new row must not double the columns
    # (it once did: 2^n columns by n rows, gigabytes by a few dozen requests).
    buffers = InputBuffers()
    batch = []
    for i in range(300):
        batch.append(
            ScheduledSequence(f"r{i}", (1,), 16 * 3, (4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4))
        )
        got = buffers.build(batch, block_size=16)
        assert got.meta.block_tables.shape == (i + 1, 4)
    rows, columns = buffers._tables.shape
    assert 300 <= rows < 600 and columns <= 8
