"""The few lines the engine prints at start-up about its KV cache, from the planner's arithmetic.

Unlike a bare "maximum concurrency" multiplier, it says what the figure counts (whole
blocks per sequence, at max_model_len and at a typical length) and which knob to turn
when the cache is too small or too large for the machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pagedllm.kv_dtypes import QUANTIZED_KV_DTYPES
from pagedllm.planner.capacity import (
    CacheGeometry,
    kv_bytes_per_token,
    kv_formula,
    model_geometry,
)
from pagedllm.planner.presets import GIB, MIB, ModelSpec

DEFAULT_TYPICAL_LEN = 1024
# Above this share of the machine's memory, the cache crowds out everything else.
LARGE_CACHE_SHARE = 0.8
# Below this many typical sequences, continuous batching has little to batch.
FEW_SEQUENCES = 4


@dataclass(frozen=True, slots=True)
class StartupFigures:
    """The numbers behind the start-up report (also handy for ``get_stats`` or logs)."""

    kv_bytes_per_token: int
    formula: str
    block_size: int
    num_blocks: int
    num_tokens: int
    cache_bytes: int
    max_model_len: int
    concurrency_at_max_len: int
    typical_len: int
    concurrency_at_typical_len: int
    advice: str
    # What a token takes in one block: ``kv_bytes_per_token``, or one KV cache group's
    # layers of it when the layers are grouped by attention kind (local/global models).
    block_bytes_per_token: int = 0
    windows: tuple[int | None, ...] = ()  # each KV cache group's window (empty: one group)


def startup_figures(
    model_config: ModelSpec | Mapping[str, Any],
    kv_dtype_bytes: float,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    *,
    typical_len: int | None = None,
    tp: int = 1,
    memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    step_tokens: int = 2048,
) -> StartupFigures:
    """Compute what :func:`startup_report` prints; same arguments."""
    if num_blocks < 0 or max_model_len < 1:
        raise ValueError("num_blocks must be >= 0 and max_model_len >= 1")
    kvpt = kv_bytes_per_token(model_config, kv_dtype_bytes, tp)
    sized = model_geometry(model_config, 0, kv_dtype_bytes, block_size, tp, step_tokens)
    geometry = replace(sized, num_blocks=num_blocks)
    typical = min(typical_len or DEFAULT_TYPICAL_LEN, max_model_len)
    at_max = _fits(geometry, max_model_len)
    at_typical = _fits(geometry, typical)
    cache_bytes = geometry.num_blocks * geometry.block_bytes
    advice = _advice(
        geometry,
        max_model_len,
        at_max,
        at_typical,
        typical,
        memory_bytes,
        max_num_seqs,
        kv_dtype_bytes,
    )
    return StartupFigures(
        kv_bytes_per_token=kvpt,
        block_bytes_per_token=geometry.kv_bytes_per_token,
        windows=geometry.windows,
        formula=kv_formula(model_config, kv_dtype_bytes, tp),
        block_size=block_size,
        num_blocks=num_blocks,
        num_tokens=geometry.num_tokens,
        cache_bytes=cache_bytes,
        max_model_len=max_model_len,
        concurrency_at_max_len=at_max,
        typical_len=typical,
        concurrency_at_typical_len=at_typical,
        advice=advice,
    )


def _fits(geometry: CacheGeometry, num_tokens: int) -> int:
    """Sequences of ``num_tokens`` tokens the cache holds at once (whole blocks; a window
    model's sliding groups hold a window of them)."""
    return geometry.max_sequences(
        geometry.sequence_blocks(num_tokens), geometry.admission_blocks(num_tokens)
    )


def startup_report(
    model_config: ModelSpec | Mapping[str, Any],
    kv_dtype_bytes: float,
    block_size: int,
    num_blocks: int,
    max_model_len: int,
    *,
    typical_len: int | None = None,
    tp: int = 1,
    memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    engine_bytes_per_token: int | None = None,
    kv_cache_dtype: str | None = None,
    staging_block_bytes: int | None = None,
    unquantized_first_block: bool = False,
    step_tokens: int = 2048,
) -> str:
    """The KV-cache lines the engine prints at start-up.

    ``model_config`` is the HF config dict (or a ``ModelSpec``); ``kv_dtype_bytes`` the
    cache element size (2 for bf16/fp16); ``block_size``/``num_blocks`` the cache the
    engine allocated; ``typical_len`` a representative prompt + output length (default
    1,024 tokens); ``memory_bytes`` the memory the cache was carved from (device memory,
    or host RAM on CPU) and ``max_num_seqs`` the batch limit, both optional, used only
    to say whether the cache is too large. ``engine_bytes_per_token``: what the engine's
    cache tensors take per token, checked against the formula in one more line.
    to say whether the cache is too large. ``kv_cache_dtype`` names the format (a
    quantized one counts its scales in ``kv_dtype_bytes``); ``staging_block_bytes``, for a
    quantized cache, is one open block in the model's dtype: a line says how much staging
    ``max_num_seqs`` open blocks may take beside the pool; with ``unquantized_first_block``
    another line counts the first blocks kept in that dtype (one per running sequence, and
    up to ``max_num_seqs`` cached-free ones in the prefix cache).
    """
    f = startup_figures(
        model_config,
        kv_dtype_bytes,
        block_size,
        num_blocks,
        max_model_len,
        typical_len=typical_len,
        tp=tp,
        memory_bytes=memory_bytes,
        max_num_seqs=max_num_seqs,
        step_tokens=step_tokens,
    )
    if f.typical_len == f.max_model_len:
        at = f"{f.concurrency_at_max_len:,} at max_model_len {f.max_model_len:,} tokens"
    else:
        at = (
            f"{f.concurrency_at_max_len:,} at max_model_len {f.max_model_len:,} tokens, "
            f"{f.concurrency_at_typical_len:,} at {f.typical_len:,} tokens"
        )
    kind = ""
    if kv_cache_dtype:
        scales = ", scales included" if kv_cache_dtype in QUANTIZED_KV_DTYPES else ""
        kind = f" ({kv_cache_dtype}{scales})"
    lines = [
        f"KV cache{kind}: {f.kv_bytes_per_token:,} bytes per token ({f.formula})",
        f"KV cache: {f.num_blocks:,} blocks x {f.block_size} tokens = {f.num_tokens:,} tokens "
        f"({_size(f.cache_bytes)})",
        *_window_lines(f),
        f"Maximum concurrency (whole blocks per sequence): {at}",
        f"KV cache: {f.advice}",
        *_engine_check(f.block_bytes_per_token, engine_bytes_per_token, tp),
    ]
    if staging_block_bytes:
        most = f"up to {max_num_seqs:,} x " if max_num_seqs else ""
        total = f" = {_size(max_num_seqs * staging_block_bytes)}" if max_num_seqs else ""
        lines.append(
            "KV cache: each sequence's open block stays in the model's dtype until it fills "
            f"(staging beside the pool, taken as needed: {most}"
            f"{staging_block_bytes:,} bytes{total})"
        )
    if staging_block_bytes and unquantized_first_block:
        lines.append(_first_block_line(staging_block_bytes, block_size, max_num_seqs))
    return "\n".join(lines)


def _first_block_line(block_bytes: int, block_size: int, max_num_seqs: int | None) -> str:
    """What keeping first blocks unquantized costs beside the pool (their pool blocks stay
    allocated, unused, so each one costs a full-precision block more)."""
    most = ""
    if max_num_seqs:
        most = f": up to 2 x {max_num_seqs:,} x {block_bytes:,} bytes = "
        most += _size(2 * max_num_seqs * block_bytes)
    return (
        f"KV cache: each sequence's first block (tokens 0-{block_size - 1}) stays in the "
        f"model's dtype, never quantized (one per running sequence and per cached first "
        f"block{most}; {block_bytes / block_size:,.0f} bytes per token of those blocks)"
    )


def _window_lines(f: StartupFigures) -> list[str]:
    """How a window model's blocks are counted."""
    if not any(w is not None for w in f.windows):
        return []
    windows = ", ".join(str(w) for w in sorted({w for w in f.windows if w is not None}))
    if len(f.windows) == 1:
        return [f"KV cache: every layer slides (window {windows}): a sequence holds a window"]
    return [
        f"KV cache: {len(f.windows)} KV cache groups (full and window {windows}), one block "
        f"table each; a block holds one group's layers: {f.block_bytes_per_token:,} bytes per "
        "token of a block; full groups hold every token, sliding ones a window"
    ]


def _engine_check(formula_bytes: int, engine_bytes: int | None, tp: int) -> list[str]:
    """One line saying whether the engine's tensors take what the formula says (a rank's
    share of it with tensor parallelism)."""
    if engine_bytes is None:
        return []
    if engine_bytes == formula_bytes:
        return [
            f"KV cache: the engine's tensors take {engine_bytes:,} bytes per token = the formula"
        ]
    return [
        f"KV cache: the engine's tensors take {engine_bytes:,} bytes per token "
        f"(the formula says {formula_bytes:,}{' per rank' if tp > 1 else ''})"
    ]


def _size(num_bytes: float) -> str:
    """``1.50GiB`` / ``200MiB``: the form ``--kv-cache-memory`` accepts."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f}GiB"
    return f"{max(1, math.ceil(num_bytes / MIB))}MiB"


def _sequences(n: int) -> str:
    return f"{n:,} sequence" + ("" if n == 1 else "s")


def _advice(
    geometry: CacheGeometry,
    max_model_len: int,
    at_max: int,
    at_typical: int,
    typical: int,
    memory_bytes: int | None,
    max_num_seqs: int | None,
    kv_dtype_bytes: float,
) -> str:
    cache_bytes = geometry.num_blocks * geometry.block_bytes
    # The engine's knobs: --kv-cache-memory / --memory-fraction size the cache; a 16-bit
    # --dtype halves a float32 cache's bytes per token.
    dtype_hint = ", or a 16-bit --dtype (halves the bytes per token)" if kv_dtype_bytes >= 4 else ""
    one_long = geometry.admission_blocks(max_model_len) * geometry.block_bytes
    if at_max < 1:
        return (
            f"too small for one {max_model_len:,}-token sequence: give --kv-cache-memory at least "
            f"{_size(one_long)} ({_size(FEW_SEQUENCES * one_long)} for {FEW_SEQUENCES}) or a larger "
            f"--memory-fraction{dtype_hint}, or lower --max-model-len to {geometry.num_tokens:,}"
        )
    if memory_bytes and cache_bytes > LARGE_CACHE_SHARE * memory_bytes:
        return (
            f"takes {cache_bytes / memory_bytes:.0%} of {_size(memory_bytes)}, leaving little for "
            "weights and activations: lower --kv-cache-memory or --memory-fraction"
        )
    if max_num_seqs and at_typical > 4 * max_num_seqs:
        enough = max_num_seqs * geometry.sequence_blocks(typical) * geometry.block_bytes
        return (
            f"holds {_sequences(at_typical)} of {typical:,} tokens but at most {max_num_seqs} run "
            f"at once: the surplus only serves as prefix cache; --kv-cache-memory {_size(enough)} "
            "would hold a full batch of them, or raise --max-num-seqs"
        )
    if at_typical < FEW_SEQUENCES:
        enough = FEW_SEQUENCES * geometry.sequence_blocks(typical) * geometry.block_bytes
        return (
            f"only {_sequences(at_typical)} of {typical:,} tokens "
            f"{'fits' if at_typical == 1 else 'fit'}, too few to batch: give "
            f"--kv-cache-memory at least {_size(enough)} or a larger --memory-fraction{dtype_hint}"
        )
    return "sized sensibly for this max_model_len (run `pagedllm plan` to size it for a workload)"
