"""Capacity arithmetic: KV bytes per token, weights, the KV budget, blocks, concurrency.

Everything is per device (per tensor-parallel rank): a sequence's KV is split across
the ranks of its group (GQA heads) or replicated on each (MLA latent), so the
concurrency of one rank is the concurrency of the group.

Four ways of holding a sequence of ``L`` tokens (``M`` = max_model_len, ``B`` = block
size, ``P`` = shared system-prompt tokens)::

    contiguous, max-length   reserves M tokens             -> tokens // M
    contiguous, exact        reserves L tokens             -> tokens // L
    paged                    ceil(L / B) blocks            -> blocks // ceil(L / B)
    paged + shared prompt    P // B full blocks held once  -> (blocks - P//B) // (ceil(L/B) - P//B)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pagedllm.core.kv_groups import KVCacheLayout, kv_cache_layout
from pagedllm.gguf_header import held_weight_bytes
from pagedllm.planner.presets import GIB, ModelSpec, spec_from_config

SCHEMES = ("contiguous_max", "contiguous_exact", "paged", "paged_shared")
SCHEME_LABELS = {
    "contiguous_max": "contiguous, max-length reservation",
    "contiguous_exact": "contiguous, exact reservation",
    "paged": "paged",
    "paged_shared": "paged + shared system prompt",
}
BLOCK_SIZE_CANDIDATES = (8, 16, 32, 64, 128, 256)
# Activation scratch assumed per batched token: residual + q/k/v/o (4 x hidden) and the
# gated MLP's two intermediate tensors, in fp32 (the worst case a step materialises).
ACTIVATION_CHUNK_TOKENS = 8192
LOGITS_ROWS = 256


def _spec(model_config: ModelSpec | Mapping[str, Any]) -> ModelSpec:
    return model_config if isinstance(model_config, ModelSpec) else spec_from_config(model_config)


def _kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    # Heads are split across ranks; when tp exceeds the head count each rank keeps a replica.
    return max(1, math.ceil(spec.num_kv_heads / tp))


def kv_bytes_per_token(
    model_config: ModelSpec | Mapping[str, Any], kv_dtype_bytes: float, tp: int = 1
) -> int:
    """Bytes of KV cache one token occupies on one tensor-parallel rank.

    MHA/GQA: ``layers x kv_heads_per_rank x head_dim x 2 (K and V) x dtype bytes``.
    MLA: ``layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes`` — the latent is
    the only thing cached (no separate V) and every rank holds all of it.
    """
    spec = _spec(model_config)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if kv_dtype_bytes <= 0:
        raise ValueError(f"kv_dtype_bytes must be positive, got {kv_dtype_bytes}")
    if spec.attention == "mla":
        elements = spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    else:
        elements = spec.num_layers * _kv_heads_per_rank(spec, tp) * spec.head_dim * 2
    return int(round(elements * kv_dtype_bytes))


def kv_formula(
    model_config: ModelSpec | Mapping[str, Any], kv_dtype_bytes: float, tp: int = 1
) -> str:
    """``kv_bytes_per_token`` written out, e.g. ``32 layers x 8 KV heads x ... = 131,072 bytes``."""
    spec = _spec(model_config)
    total = kv_bytes_per_token(spec, kv_dtype_bytes, tp)
    size = "1 byte" if kv_dtype_bytes == 1 else f"{_num(kv_dtype_bytes)} bytes"
    if spec.attention == "mla":
        return (
            f"MLA: {spec.num_layers} layers x ({spec.kv_lora_rank} latent rank + "
            f"{spec.qk_rope_head_dim} RoPE dims) x {size} = {total:,} bytes/token "
            f"(no separate V; the latent is replicated on every TP rank)"
        )
    kind = spec.attention.upper()
    heads = f"{spec.num_kv_heads} KV heads"
    if tp > 1:
        heads = (
            f"({spec.num_kv_heads} KV heads / TP {tp} -> {_kv_heads_per_rank(spec, tp)} per rank)"
        )
    return (
        f"{kind}: {spec.num_layers} layers x {heads} x {spec.head_dim} head dim x "
        f"2 (K and V) x {size} = {total:,} bytes/token"
    )


def param_count(model_config: ModelSpec | Mapping[str, Any]) -> int:
    """Parameters estimated from the config: embeddings, attention, MLP or experts, norms."""
    spec = _spec(model_config)
    h = spec.hidden_size
    embeddings = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    per_layer_attention = _attention_params(spec) + 2 * h  # two RMSNorms per layer
    dense_mlp = 3 * h * spec.intermediate_size  # gate, up, down
    num_dense = spec.first_k_dense_replace if spec.is_moe else spec.num_layers
    total = embeddings + h + spec.num_layers * per_layer_attention + num_dense * dense_mlp
    if spec.is_moe:
        experts = spec.num_routed_experts + spec.num_shared_experts
        moe_layer = experts * 3 * h * spec.moe_intermediate_size + h * spec.num_routed_experts
        total += (spec.num_layers - num_dense) * moe_layer
    return total


def _attention_params(spec: ModelSpec) -> int:
    h = spec.hidden_size
    if spec.attention != "mla":
        q_and_o = 2 * h * spec.num_heads * spec.head_dim
        return q_and_o + 2 * h * spec.num_kv_heads * spec.head_dim
    qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    if spec.q_lora_rank:
        q = h * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * spec.num_heads * qk_dim
    else:
        q = h * spec.num_heads * qk_dim
    kv_down = h * (spec.kv_lora_rank + spec.qk_rope_head_dim) + spec.kv_lora_rank
    kv_up = spec.kv_lora_rank * spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
    out = spec.num_heads * spec.v_head_dim * h
    return q + kv_down + kv_up + out


def weight_bytes(
    model_config: ModelSpec | Mapping[str, Any], weight_dtype_bytes: float, tp: int = 1
) -> int:
    """Weight bytes on one rank: parameters x dtype bytes / tp (quantisation scales ignored);
    a GGUF's as the engine holds them (kept quantized tensors at their stored size, the
    rest at ``weight_dtype_bytes``) / tp."""
    spec = _spec(model_config)
    if spec.gguf is not None:
        return held_weight_bytes(spec.gguf, weight_dtype_bytes) // tp
    return int(param_count(spec) * weight_dtype_bytes / tp)


def reserve_bytes_estimate(model_config: ModelSpec | Mapping[str, Any], tp: int = 1) -> int:
    """Activation scratch a step may need beside weights and cache (an estimate, per rank).

    One prefill chunk of ``ACTIVATION_CHUNK_TOKENS`` tokens with fp32 activations of
    ``4 x hidden + 2 x intermediate / tp`` floats each, plus fp32 logits for
    ``LOGITS_ROWS`` sequences. Engines measure this with a profiling run; here it is
    the one number the user may want to override (``--reserve``).
    """
    spec = _spec(model_config)
    inter = (
        spec.moe_intermediate_size * spec.num_experts_per_tok
        if spec.is_moe
        else spec.intermediate_size
    )
    per_token = (4 * spec.hidden_size + 2 * inter // tp) * 4
    return per_token * ACTIVATION_CHUNK_TOKENS + spec.vocab_size * LOGITS_ROWS * 4


@dataclass(frozen=True, slots=True)
class Budget:
    """How a device's memory splits: ``memory x fraction = weights + reserve + KV``."""

    memory_bytes: int
    memory_fraction: float
    weight_bytes: int
    reserve_bytes: int
    kv_budget_bytes: int

    @property
    def weight_share(self) -> float:
        return self.weight_bytes / self.memory_bytes


def kv_budget(
    memory_bytes: int, memory_fraction: float, weight_bytes: int, reserve_bytes: int
) -> Budget:
    """The KV budget left after weights and the activation reserve (0 when they do not fit)."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    usable = int(memory_bytes * memory_fraction)
    kv = max(0, usable - weight_bytes - reserve_bytes)
    return Budget(memory_bytes, memory_fraction, weight_bytes, reserve_bytes, kv)


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """The paged cache a KV budget buys: ``num_blocks`` blocks of ``block_size`` tokens.

    ``kv_bytes_per_token``: what one token takes in one block (every layer; for a model
    whose layers are grouped by attention kind, one group's layers). ``windows``: each KV
    cache group's window (None: full attention; empty: one full group). A sliding group
    holds at most the blocks a step's queries see, ``ceil((W - 1 + step) / B) + 1``, with
    ``step`` = 1 while decoding and ``step_tokens`` (the engine's token budget a step) while
    a prompt is computed; one more block is the placeholder released entries point at.
    """

    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    windows: tuple[int | None, ...] = ()
    step_tokens: int = 2048

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def whole_tokens(self) -> int:
        """Tokens of every layer the blocks' bytes hold (a grouped model's token takes one
        block slot in each group): what a contiguous reservation could place."""
        return self.num_tokens // max(1, len(self.windows))

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def usable_blocks(self) -> int:
        """Blocks sequences may hold: all but the placeholder of a window model."""
        return self.num_blocks - self.has_windows

    def sequence_blocks(self, num_tokens: int, step: int = 1) -> int:
        """Blocks a sequence of ``num_tokens`` cached tokens holds in all groups together
        when a step computes ``step`` of them (1: decoding, its steady state)."""
        full = blocks_needed(num_tokens, self.block_size)
        if not self.windows:
            return full
        seen = [
            full if w is None else min(full, blocks_needed(w - 1 + step, self.block_size) + 1)
            for w in self.windows
        ]
        return sum(seen)

    def admission_blocks(self, num_tokens: int) -> int:
        """Blocks a sequence holds at its peak: while its prompt is computed, a step of up
        to ``step_tokens`` tokens seen by every sliding group at once."""
        return self.sequence_blocks(num_tokens, min(num_tokens, self.step_tokens))

    def max_sequences(self, num_tokens: float, admission: float) -> int:
        """How many sequences holding ``num_tokens``-token footprints (``num_tokens`` and
        ``admission`` are their blocks when decoding and at their peak) fit at once: one
        at its peak (the one being admitted) beside the others decoding."""
        if not self.has_windows:
            return int(self.num_blocks / num_tokens)
        room = self.usable_blocks - admission
        return 0 if room < 0 else 1 + int(room / num_tokens)


def cache_geometry(
    kv_budget_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    windows: tuple[int | None, ...] = (),
    step_tokens: int = 2048,
) -> CacheGeometry:
    """Whole blocks that fit in the budget (the remainder is unusable)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if kv_bytes_per_token < 1:
        raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
    num_blocks = kv_budget_bytes // (kv_bytes_per_token * block_size)
    return CacheGeometry(kv_bytes_per_token, block_size, num_blocks, windows, step_tokens)


def kv_cache_groups(model_config: ModelSpec | Mapping[str, Any]) -> KVCacheLayout:
    """The model's KV cache groups (``core/kv_groups.py``), as the engine makes them."""
    return kv_cache_layout(_spec(model_config).windows)


def block_bytes_per_token(
    model_config: ModelSpec | Mapping[str, Any], kv_dtype_bytes: float, tp: int = 1
) -> int:
    """Bytes one token takes in one block: ``kv_bytes_per_token`` for one group (every
    layer), one group's layers of it when the layers are grouped by attention kind."""
    spec = _spec(model_config)
    layout = kv_cache_groups(spec)
    total = kv_bytes_per_token(spec, kv_dtype_bytes, tp)
    if len(layout.groups) == 1:
        return total
    return total * layout.layers_per_block // spec.num_layers


def model_geometry(
    model_config: ModelSpec | Mapping[str, Any],
    kv_budget_bytes: int,
    kv_dtype_bytes: float,
    block_size: int,
    tp: int = 1,
    step_tokens: int = 2048,
) -> CacheGeometry:
    """``cache_geometry`` for a model: its block bytes and its groups' windows."""
    layout = kv_cache_groups(model_config)
    windows = layout.windows if layout.windows != (None,) else ()
    per_token = block_bytes_per_token(model_config, kv_dtype_bytes, tp)
    return cache_geometry(kv_budget_bytes, per_token, block_size, windows, step_tokens)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class Workload:
    """The sequences to plan for: total tokens (prompt + output) and shared-prefix tokens each.

    ``prefix_ids`` groups sequences that share one system prompt (``None`` = no sharing);
    ``prefix_lens`` says how many leading tokens the group shares.
    """

    label: str
    lengths: tuple[int, ...]
    prefix_lens: tuple[int, ...] = ()
    prefix_ids: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError(f"workload {self.label!r} has no sequences")
        if min(self.lengths) < 1:
            raise ValueError(f"workload {self.label!r}: every length must be >= 1 token")
        n = len(self.lengths)
        if self.prefix_lens and len(self.prefix_lens) != n:
            raise ValueError("prefix_lens must match lengths")
        if self.prefix_ids and len(self.prefix_ids) != n:
            raise ValueError("prefix_ids must match lengths")

    @property
    def mean_length(self) -> float:
        return sum(self.lengths) / len(self.lengths)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def prefix_len(self, i: int) -> int:
        # A sequence always computes at least its last token itself (as the prefix cache
        # caps hits at num_tokens - 1), so at most length - 1 tokens are shared.
        return min(self.prefix_lens[i], self.lengths[i] - 1) if self.prefix_lens else 0

    def prefix_key(self, i: int) -> str | None:
        if not self.prefix_len(i):
            return None
        return self.prefix_ids[i] if self.prefix_ids else "system"


def fixed_workload(length: int, shared_prefix: int = 0) -> Workload:
    """One length for every sequence; all of them share a ``shared_prefix``-token prompt."""
    prefix = min(shared_prefix, length - 1)
    return Workload(_tokens_label(length), (length,), (prefix,), ("system",))


@dataclass(frozen=True, slots=True)
class Concurrency:
    """Maximum concurrent sequences per scheme for one workload (steady state)."""

    contiguous_max: int
    contiguous_exact: int
    paged: int
    paged_shared: int

    def get(self, scheme: str) -> int:
        return getattr(self, scheme)


def max_concurrency(geometry: CacheGeometry, workload: Workload, max_model_len: int) -> Concurrency:
    """How many sequences of ``workload`` fit at once, under each scheme.

    For a mix of lengths this is the steady-state figure: capacity divided by the mean
    footprint (the simulator measures what a queue actually achieves). Contiguous
    figures ignore external fragmentation, so they are upper bounds for a mix.
    """
    if workload.max_length > max_model_len:
        raise ValueError(
            f"a sequence of {workload.max_length} tokens exceeds max_model_len {max_model_len}"
        )
    tokens, bs = geometry.whole_tokens, geometry.block_size
    blocks = [geometry.sequence_blocks(n) for n in workload.lengths]
    peaks = [geometry.admission_blocks(n) for n in workload.lengths]
    # Only the full groups keep a shared prompt's blocks: a sliding group releases them.
    num_full = sum(w is None for w in geometry.windows) if geometry.windows else 1
    shared = num_full * _shared_blocks(workload, bs)
    prefix = [num_full * p for p in _own_prefix_blocks(workload, bs)]
    own = [b - p for b, p in zip(blocks, prefix, strict=True)]
    own_peaks = [b - p for b, p in zip(peaks, prefix, strict=True)]
    shared_geometry = replace(geometry, num_blocks=max(0, geometry.num_blocks - shared))
    return Concurrency(
        contiguous_max=tokens // max_model_len,
        contiguous_exact=int(tokens / workload.mean_length),
        paged=geometry.max_sequences(_mean(blocks), _mean(peaks)),
        paged_shared=shared_geometry.max_sequences(
            max(_mean(own), 1e-9), max(_mean(own_peaks), 1e-9)
        ),
    )


def _own_prefix_blocks(workload: Workload, block_size: int) -> list[int]:
    # Only full blocks are shared; the prompt's partial tail block is every sequence's own.
    return [workload.prefix_len(i) // block_size for i in range(len(workload.lengths))]


def _shared_blocks(workload: Workload, block_size: int) -> int:
    """Blocks held once for all: the full blocks of each distinct shared prefix."""
    per_group: dict[str, int] = {}
    for i in range(len(workload.lengths)):
        key = workload.prefix_key(i)
        if key is not None:
            per_group[key] = max(per_group.get(key, 0), workload.prefix_len(i) // block_size)
    return sum(per_group.values())


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def concurrency_at_length(
    geometry: CacheGeometry, length: int, max_model_len: int, shared_prefix: int = 0
) -> Concurrency:
    return max_concurrency(geometry, fixed_workload(length, shared_prefix), max_model_len)


def length_below_target(
    geometry: CacheGeometry, target: int, max_model_len: int, scheme: str, shared_prefix: int = 0
) -> int | None:
    """The shortest context length at which ``scheme`` holds fewer than ``target`` sequences.

    ``None`` when even ``max_model_len`` tokens still fit ``target`` sequences; ``1`` when
    not even one-token sequences do. Concurrency never rises with length, so bisect.
    """
    if target < 1:
        raise ValueError(f"target concurrency must be >= 1, got {target}")

    def fits(length: int) -> bool:
        conc = concurrency_at_length(geometry, length, max_model_len, shared_prefix)
        return conc.get(scheme) >= target

    if fits(max_model_len):
        return None
    if not fits(1):
        return 1
    low, high = 1, max_model_len  # fits(low) and not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return high


@dataclass(frozen=True, slots=True)
class BlockSizeRow:
    """One candidate block size, judged for the workload."""

    block_size: int
    num_blocks: int
    blocks_per_seq: float
    internal_waste_tokens: float  # mean unused slots in each sequence's last block
    internal_waste_fraction: float
    prefix_unshared_tokens: int  # shared-prompt tokens in a partial block, copied per sequence
    concurrency: int  # paged_shared when a prompt is shared, else paged
    table_ops_per_1k_tokens: float  # block-table entries, allocations and hashes per 1k tokens


@dataclass(frozen=True, slots=True)
class BlockSizeAdvice:
    rows: tuple[BlockSizeRow, ...]
    block_size: int | None  # None: not one sequence fits at any candidate block size
    reasoning: str


def recommend_block_size(
    kv_budget_bytes: int,
    kv_bytes_per_token: int,
    workload: Workload,
    max_model_len: int,
    candidates: Sequence[int] = BLOCK_SIZE_CANDIDATES,
    tolerance: float = 0.05,
) -> BlockSizeAdvice:
    """Waste at each candidate block size beside its per-block overhead, and a choice.

    Small blocks waste less in each sequence's last block and share more of a system
    prompt, but every block is one more block-table entry to gather, one more
    allocation and one more hash. The choice: the largest block size whose
    concurrency is within ``tolerance`` of the best candidate's (a policy: how many
    sessions one gives up for fewer block operations; ``--block-size-tolerance``).
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"block size tolerance must be in [0, 1), got {tolerance}")
    rows = tuple(
        _block_size_row(kv_budget_bytes, kv_bytes_per_token, workload, max_model_len, bs)
        for bs in candidates
    )
    best = max(row.concurrency for row in rows)
    if best == 0:
        return BlockSizeAdvice(
            rows, None, _nothing_fits(kv_budget_bytes, kv_bytes_per_token, workload, candidates)
        )
    good = [row for row in rows if row.concurrency >= best * (1 - tolerance)]
    chosen = max(good, key=lambda row: row.block_size)
    smallest = min(rows, key=lambda row: row.block_size)
    reasoning = (
        f"best concurrency among block sizes {candidates[0]}..{candidates[-1]} is {best:,}; "
        f"block size {chosen.block_size} keeps {chosen.concurrency:,} (within {tolerance:.0%})"
    )
    if chosen is not smallest:
        reasoning += (
            f" with {chosen.table_ops_per_1k_tokens:.0f} block operations per 1k tokens instead "
            f"of {smallest.table_ops_per_1k_tokens:.0f} at {smallest.block_size}"
        )
    reasoning += f"; its last-block waste is {chosen.internal_waste_fraction:.1%} of the cache"
    larger = [row for row in rows if row.block_size > chosen.block_size]
    if larger:
        nxt = larger[0]
        reasoning += (
            f"; {nxt.block_size} would drop to {nxt.concurrency:,} "
            f"({nxt.internal_waste_fraction:.1%} waste"
            + (
                f", {nxt.prefix_unshared_tokens} prompt tokens unshared"
                if nxt.prefix_unshared_tokens
                else ""
            )
            + ")"
        )
    return BlockSizeAdvice(rows, chosen.block_size, reasoning)


def _nothing_fits(
    kv_budget_bytes: int, kvpt: int, workload: Workload, candidates: Sequence[int]
) -> str:
    longest = workload.max_length
    if kv_budget_bytes <= 0:
        why = "no KV budget: the weights and activation reserve take all the memory"
    else:
        why = (
            f"the {kv_budget_bytes / 2**30:.2f} GiB KV budget holds "
            f"{kv_budget_bytes // kvpt:,} tokens, fewer than one {_tokens_label(longest)}-token "
            "sequence needs"
        )
    return (
        f"not one sequence fits at any block size {candidates[0]}..{candidates[-1]} "
        f"({why}); fit the model first (a larger --tp, a smaller --weight-dtype, "
        "--kv-dtype fp8, more memory or shorter contexts)"
    )


def _block_size_row(
    kv_budget_bytes: int, kvpt: int, workload: Workload, max_model_len: int, bs: int
) -> BlockSizeRow:
    geometry = cache_geometry(kv_budget_bytes, kvpt, bs)
    conc = max_concurrency(geometry, workload, max_model_len)
    blocks = [blocks_needed(n, bs) for n in workload.lengths]
    waste = [b * bs - n for b, n in zip(blocks, workload.lengths, strict=True)]
    has_prefix = any(workload.prefix_key(i) for i in range(len(workload.lengths)))
    unshared = max((workload.prefix_len(i) % bs for i in range(len(workload.lengths))), default=0)
    return BlockSizeRow(
        block_size=bs,
        num_blocks=geometry.num_blocks,
        blocks_per_seq=_mean(blocks),
        internal_waste_tokens=_mean(waste),
        internal_waste_fraction=_mean(waste) / (_mean(blocks) * bs),
        prefix_unshared_tokens=unshared if has_prefix else 0,
        concurrency=conc.paged_shared if has_prefix else conc.paged,
        table_ops_per_1k_tokens=1000 / bs,
    )


@dataclass(frozen=True, slots=True)
class FractionAdvice:
    memory_fraction: float | None  # None: the target cannot be served on this device
    needed_kv_bytes: int
    reasoning: str


MAX_SAFE_FRACTION = 0.95


def recommend_memory_fraction(
    memory_bytes: int,
    weight_bytes: int,
    reserve_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    workload: Workload,
    target: int,
    scheme: str = "paged",
) -> FractionAdvice:
    """The smallest memory fraction that holds ``target`` sequences of the workload."""
    per_seq = _mean([blocks_needed(n, block_size) for n in workload.lengths])
    shared = 0
    if scheme == "paged_shared":
        own = _own_prefix_blocks(workload, block_size)
        per_seq -= _mean(own)
        shared = _shared_blocks(workload, block_size)
    blocks = math.ceil(target * per_seq) + shared
    needed_kv = blocks * block_size * kv_bytes_per_token
    needed = weight_bytes + reserve_bytes + needed_kv
    fraction = math.ceil(needed / memory_bytes * 100) / 100
    parts = (
        f"{target} x {per_seq:.1f} blocks x {block_size * kv_bytes_per_token / 2**20:.2f} MiB"
        f" = {needed_kv / GIB:.2f} GiB of cache, + {weight_bytes / GIB:.2f} GiB weights"
        f" + {reserve_bytes / GIB:.2f} GiB activation reserve = {needed / GIB:.2f} GiB"
        f" of {memory_bytes / GIB:.2f} GiB"
    )
    if fraction > MAX_SAFE_FRACTION:
        return FractionAdvice(
            None,
            needed_kv,
            f"{parts}: more than {MAX_SAFE_FRACTION:.0%} of the device, so the target does not fit; "
            "use a larger --tp, --kv-dtype fp8, a smaller --weight-dtype or shorter contexts",
        )
    return FractionAdvice(
        fraction,
        needed_kv,
        f"{parts}: a memory fraction of {fraction:.2f} serves the target; anything above it "
        f"(up to {MAX_SAFE_FRACTION:.2f}) becomes prefix cache and queue headroom",
    )


def verdict(
    model_name: str, budget: Budget, workload: Workload, concurrency: Concurrency, kv_bytes: int
) -> str:
    """One line: how many sessions fit, and what limits them."""
    if len(workload.lengths) == 1:
        sessions = f"{workload.label}-token sessions"
    else:
        sessions = f"sessions of {workload.label} (mean {workload.mean_length:,.0f} tokens)"
    weight_pct = f"{budget.weight_share:.0%}"
    usable = budget.memory_bytes * budget.memory_fraction
    if budget.weight_bytes + budget.reserve_bytes >= usable:
        return (
            f"{model_name} does not fit: the weights need {budget.weight_bytes / GIB:.1f} GiB per "
            f"device ({weight_pct} of memory), the memory fraction allows {usable / GIB:.1f} GiB; "
            "the weights are the limit (raise --tp or use a smaller --weight-dtype)"
        )
    best = max(concurrency.paged, concurrency.paged_shared)
    if best < 1:
        need = workload.mean_length * kv_bytes
        return (
            f"{model_name} cannot hold one of the {sessions}: one needs {need / GIB:.2f} GiB of "
            f"cache, the budget is {budget.kv_budget_bytes / GIB:.2f} GiB; the cache is the limit"
        )
    if budget.weight_share < 0.5:
        limit = f"the weights are {weight_pct} of memory, the cache is the limit"
    else:
        limit = (
            f"the weights are {weight_pct} of memory and leave the cache little room "
            "(a larger --tp or a smaller --weight-dtype frees some)"
        )
    if concurrency.paged_shared > concurrency.paged:
        how = f"paged, sharing the prompt; {concurrency.paged:,} without sharing"
    else:
        how = "paged"
    return (
        f"{model_name} fits {best:,} concurrent {sessions} ({how}; "
        f"{concurrency.contiguous_max:,} with max-length reservation); {limit}"
    )


def _tokens_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


def _num(x: float) -> str:
    return f"{x:g}"


def scan_lengths(max_model_len: int, points: int = 160) -> list[int]:
    """Context lengths from 128 to ``max_model_len``, evenly spaced on a log scale."""
    low = min(128, max_model_len)
    if max_model_len <= low:
        return [max_model_len]
    ratio = (max_model_len / low) ** (1 / (points - 1))
    lengths = sorted({min(max_model_len, int(round(low * ratio**i))) for i in range(points)})
    return lengths


def concurrency_curve(
    geometry: CacheGeometry,
    max_model_len: int,
    shared_prefix: int = 0,
    lengths: Sequence[int] | None = None,
) -> dict[str, list[tuple[int, int]]]:
    """Concurrency versus context length, per scheme (for the plot and ``--json``)."""
    lengths = list(lengths or scan_lengths(max_model_len))
    curve: dict[str, list[tuple[int, int]]] = {scheme: [] for scheme in SCHEMES}
    for length in lengths:
        conc = concurrency_at_length(geometry, length, max_model_len, shared_prefix)
        for scheme in SCHEMES:
            curve[scheme].append((length, conc.get(scheme)))
    return curve
