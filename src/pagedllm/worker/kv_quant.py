"""A quantized paged KV cache: sealed blocks in the pool, open blocks in staging slots.

Per layer, K and V are each a ``QuantizedCache`` (``attention/quant.py``): the pool's
blocks in their compact format with their scales under the same block id, so a block copy,
swap or store moves the scales with the data. Each sequence's open (partly filled) block
lives in full precision in a staging slot, found by block id; it is quantized into the pool
("sealed") in the step that fills it.

A staging slot is taken when a block is left open after a step, and returned when the
block is sealed (at the end of that step, so a retried step still finds its rows), when the
scheduler releases the block (``SchedulerOutput.released_block_ids``), or when the block is
written afresh from its first slot. Copies and swaps move a block's staged rows with it.
Staging grows on demand (doubling), one slot per open block: at most one per running
sequence, plus one per sequence whose step seals its old open block and opens another.
A host block's staged rows stay until a swap-out writes that host block again (the manager
may move a host copy in more than once), so at most one entry per host block.

With ``spec.unquantized_first_block``, logical block 0 of every table is never sealed: it
keeps its slot while anyone can read it (held by a table, or cached-free in the prefix
index, which bounds those: ``BlockPool``'s ``max_cached_first_blocks``), and attention
reads it from staging. Copies, swaps, resizes and the disk tier move it with its rows; its
disk row is its staged rows (``first_block_nbytes`` bytes), not the sealed layout.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.quant import BlockCodec, QuantizedCache, QuantStep
from pagedllm.worker.kv_cache import (
    KVCache,
    KVCacheSpec,
    check_tier_sizes,
    read_blocks_reference,
    write_blocks_reference,
)

INITIAL_STAGING_SLOTS = 16


class QuantizedKVCache:
    """Both tiers of a quantized cache, and the staging slots of open blocks.

    The same methods as ``KVCache`` (``device_caches``, ``copy_blocks``, ``swap_out``,
    ``swap_in``, ``plan_step``, ``finish_step``, ``release_blocks``).
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        num_host_blocks: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if spec.quantization is None:
            raise ValueError("QuantizedKVCache needs a spec with a quantization")
        check_tier_sizes(num_blocks, num_host_blocks)
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.device = torch.device(device)
        self.codecs = (
            BlockCodec.for_side(spec.quantization, "k"),
            BlockCodec.for_side(spec.quantization, "v"),
        )
        self._stage = torch.zeros(
            (spec.num_layers, 2, INITIAL_STAGING_SLOTS, *spec.block_shape),
            dtype=spec.dtype,
            device=self.device,
        )
        self.device_caches = self._caches(self._allocate(num_blocks, self.device))
        self._host_parts = self._allocate(num_host_blocks, torch.device("cpu"))
        self._slot_of: dict[int, int] = {}  # open block id -> staging slot
        self._free_slots = list(range(INITIAL_STAGING_SLOTS - 1, -1, -1))
        self._host_stage: dict[int, torch.Tensor] = {}  # host block -> [L, 2, B, H, D]
        self._sealing: list[int] = []  # blocks sealed this step that still hold a slot
        # Blocks sealed over a draft this step (plan_step): id -> (sequence, positions of
        # the step up to the block's end).
        self._provisional: dict[int, tuple[int, int]] = {}
        if self.first_block_nbytes == spec.bytes_per_block:
            # write_blocks tells a first block's disk row from a sealed one by its length.
            raise ValueError("this geometry's sealed and staged blocks have the same size")

    # ---- the KVCache interface ----------------------------------------------------------

    @property
    def num_staging_slots(self) -> int:
        return int(self._stage.shape[2])

    @property
    def num_open_blocks(self) -> int:
        """Blocks holding a staging slot now (open blocks and unquantized first blocks)."""
        return len(self._slot_of)

    @property
    def first_block_nbytes(self) -> int | None:
        """Bytes of an unquantized first block's disk row (its staged rows, every layer),
        or None when first blocks are sealed like the others."""
        if not self.spec.unquantized_first_block:
            return None
        return self._stage[:, :, 0].numel() * self._stage.element_size()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks src -> dst with their scales and staged rows (all sources are
        read before any destination is written)."""
        if not pairs:
            return
        src, dst = _index_pair(pairs, self.device)
        for k_cache, v_cache in self.device_caches:
            for part in (*k_cache.parts(), *v_cache.parts()):
                part.index_copy_(0, dst, part.index_select(0, src))
        staged = [
            (self._stage[:, :, self._slot_of[s]].clone(), d) for s, d in pairs if s in self._slot_of
        ]
        for d in {d for _, d in pairs}:
            self._drop(d)
        for rows, d in staged:
            self._put(d, rows)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device block, host block) pairs; an open block's staged rows go along."""
        self._move(pairs, out=True)
        for device_block, host_block in pairs:
            slot = self._slot_of.get(device_block)
            if slot is None:
                self._host_stage.pop(host_block, None)
            else:
                self._host_stage[host_block] = self._stage[:, :, slot].to("cpu", copy=True)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        self._move(pairs, out=False)
        for host_block, device_block in pairs:
            self._drop(device_block)
            # Kept: the manager may move the same host copy in again (a shared block).
            rows = self._host_stage.get(host_block)
            if rows is not None:
                self._put(device_block, rows)

    @property
    def device_tensors(self) -> list[torch.Tensor]:
        """Every per-block tensor of the device tier (data, scales, minimums per layer and
        side): what the disk tier stores of a (sealed) block."""
        return [part for layer in self.device_caches for side in layer for part in side.parts()]

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray | list[np.ndarray]:
        """Device blocks as flat bytes, one row a block (``KVCache.read_blocks``): sealed
        blocks in the pool's layout; an unquantized first block (one holding a staging
        slot: the disk tier stores only full blocks) as its staged rows, so then a list of
        rows of two lengths."""
        keep_first = self.spec.unquantized_first_block
        staged = [keep_first and b in self._slot_of for b in block_ids]
        if not any(staged):
            return read_blocks_reference(self.device_tensors, block_ids)
        rows = list(read_blocks_reference(self.device_tensors, block_ids))
        for i, block_id in enumerate(block_ids):
            if staged[i]:
                rows[i] = self._staged_bytes(self._slot_of[block_id])
        return rows

    def write_blocks(
        self, block_ids: Sequence[int], data: np.ndarray | Sequence[np.ndarray]
    ) -> None:
        """Rows of ``read_blocks``' layouts: each row's length says which (a first block's
        staged rows take a staging slot)."""
        first_nbytes = self.first_block_nbytes
        sealed = [i for i, row in enumerate(data) if len(row) != first_nbytes]
        if len(sealed) == len(block_ids):
            write_blocks_reference(self.device_tensors, block_ids, np.asarray(data))
        elif sealed:
            rows = np.stack([data[i] for i in sealed])
            write_blocks_reference(self.device_tensors, [block_ids[i] for i in sealed], rows)
        for i, block_id in enumerate(block_ids):
            self._drop(block_id)
            if len(data[i]) == first_nbytes:
                rows = torch.from_numpy(np.ascontiguousarray(data[i]))
                self._put(block_id, rows.view(self._stage.dtype).view(self._stage[:, :, 0].shape))

    def resize(self, num_blocks: int) -> None:
        """Keep device blocks ``0 .. num_blocks - 1`` (those past a smaller size hold
        nothing anyone reads: the core compacted them away): every pool part (data, scales,
        minimums) re-allocated at the new size with the kept blocks copied. Staged rows stay
        under their block ids; a slot of a dropped block is returned."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        for block_id in [b for b in self._slot_of if b >= num_blocks]:
            self._drop(block_id)
        kept = min(num_blocks, self.num_blocks)
        layers = self._allocate(num_blocks, self.device)
        for sides, caches in zip(layers, self.device_caches, strict=True):
            for parts, cache in zip(sides, caches, strict=True):
                for new, old in zip(
                    [p for p in parts if p is not None], cache.parts(), strict=True
                ):
                    new[:kept].copy_(old[:kept])
        self.device_caches = self._caches(layers)
        self.num_blocks = num_blocks

    def release_blocks(self, block_ids: Collection[int], keep: Collection[int] = ()) -> None:
        """The scheduler freed ``block_ids``: return their staging slots, except those of
        ``keep`` (blocks given new contents by this step's copies or swaps)."""
        for block_id in block_ids:
            if block_id not in keep:
                self._drop(block_id)

    def plan_step(self, meta: AttentionMetadata, drafts: Sequence[int] = ()) -> QuantStep:
        """The step's ``QuantStep``: window blocks, rows, seals and staging slots.

        ``drafts``: each sequence's count of draft positions at its end (speculative
        decoding; empty: none). A block this step fills over a draft is sealed and staged
        both (*provisional*): if the draft is rejected, the next step resumes the block
        mid-way from its staged rows; ``settle_drafts`` frees the slot once it is not."""
        block_size = self.spec.block_size
        seq_lens, query_lens = meta.seq_lens_list, meta.query_lens_list
        # A failed attempt's seals are forgotten: its retry plans them again, and a block of
        # a sequence that failed for good is released (and may be reused) instead.
        self._sealing.clear()
        self._provisional.clear()
        tables = meta.block_tables.cpu().numpy()
        window_start: list[int] = []
        load_window: list[int] = []
        load_slots: list[int] = []
        seal_window: list[int] = []
        seal_blocks: list[int] = []
        keep_window: list[int] = []
        keep_slots: list[int] = []
        first_slots: list[int] = []
        keep_first = self.spec.unquantized_first_block
        num_window = 0
        for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            first = seq_len - query_len
            first_block, last_block = first // block_size, (seq_len - 1) // block_size
            verified = seq_len - drafts[i] if drafts else seq_len  # positions sure to stay
            window_start.append(num_window)
            if first % block_size:
                load_window.append(num_window)
                load_slots.append(self._staged_slot(int(tables[i, first_block])))
            for b in range(first_block, last_block + 1):
                w = num_window + b - first_block
                block_id = int(tables[i, b])
                end = (b + 1) * block_size
                if end <= seq_len and not (keep_first and b == 0):
                    seal_window.append(w)
                    seal_blocks.append(block_id)
                    if end > verified:
                        self._provisional[block_id] = (i, end - first)
                    elif block_id in self._slot_of:
                        self._sealing.append(block_id)
                if end > seq_len or (keep_first and b == 0) or end > verified:
                    if first % block_size == 0 or b > first_block:
                        self._drop(block_id)  # written afresh from its first slot
                    slot = self._slot_of.get(block_id)
                    keep_window.append(w)
                    keep_slots.append(self._take_slot(block_id) if slot is None else slot)
            if keep_first:
                first_slots.append(self._staged_slot(int(tables[i, 0])))
            num_window += last_block - first_block + 1
        starts = np.asarray(window_start, dtype=np.int64)
        first_blocks = (np.asarray(seq_lens) - np.asarray(query_lens)) // block_size
        seq_index = np.repeat(np.arange(len(seq_lens)), query_lens)
        positions = np.concatenate(
            [np.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
        )
        row_slots = (starts - first_blocks)[seq_index] * block_size + positions
        device = self.device
        return QuantStep(
            num_window_blocks=num_window,
            load_window=_long(load_window, device),
            load_slots=_long(load_slots, device),
            row_slots=torch.from_numpy(row_slots).to(device),
            seal_window=_long(seal_window, device),
            seal_blocks=_long(seal_blocks, device),
            keep_window=_long(keep_window, device),
            keep_slots=_long(keep_slots, device),
            window_start=torch.tensor(window_start, dtype=torch.int32, device=device),
            window_start_list=window_start,
            first_slots=torch.tensor(first_slots, dtype=torch.int32, device=device),
            first_slots_list=first_slots,
        )

    def finish_step(self) -> None:
        """The step succeeded: blocks it sealed give back their staging slots."""
        for block_id in self._sealing:
            self._drop(block_id)
        self._sealing.clear()

    def settle_drafts(self, num_verified: Sequence[int]) -> None:
        """The step's drafts are judged: sequence i kept its first ``num_verified[i]``
        positions. A provisional block (``plan_step``) whose every position is kept gives
        its staging slot back (its sealed copy is final); the others keep their rows."""
        for block_id, (i, needed) in self._provisional.items():
            if needed <= num_verified[i]:
                self._drop(block_id)
        self._provisional.clear()

    def check_invariants(self) -> None:
        """Every slot is either free or held by exactly one block."""
        held = list(self._slot_of.values())
        assert len(set(held)) == len(held), "a staging slot is held twice"
        assert not set(held) & set(self._free_slots), "a held staging slot is also free"
        assert len(held) + len(self._free_slots) == self.num_staging_slots

    # ---- internal -----------------------------------------------------------------------

    def _caches(self, layers: list[tuple[tuple, tuple]]) -> list[tuple[QuantizedCache, ...]]:
        """Each layer's (K, V) ``QuantizedCache`` over ``_allocate``'s parts and the staging."""
        return [
            tuple(
                QuantizedCache(codec, *parts, stage=self._stage[layer, side])
                for side, (codec, parts) in enumerate(zip(self.codecs, sides, strict=True))
            )
            for layer, sides in enumerate(layers)
        ]

    def _allocate(self, num_blocks: int, device: torch.device) -> list[tuple[tuple, tuple]]:
        """Per layer, per side, the pool parts: (data, scale, minimum); zeros."""
        block_shape = self.spec.block_shape
        layers = []
        for _ in range(self.spec.num_layers):
            sides = []
            for codec in self.codecs:
                data = _zeros(codec.data_shape(num_blocks, block_shape), codec.data_dtype, device)
                scale_shape = codec.scale_shape(num_blocks, block_shape)
                if scale_shape is None:
                    sides.append((data, None, None))
                    continue
                scale = _zeros(scale_shape, torch.float16, device)
                minimum = _zeros(scale_shape, torch.float16, device) if codec.packed else None
                sides.append((data, scale, minimum))
            layers.append(tuple(sides))
        return layers

    def _move(self, pairs: Sequence[tuple[int, int]], *, out: bool) -> None:
        if not pairs:
            return
        if self.num_host_blocks == 0:
            raise ValueError("swap requested but the host tier has no blocks (num_host_blocks=0)")
        host = torch.device("cpu")
        src_device, dst_device = (self.device, host) if out else (host, self.device)
        src, dst = _index_pair(pairs, src_device, dst_device)
        for layer, host_sides in zip(self.device_caches, self._host_parts, strict=True):
            for cache, host_parts in zip(layer, host_sides, strict=True):
                host_parts = [part for part in host_parts if part is not None]
                for device_part, host_part in zip(cache.parts(), host_parts, strict=True):
                    source, target = (device_part, host_part) if out else (host_part, device_part)
                    target.index_copy_(0, dst, source.index_select(0, src).to(dst_device))

    def _staged_slot(self, block_id: int) -> int:
        slot = self._slot_of.get(block_id)
        if slot is None:
            # The scheduler never resumes writing a block mid-way without its earlier rows.
            raise RuntimeError(f"open block {block_id} has no staged rows")
        return slot

    def _staged_bytes(self, slot: int) -> np.ndarray:
        """A slot's rows, every layer, K and V, as flat bytes (a copy)."""
        rows = self._stage[:, :, slot].to("cpu", copy=True).reshape(-1)
        return rows.view(torch.uint8).numpy()

    def _put(self, block_id: int, rows: torch.Tensor) -> None:
        """Stage ``rows`` [L, 2, B, H, D] under ``block_id`` in a fresh slot (taken before
        the stage is indexed: taking one may grow, and so replace, the stage)."""
        slot = self._take_slot(block_id)
        self._stage[:, :, slot] = rows.to(self.device)

    def _take_slot(self, block_id: int) -> int:
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        self._slot_of[block_id] = slot
        return slot

    def _drop(self, block_id: int) -> None:
        slot = self._slot_of.pop(block_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _grow(self) -> None:
        """Double the staging slots (the caches' ``stage`` views are replaced)."""
        old = self._stage
        count = old.shape[2]
        grown = torch.zeros(
            (old.shape[0], 2, 2 * count, *old.shape[3:]), dtype=old.dtype, device=old.device
        )
        grown[:, :, :count] = old
        self._stage = grown
        for layer, (k_cache, v_cache) in enumerate(self.device_caches):
            k_cache.stage, v_cache.stage = grown[layer, 0], grown[layer, 1]
        self._free_slots.extend(range(2 * count - 1, count - 1, -1))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _index_pair(
    pairs: Sequence[tuple[int, int]],
    src_device: torch.device,
    dst_device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_device or src_device)
    return src, dst


def make_kv_cache(
    spec: KVCacheSpec,
    num_blocks: int,
    num_host_blocks: int = 0,
    device: torch.device | str = "cpu",
    **kwargs: object,
) -> KVCache | QuantizedKVCache:
    """A ``QuantizedKVCache`` when ``spec.quantization`` is set, else a ``KVCache``
    (``kwargs``: its keyword options). Here, not in ``kv_cache.py``: the choice needs both
    classes, and ``kv_cache.py`` must not import this module back."""
    if spec.quantization is None:
        return KVCache(spec, num_blocks, num_host_blocks, device, **kwargs)
    return QuantizedKVCache(spec, num_blocks, num_host_blocks, device)
