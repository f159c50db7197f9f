"""Turn a step's scheduled sequences into the flat tensors the model and attention read.

For sequence i with ``n_i`` new tokens starting at position ``s_i``::

    input_ids       [ seq0 tokens | seq1 tokens | ... ]            (T = sum n_i)
    positions       [ s0 .. s0+n0-1 | s1 .. s1+n1-1 | ... ]
    slot_mapping    block_table_i[p // block_size] * block_size + p % block_size
    query_start_loc [0, n0, n0+n1, ...]
    seq_lens        [s0+n0, s1+n1, ...]         (context length after this step)
    block_tables    [num_seqs, max_blocks], padded with 0 (never read past seq_len)
    logits_indices  row of the last token of each sequence with num_samples > 0; with
                    drafts (speculative decoding), the rows of its last 1 + num_draft_tokens

A model whose layers are grouped by attention kind (``core/kv_groups.py``) has a block
table per group: ``meta.groups`` holds groups 1.. (their ``block_tables`` and
``slot_mapping`` from ``ScheduledSequence.group_block_tables``, the rest shared) and
``meta.layer_groups`` each layer's group (``layer_groups`` given to the builders).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, chain

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.core.outputs import ScheduledSequence


@dataclass(frozen=True, slots=True)
class InputBatch:
    """Everything one forward pass needs, on the model's device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64, rows whose logits are sampled

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_input_batch(
    scheduled: Sequence[ScheduledSequence],
    block_size: int,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
    layer_groups: tuple[int, ...] = (),
) -> InputBatch:
    """Flatten ``scheduled`` (which must not be empty) into an ``InputBatch``.

    With ``num_blocks``, a block id outside the cache is refused here, on the host,
    rather than becoming an out-of-bounds write on the device.

    Vectorised: each field is built with a few numpy operations over the whole batch (no
    per-token Python work, no small torch ops); ``build_input_batch_reference`` is the plain
    construction it must equal. ``InputBuffers.build`` gives the same batch, reusing the
    block-table rows of the previous step.
    """
    return _build(scheduled, _padded_block_tables_np, block_size, device, num_blocks, layer_groups)


class InputBuffers:
    """A runner's block-table buffer, kept from step to step.

    Continuous batching keeps most sequences in the same row from one step to the next,
    and a decoding sequence's block table changes once every ``block_size`` tokens: row i
    is rewritten only when its table is not the very tuple written there last step
    (``KVCacheManager.block_table_tuple`` hands out the same tuple while a table is
    unchanged). The buffer grows when a batch needs more rows or columns, never shrinks.

    ``build`` returns what ``build_input_batch`` returns for the same arguments. On the
    CPU the batch's ``block_tables`` may share the buffer: it is valid until the next
    ``build``.
    """

    def __init__(self, layer_groups: tuple[int, ...] = ()) -> None:
        self.layer_groups = layer_groups
        self._tables = np.zeros((0, 0), dtype=np.int32)  # rows beyond a table's end are 0
        self._lengths = np.zeros(0, dtype=np.int64)  # each row's table length
        self._written: list[tuple[int, ...] | None] = []  # the table each row holds

    def build(
        self,
        scheduled: Sequence[ScheduledSequence],
        block_size: int,
        device: torch.device | str = "cpu",
        num_blocks: int | None = None,
    ) -> InputBatch:
        return _build(
            scheduled, self._block_tables, block_size, device, num_blocks, self.layer_groups
        )

    def _block_tables(
        self, scheduled: Sequence[ScheduledSequence]
    ) -> tuple[np.ndarray, np.ndarray]:
        """As ``_padded_block_tables_np``, rewriting only the rows whose table changed
        (an unchanged row's table is not even read: its length is kept too)."""
        num_seqs = len(scheduled)
        self._reserve(num_seqs, 0)
        written = self._written
        for row, seq in enumerate(scheduled):
            if written[row] is not seq.block_table:
                self._write_row(row, seq.block_table)
        lengths = self._lengths[:num_seqs]
        width = int(lengths.max())
        return np.ascontiguousarray(self._tables[:num_seqs, :width]), lengths

    def _write_row(self, row: int, table: tuple[int, ...]) -> None:
        length = len(table)
        self._reserve(row + 1, length)
        self._tables[row, :length] = table
        self._tables[row, length:] = 0
        self._lengths[row] = length
        self._written[row] = table

    def _reserve(self, num_rows: int, width: int) -> None:
        """Grow the buffer (keeping its rows) to at least ``num_rows`` x ``width``; each
        dimension that grows at least doubles, the other stays (doubling the columns on
        every new row made a batch that ramps up one sequence at a time allocate 2^n
        columns)."""
        rows, columns = self._tables.shape
        if num_rows <= rows and width <= columns:
            return
        new_rows = rows if num_rows <= rows else max(num_rows, 2 * rows)
        new_columns = columns if width <= columns else max(width, 2 * columns)
        grown = np.zeros((new_rows, new_columns), dtype=np.int32)
        grown[:rows, :columns] = self._tables
        self._tables = grown
        self._lengths = np.concatenate([self._lengths, np.zeros(new_rows - rows, np.int64)])
        self._written.extend([None] * (new_rows - rows))


def _build(
    scheduled: Sequence[ScheduledSequence],
    padded_tables: Callable[[Sequence[ScheduledSequence]], tuple[np.ndarray, np.ndarray]],
    block_size: int,
    device: torch.device | str,
    num_blocks: int | None,
    layer_groups: tuple[int, ...] = (),
) -> InputBatch:
    """``build_input_batch``, the padded block tables and their lengths taken from
    ``padded_tables`` (built afresh, or kept from step to step by ``InputBuffers``)."""
    if not scheduled:
        raise ValueError("build_input_batch needs at least one scheduled sequence")
    block_tables, table_lens = padded_tables(scheduled)
    num_seqs = len(scheduled)
    query_lens = [len(seq.token_ids) for seq in scheduled]
    start_positions = [seq.start_position for seq in scheduled]
    q = np.array(query_lens, dtype=np.int64)
    first_position = np.array(start_positions, dtype=np.int64)
    seq_lens = first_position + q
    seq_lens_list = seq_lens.tolist()
    # The checks on Python lists where they can be: a numpy call costs more than a min over
    # a few dozen ints.
    if (
        min(query_lens) == 0
        or min(start_positions) < 0
        or (table_lens * block_size < seq_lens).any()
    ):
        for seq, n, seq_len in zip(scheduled, query_lens, seq_lens_list, strict=True):
            _check_sequence(seq, n, seq_len, block_size)  # raises, naming the request
    if num_blocks is not None and int(block_tables.max()) >= num_blocks:
        raise ValueError(f"block id {int(block_tables.max())} >= num_blocks {num_blocks}")
    num_tokens = sum(query_lens)
    input_ids = np.fromiter(
        chain.from_iterable(seq.token_ids for seq in scheduled), dtype=np.int64, count=num_tokens
    )
    if num_tokens == num_seqs:
        # A decode step (one token each): row i is sequence i at its start position.
        starts = np.arange(num_seqs + 1, dtype=np.int64)
        seq_index = starts[:-1]
        positions = first_position
    else:
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q, out=starts[1:])
        # Row r of sequence i holds position first_position[i] + (r - starts[i]).
        seq_index = np.repeat(np.arange(num_seqs), q)
        positions = (
            np.arange(num_tokens, dtype=np.int64) + (first_position - starts[:-1])[seq_index]
        )
    block_ids = block_tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = block_ids * block_size + positions % block_size
    if any(seq.num_draft_tokens for seq in scheduled):
        logits_rows = _draft_rows(starts, scheduled)
    elif all(seq.num_samples > 0 for seq in scheduled):
        logits_rows = starts[1:] - 1
    else:
        sampled = np.fromiter(
            (seq.num_samples > 0 for seq in scheduled), dtype=bool, count=num_seqs
        )
        logits_rows = starts[1:][sampled] - 1
    device = torch.device(device)
    meta = AttentionMetadata(
        slot_mapping=_tensor(slot_mapping, device),
        query_start_loc=_tensor(starts.astype(np.int32), device),
        seq_lens=_tensor(seq_lens.astype(np.int32), device),
        block_tables=_tensor(block_tables, device),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens_list,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_list),
    )
    if layer_groups:
        meta.groups = _group_metas(
            meta, scheduled, layer_groups, positions, seq_index, seq_lens, block_size, num_blocks
        )
        meta.layer_groups = layer_groups
    return InputBatch(
        input_ids=_tensor(input_ids, device),
        positions=_tensor(positions, device),
        meta=meta,
        logits_indices=_tensor(logits_rows, device),
    )


def _draft_rows(starts: np.ndarray, scheduled: Sequence[ScheduledSequence]) -> np.ndarray:
    """The rows whose logits are sampled when some sequences carry drafts: each sampling
    sequence's last ``1 + num_draft_tokens`` rows, in order."""
    rows = [
        np.arange(int(end) - 1 - seq.num_draft_tokens, int(end))
        for seq, end in zip(scheduled, starts[1:], strict=True)
        if seq.num_samples > 0
    ]
    return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)


def _group_metas(
    meta: AttentionMetadata,
    scheduled: Sequence[ScheduledSequence],
    layer_groups: tuple[int, ...],
    positions: np.ndarray,
    seq_index: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    num_blocks: int | None,
) -> tuple[AttentionMetadata, ...]:
    """The metadata of KV cache groups 1.. (``_build``'s host arrays, so no device round
    trip): each group's padded tables and the slots of the batch's positions in them."""
    num_groups = max(layer_groups)
    if any(len(seq.group_block_tables) != num_groups for seq in scheduled):
        raise ValueError(f"every sequence needs the block tables of {num_groups} more groups")
    device = meta.block_tables.device
    groups = []
    for group in range(num_groups):
        tables, lengths = _padded_tables_np([seq.group_block_tables[group] for seq in scheduled])
        short = np.nonzero(lengths * block_size < seq_lens)[0]
        if len(short):
            seq = scheduled[int(short[0])]
            raise ValueError(
                f"request {seq.request_id!r}: group {group + 1} block table of "
                f"{lengths[short[0]]} blocks cannot hold {meta.seq_lens_list[short[0]]} tokens"
            )
        if num_blocks is not None and int(tables.max()) >= num_blocks:
            raise ValueError(f"block id {int(tables.max())} >= num_blocks {num_blocks}")
        block_ids = tables[seq_index, positions // block_size].astype(np.int64)
        slots = block_ids * block_size + positions % block_size
        groups.append(
            replace(
                meta,
                slot_mapping=_tensor(slots, device),
                block_tables=_tensor(tables, device),
            )
        )
    return tuple(groups)


def later_decode_steps(
    batch: InputBatch, num_steps: int, block_size: int
) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """Positions and metadata of the ``num_steps - 1`` decode steps after ``batch`` (one
    token per sequence, whose block tables hold the window's slots), all computed at once:
    step j has every position and context j + 1 further, and takes as inputs the tokens
    sampled the step before. Equals ``build_input_batch_reference`` over the sequences
    advanced j + 1 tokens (the tests). A window pays a dozen tensor ops once instead of ten
    a step (each costs tens of microseconds right after a forward pass has flushed the
    caches)."""
    meta = batch.meta
    ahead = torch.arange(1, num_steps, device=batch.positions.device)[:, None]
    positions = batch.positions[None, :] + ahead
    per_group = [_later_metas(m, positions, ahead, block_size) for m in (meta, *meta.groups)]
    steps = []
    for j, step_positions in enumerate(positions.unbind(0)):
        step_meta = per_group[0][j]
        step_meta.groups = tuple(group[j] for group in per_group[1:])
        step_meta.layer_groups = meta.layer_groups
        steps.append((step_positions, step_meta))
    return steps


def _later_metas(
    meta: AttentionMetadata, positions: torch.Tensor, ahead: torch.Tensor, block_size: int
) -> list[AttentionMetadata]:
    """One group's metadata of the later decode steps (``later_decode_steps``)."""
    rows = torch.arange(positions.shape[1], device=positions.device)
    block_ids = meta.block_tables[rows, positions // block_size].long()
    slot_mapping = block_ids * block_size + positions % block_size
    seq_lens = meta.seq_lens[None, :] + ahead.to(meta.seq_lens.dtype)
    return [
        AttentionMetadata(
            slot_mapping=step_slots,
            query_start_loc=meta.query_start_loc,
            seq_lens=step_lens,
            block_tables=meta.block_tables,
            query_lens_list=meta.query_lens_list,
            seq_lens_list=[n + j + 1 for n in meta.seq_lens_list],
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len + j + 1,
        )
        for j, (step_slots, step_lens) in enumerate(
            zip(slot_mapping.unbind(0), seq_lens.unbind(0), strict=True)
        )
    ]


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """The array as a tensor on ``device`` (shares its memory on the CPU)."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


def _padded_block_tables_np(
    scheduled: Sequence[ScheduledSequence],
) -> tuple[np.ndarray, np.ndarray]:
    """[num_seqs, max_blocks] int32, padded with 0, filled with one masked assignment;
    and each table's length."""
    return _padded_tables_np([seq.block_table for seq in scheduled])


def _padded_tables_np(block_tables: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    tables = np.zeros((len(block_tables), int(lengths.max())), dtype=np.int32)
    flat = np.fromiter(
        chain.from_iterable(block_tables),
        dtype=np.int32,
        count=int(lengths.sum()),
    )
    # Row-major order of the mask's True cells is the order of the chained tables.
    tables[np.arange(tables.shape[1])[None, :] < lengths[:, None]] = flat
    return tables, lengths


def build_input_batch_reference(
    scheduled: Sequence[ScheduledSequence],
    block_size: int,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
    layer_groups: tuple[int, ...] = (),
) -> InputBatch:
    """The plain construction, one sequence at a time (ground truth for tests); a group's
    metadata is the batch built over that group's tables."""
    batch = _reference(scheduled, block_size, device, num_blocks)
    if layer_groups:
        batch.meta.groups = tuple(
            _reference(
                [seq._replace(block_table=seq.group_block_tables[group]) for seq in scheduled],
                block_size,
                device,
                num_blocks,
            ).meta
            for group in range(max(layer_groups))
        )
        batch.meta.layer_groups = layer_groups
    return batch


def _reference(
    scheduled: Sequence[ScheduledSequence],
    block_size: int,
    device: torch.device | str,
    num_blocks: int | None,
) -> InputBatch:
    if not scheduled:
        raise ValueError("build_input_batch needs at least one scheduled sequence")
    query_lens = [len(seq.token_ids) for seq in scheduled]
    seq_lens = [seq.start_position + n for seq, n in zip(scheduled, query_lens, strict=True)]
    for seq, n, seq_len in zip(scheduled, query_lens, seq_lens, strict=True):
        _check_sequence(seq, n, seq_len, block_size)
    starts = [0, *accumulate(query_lens)]
    input_ids = [token for seq in scheduled for token in seq.token_ids]
    block_tables = _padded_block_tables(scheduled)
    if num_blocks is not None and int(block_tables.max()) >= num_blocks:
        raise ValueError(f"block id {int(block_tables.max())} >= num_blocks {num_blocks}")
    positions = torch.cat(
        [torch.arange(seq.start_position, seq_len) for seq, seq_len in zip(scheduled, seq_lens)]
    )
    seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), torch.tensor(query_lens))
    block_ids = block_tables[seq_index, positions // block_size].long()
    slot_mapping = block_ids * block_size + positions % block_size
    logits_rows = [
        row
        for i, seq in enumerate(scheduled)
        if seq.num_samples > 0
        for row in range(starts[i + 1] - 1 - seq.num_draft_tokens, starts[i + 1])
    ]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return InputBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=positions.to(device),
        meta=meta,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
    )


def _check_sequence(seq: ScheduledSequence, num_new: int, seq_len: int, block_size: int) -> None:
    """The scheduler owns these invariants; a violation here would corrupt another's cache."""
    if num_new == 0:
        raise ValueError(f"request {seq.request_id!r}: no tokens scheduled")
    if seq.start_position < 0:
        raise ValueError(f"request {seq.request_id!r}: negative start_position")
    if len(seq.block_table) * block_size < seq_len:
        raise ValueError(
            f"request {seq.request_id!r}: block table of {len(seq.block_table)} blocks "
            f"cannot hold {seq_len} tokens at block_size {block_size}"
        )


def _padded_block_tables(scheduled: Sequence[ScheduledSequence]) -> torch.Tensor:
    width = max(len(seq.block_table) for seq in scheduled)
    tables = torch.zeros((len(scheduled), width), dtype=torch.int32)
    for i, seq in enumerate(scheduled):
        tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
    return tables
