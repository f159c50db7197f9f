"""Fast paged attention for CPU.

Decode and short query chunks go to a C++ kernel (``kernels/csrc/paged_attention.cpp``) that
reads K/V straight through the block tables: no contiguous copy of any context, one pass over
each cached row per group of query heads (GQA), fp32 accumulation, torch's intra-op threads.
The kernels are built by ``pagedllm.kernels.build``; if the build fails the backend falls back
to a pure-torch path with the same results.

Long query chunks (prefill) go to the kernel too when it has the tile unit (bf16, head_dim
64) and the context is at most ``LONG_QUERY_MAX_SEQ_LEN`` tokens, or bf16 dot products without
the tile unit (``DOT_LONG_QUERY_MAX_SEQ_LEN``; head_dim 64 and 128 then take the flash prompt
path of ``kernels/csrc/prefill_attention.cpp``), or float32 on the AVX2 path (no AVX-512;
every query, prompt rows on the flash path of ``kernels/csrc/prefill_attention_avx2.cpp``:
``AVX2_LONG_QUERY_MAX_SEQ_LEN``); otherwise to
``scaled_dot_product_attention``, whose CPU flash kernel uses the bf16 matrix units: a whole
prompt attends to its own fresh K/V directly; a chunk after a cached prefix attends to the
prefix (read through the block table: one ``index_select`` copy) and to its own fresh K/V
causally in two mask-free calls, merged by their log-sum-exp.

Layers with a sliding window or soft-capping (``AttentionKind``) go to the kernel for every
query length: it skips the blocks before each task's window, so a windowed row costs at most
W keys however long the context; without the kernel they take the reference path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.attention.base import (
    FULL_ATTENTION,
    AttentionKind,
    AttentionMetadata,
    KernelStep,
    QuantKernelStep,
    write_kv,
)
from pagedllm.attention.quant import (
    QuantizedCache,
    QuantStep,
    check_full_attention,
    forward_reference,
    write_step,
)
from pagedllm.attention.reference import causal_mask, gather_context, paged_attention
from pagedllm.kernels.build import load_library
from pagedllm.kernels.probe import cpu_info

# Query chunks up to this length go to the kernel; longer ones to SDPA (matrix units win there).
MAX_KERNEL_QUERY_LEN = 16
# Query rows per kernel task: each task reads its context once for rows x group query vectors.
ROWS_PER_TASK = 4
# With the tile unit a task takes this many tiles of rows (16 query vectors each): the V rows
# it re-lays out for the tile unit serve them all.
ROW_TILES_PER_TASK = 8
# With the tile unit (bf16, head_dim 64), longer queries go to the kernel too while their
# context is at most this long, where it beats SDPA.
LONG_QUERY_MAX_SEQ_LEN = 2048
# With AVX-512-bf16 dot products but no tile unit, every bf16 query goes to the kernel while
# its context is at most this long (the kernel's scratch grows with the context), in tasks of
# this many query rows. The measurements behind these limits: docs/performance.md.
DOT_LONG_QUERY_MAX_SEQ_LEN = 32768
DOT_ROWS_PER_TASK = 32
# On the AVX2 fp32 path (no AVX-512; head_dim 32-256), float32 queries of any length over a
# context of up to this many tokens go to the kernel (sys.maxsize: every one), in tasks of
# AVX2_ROWS_PER_TASK query rows. Tasks of 16 query vectors or more (rows x group) take its online-softmax prompt path
# (prefill_attention_avx2.cpp), whose scratch does not grow with the context; the two-pass path
# before it lost to SDPA past ~1k tokens. Measurements: docs/performance.md.
AVX2_LONG_QUERY_MAX_SEQ_LEN = sys.maxsize
AVX2_ROWS_PER_TASK = 16
AVX2_HEAD_DIMS = (32, 64, 128, 256)
# The kernel's fp32 path (``paged_attention_isa``) in the route's words. AVX2: head_dim 32, 64,
# 128 and 256 (other head dims stay scalar), fp32 or bf16 caches, without AVX-512.
FP32_ROUTES = {"avx512": "AVX-512 fp32", "avx2": "AVX2 fp32", "scalar": "scalar fp32"}
# quant_attention's vector path in this build (quant_attention_isa), in words.
QUANT_ROUTES = {
    "avx512_vnni": "AVX-512 fp32 over dequantized rows; int8 K/V on VNNI integer dot products",
    "avx512": "AVX-512 fp32 over dequantized rows",
    "avx2": "AVX2 fp32, codes widened in registers (head_dim a multiple of 8)",
    "scalar": "scalar fp32 over dequantized rows",
}
# A chunk after a cached prefix goes to SDPA as two calls (prefix, chunk) merged by their
# log-sum-exp once it has at least this many (query, key) pairs; below, the second call and
# the merge cost more than the masked work they save (benchmarks/attention.py shapes).
SPLIT_MIN_WORK = 1 << 17


class _Route(NamedTuple):
    """A step's split of its sequences between the kernel and SDPA."""

    kernel: torch.Tensor  # bool [num_seqs]: the kernel computes these
    any_kernel: bool
    rest: list[int]  # sequences for SDPA
    # The step's tables as the kernel takes them (int32, unit last stride).
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


class CpuAttention:
    """Paged attention for CPU; outputs match ``ReferenceAttention`` within dtype tolerance.

    ``use_extension``: ``None`` tries the C++ kernel and falls back to torch quietly;
    ``True`` requires it (``RuntimeError`` if it cannot be built); ``False`` never uses it.
    ``bf16_dot``: in bfloat16, multiply with the CPU's bf16 dot-product instructions
    (probabilities rounded to bf16 before the sum over V, as SDPA's flash kernel does);
    ``False`` keeps every product in fp32. ``amx``: compute bf16 scores (head_dim 64) on the
    tile matrix unit where the CPU has one.
    """

    name = "cpu"

    def __init__(
        self,
        *,
        use_extension: bool | None = None,
        max_kernel_query_len: int = MAX_KERNEL_QUERY_LEN,
        rows_per_task: int | None = None,
        bf16_dot: bool = True,
        amx: bool = True,
    ) -> None:
        if max_kernel_query_len < 0:
            raise ValueError("max_kernel_query_len must be >= 0")
        if rows_per_task is not None and rows_per_task < 1:
            raise ValueError("rows_per_task must be >= 1")
        self._op = None if use_extension is False else load_extension()
        self._merge = torch.ops.pagedllm.merge_attention if self._op is not None else None
        self._write = torch.ops.pagedllm.write_kv_ if self._op is not None else None
        self._quant = torch.ops.pagedllm.quant_attention if self._op is not None else None
        self._quant_write = torch.ops.pagedllm.quant_write if self._op is not None else None
        if use_extension is True and self._op is None:
            raise RuntimeError("the pagedllm C++ attention kernel could not be built; see the log")
        self.max_kernel_query_len = max_kernel_query_len
        self.rows_per_task = rows_per_task
        self.bf16_dot = bf16_dot
        self.amx = amx and self._op is not None and bool(torch.ops.pagedllm.amx_available())
        # The kernel's fp32 path in this build: "avx512", "avx2" or "scalar".
        self.fp32_isa = (
            str(torch.ops.pagedllm.paged_attention_isa()) if self._op is not None else None
        )
        # The kernel's bf16 dot products (vdpbf16ps) without the tile unit.
        self.dot_products = self._op is not None and cpu_info().bf16_dot
        # (meta, long_max, route) of the step in progress: see _route.
        self._routes: tuple[AttentionMetadata, int, _Route] | None = None

    @property
    def uses_extension(self) -> bool:
        return self._op is not None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor | QuantizedCache,
        v_cache: torch.Tensor | QuantizedCache,
        meta: AttentionMetadata,
        scale: float,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> torch.Tensor:
        if meta.quant is not None:
            return self._forward_quantized(query, key, value, k_cache, v_cache, meta, scale, kind)
        self._write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        cache_dtype = k_cache.dtype
        q = query if query.dtype == cache_dtype else query.to(cache_dtype)
        kernel = q.stride(2) == 1 and self._kernel_applies(q.dtype, k_cache)
        if not kind.is_full and not kernel:
            # Windows and soft-capping without the kernel: the reference computation over
            # the visible blocks only.
            return paged_attention(query, k_cache, v_cache, meta, scale, kind)
        out = q.new_empty(q.shape)
        if kernel:
            route, rows = self._plan(q.dtype, q.shape[1], k_cache.shape[2], q.shape[2], meta, kind)
            if route.any_kernel:
                self._op(
                    out,
                    q,
                    k_cache,
                    v_cache,
                    route.block_tables,
                    route.seq_lens,
                    route.query_start_loc,
                    route.kernel,
                    scale,
                    rows,
                    self.bf16_dot,
                    self.amx,
                    kind.sliding_window or 0,
                    kind.softcap or 0.0,
                )
            rest = route.rest
        else:
            decode = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
            if decode:
                _decode_torch(out, q, k_cache, v_cache, meta, scale, decode)
            rest = [i for i, n in enumerate(meta.query_lens_list) if n > 1]
        if rest:
            _prefill_sdpa(out, q, key, value, k_cache, v_cache, meta, scale, rest, self._merge)
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def route(self, dtype: torch.dtype) -> str:
        if self._op is None:
            return "torch: batched SDPA for decode, SDPA per prompt (C++ kernels unavailable)"
        bf16_dots = self.bf16_dot and dtype == torch.bfloat16
        if bf16_dots and self.amx:
            isa, long_max = "AMX tiles", LONG_QUERY_MAX_SEQ_LEN  # head_dim 64
        elif bf16_dots and self.dot_products:
            isa, long_max = "AVX-512-bf16", DOT_LONG_QUERY_MAX_SEQ_LEN
        else:
            isa, long_max = self._fp32_route(), 0
            if dtype == torch.float32 and self.fp32_isa == "avx2":
                long_max = AVX2_LONG_QUERY_MAX_SEQ_LEN  # head_dim 32-256
        if long_max == sys.maxsize:  # the AVX2 path's prompt rows: prefill_attention_avx2.cpp
            return (
                f"C++ paged_attention ({isa}): every query, batched; prompt rows in blocks of keys "
                "with an online softmax (head_dim 32-256; other head sizes: SDPA per prompt)"
            )
        kernel = f"C++ paged_attention ({isa}): queries of up to {self.max_kernel_query_len} tokens"
        if long_max:
            kernel += f" and every query over a context of up to {long_max} tokens, batched"
        return kernel + "; longer prompts: SDPA per sequence"

    def quant_route(self, dtype: torch.dtype, quantization: str) -> str:
        if self._quant is None or dtype not in (torch.float32, torch.bfloat16):
            why = "C++ kernels unavailable" if self._quant is None else f"no C++ kernel for {dtype}"
            return f"torch: {quantization} blocks dequantized, then SDPA per sequence ({why})"
        isa = QUANT_ROUTES.get(str(torch.ops.pagedllm.quant_attention_isa()), "scalar fp32")
        return (
            f"C++ quant_attention ({isa}): {quantization} blocks read in place, each "
            "query's open block in full precision; head_dim over 512: dequantized, then SDPA"
        )

    def kind_route(self, dtype: torch.dtype, kind: AttentionKind) -> str:
        if kind.is_full:
            return self.route(dtype)
        if self._op is None or dtype not in (torch.float32, torch.bfloat16):
            return "reference (masked SDPA over the visible blocks only; no C++ kernel)"
        isa = (
            "AVX-512-bf16"
            if self.bf16_dot and dtype == torch.bfloat16 and self.dot_products
            else self._fp32_route()
        )
        return (
            f"C++ paged_attention ({isa}), every query length: blocks before the window "
            "are not read"
        )

    def _fp32_route(self) -> str:
        """The kernel's fp32 arithmetic in words, as this build runs it."""
        return FP32_ROUTES.get(self.fp32_isa or "", "scalar fp32")

    def _forward_quantized(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: QuantizedCache,
        v_cache: QuantizedCache,
        meta: AttentionMetadata,
        scale: float,
        kind: AttentionKind,
    ) -> torch.Tensor:
        """A quantized cache: the step's windows, seals and staging, then attention over
        sealed blocks (dequantized) and each query's own block from the window."""
        check_full_attention(kind)
        q = query if query.dtype == k_cache.dtype else query.to(k_cache.dtype)
        if self._quant is None or not _quant_kernel_applies(q):
            return forward_reference(query, key, value, k_cache, v_cache, meta, scale)
        step = meta.quant
        k_window, v_window = self._write_step(key, value, k_cache, v_cache, step)
        out = torch.empty_like(q)
        self._quant(
            out,
            q,
            k_cache.data,
            k_cache.scale,
            k_cache.minimum,
            k_cache.codec.code,
            v_cache.data,
            v_cache.scale,
            v_cache.minimum,
            v_cache.codec.code,
            k_window,
            v_window,
            _int32(meta.block_tables),
            _int32(meta.seq_lens),
            _int32(meta.query_start_loc),
            step.window_start,
            k_cache.stage,
            v_cache.stage,
            step.first_slots,
            scale,
        )
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def _write_step(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: QuantizedCache,
        v_cache: QuantizedCache,
        step: QuantStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``write_step`` (the reference) in one C++ call (``quant_write``) where the library
        has it."""
        if self._quant_write is None:
            return write_step(key, value, k_cache, v_cache, step)
        return self._quant_write(
            key, value, *k_cache.write_args(), *v_cache.write_args(), *step.write_args()
        )

    def quant_kernel_step(
        self,
        dtype: torch.dtype,
        head_dim: int,
        k_cache: QuantizedCache,
        v_cache: QuantizedCache,
        meta: AttentionMetadata,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> QuantKernelStep | None:
        """``quant_attention``'s step arguments when ``quant_write`` and ``quant_attention``
        take every layer of this quantized step as ``forward`` would (queries cut from the
        qkv product in the caches' dtype), else None
        (``AttentionBackend.quant_kernel_step``)."""
        if (
            meta.quant is None
            or self._quant_write is None
            or not kind.is_full
            or meta.groups
            or not _quant_kernel_takes(k_cache.stage.device, dtype, head_dim)
            or k_cache.dtype != dtype
            or v_cache.dtype != dtype
            or k_cache.block_shape[2] != head_dim
        ):
            return None
        return QuantKernelStep(
            block_tables=_int32(meta.block_tables),
            seq_lens=_int32(meta.seq_lens),
            query_start_loc=_int32(meta.query_start_loc),
        )

    def kernel_step(
        self,
        dtype: torch.dtype,
        num_heads: int,
        head_dim: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> KernelStep | None:
        """``paged_attention``'s step arguments when the kernel takes every sequence of the
        step and ``write_kv_`` takes the caches (as ``forward`` would route them for layers
        of ``kind``), else None (``AttentionBackend.kernel_step``)."""
        # The kernel's conditions, then write_kv_'s for K/V rows cut from the qkv product
        # (rows contiguous, in the model's dtype): it refuses other caches and slot tensors.
        if (
            meta.quant is not None
            or not self._kernel_applies(dtype, k_cache)
            or k_cache.dtype != dtype
            or v_cache.dtype != dtype
            or k_cache.dim() != 4
            or k_cache.shape[3] != head_dim
            or k_cache.shape != v_cache.shape
            or not v_cache.is_contiguous()
            or meta.slot_mapping.dtype != torch.long
            or meta.slot_mapping.dim() != 1
            or not meta.slot_mapping.is_contiguous()
        ):
            return None
        route, rows = self._plan(dtype, num_heads, k_cache.shape[2], head_dim, meta, kind)
        if route.rest or not route.any_kernel:
            return None
        return KernelStep(
            block_tables=route.block_tables,
            seq_lens=route.seq_lens,
            query_start_loc=route.query_start_loc,
            handled=route.kernel,
            rows_per_task=rows,
            fast_bf16=self.bf16_dot,
            use_amx=self.amx,
        )

    def _plan(
        self,
        dtype: torch.dtype,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        meta: AttentionMetadata,
        kind: AttentionKind = FULL_ATTENTION,
    ) -> tuple[_Route, int]:
        """The step's route and the kernel's query rows per task: layers of a non-full
        ``kind`` give the kernel every query (the tile unit takes none of them)."""
        group = num_heads // num_kv_heads
        bf16_dots = self.bf16_dot and dtype == torch.bfloat16
        tiles = self.amx and bf16_dots and head_dim == 64
        if tiles:
            long_max = LONG_QUERY_MAX_SEQ_LEN if group <= 16 else 0
            rows = max(1, 16 // group) * ROW_TILES_PER_TASK
        elif bf16_dots and self.dot_products:
            long_max, rows = DOT_LONG_QUERY_MAX_SEQ_LEN, DOT_ROWS_PER_TASK
        elif dtype == torch.float32 and self.fp32_isa == "avx2" and head_dim in AVX2_HEAD_DIMS:
            long_max = AVX2_LONG_QUERY_MAX_SEQ_LEN
            # Decode and short chunks keep small tasks: more of them for the threads.
            short = meta.max_query_len <= self.max_kernel_query_len
            rows = ROWS_PER_TASK if short else AVX2_ROWS_PER_TASK
        else:
            long_max, rows = 0, ROWS_PER_TASK
        if not kind.is_full:
            long_max = sys.maxsize
        return self._route(meta, long_max), self.rows_per_task or rows

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """The C++ row copy (``write_kv_``, cheaper than index_copy_ at decode sizes), or
        ``write_kv`` (the reference) for what the op does not take:
        it refuses those layouts and dtypes with NotImplementedError, and bad slots with a
        RuntimeError that stands, before writing anything."""
        if self._write is not None:
            try:
                self._write(k_cache, v_cache, key, value, slots)
                return
            except NotImplementedError:
                pass
        write_kv(key, value, k_cache, v_cache, slots)

    def _route(self, meta: AttentionMetadata, long_max: int) -> _Route:
        """Which sequences the kernel takes (short queries, or any query over a context of
        at most ``long_max`` tokens) and which go to SDPA; the kernel computes exactly those
        it is given. Worked out once per step: every layer of a step passes the same meta."""
        if self._routes is None or self._routes[0] is not meta or self._routes[1] != long_max:
            queries = meta.query_lens_list
            if queries and meta.max_query_len <= self.max_kernel_query_len and min(queries) > 0:
                # Every query short (decode steps): the kernel takes them all, whatever
                # their contexts, without a Python pass over the sequences.
                kernel_mask = torch.ones(len(queries), dtype=torch.bool)
                any_kernel, rest = True, []
            else:
                kernel = [
                    n > 0 and (n <= self.max_kernel_query_len or s <= long_max)
                    for n, s in zip(queries, meta.seq_lens_list, strict=True)
                ]
                kernel_mask = torch.tensor(kernel, dtype=torch.bool)
                any_kernel = any(kernel)
                rest = [i for i, (ok, n) in enumerate(zip(kernel, queries)) if not ok and n]
            route = _Route(
                kernel=kernel_mask,
                any_kernel=any_kernel,
                rest=rest,
                block_tables=_int32(meta.block_tables),
                seq_lens=_int32(meta.seq_lens),
                query_start_loc=_int32(meta.query_start_loc),
            )
            self._routes = (meta, long_max, route)
        return self._routes[2]

    def _kernel_applies(self, dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
        """The kernel's conditions but the query's layout (head_dim contiguous)."""
        return (
            self._op is not None
            and k_cache.device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and k_cache.is_contiguous()
        )


def _quant_kernel_applies(query: torch.Tensor) -> bool:
    """``quant_attention``'s conditions (else the plain dequantize-then-attend path)."""
    return query.stride(2) == 1 and _quant_kernel_takes(query.device, query.dtype, query.shape[2])


def _quant_kernel_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """The device, dtype and head size ``quant_attention`` (and ``quant_write``) take."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim <= 512


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _query_starts(meta: AttentionMetadata) -> list[int]:
    starts = [0]
    for n in meta.query_lens_list:
        starts.append(starts[-1] + n)
    return starts


def _decode_torch(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    seqs: list[int],
) -> None:
    """One-token queries in one batched SDPA over contexts gathered through the tables."""
    starts = _query_starts(meta)
    rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=q.device)
    seq_lens = torch.tensor([meta.seq_lens_list[i] for i in seqs], device=q.device)
    max_len = max(meta.seq_lens_list[i] for i in seqs)
    block_size = k_cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = meta.block_tables[seqs, :num_blocks].reshape(-1).long()
    shape = (len(seqs), -1, k_cache.shape[2], k_cache.shape[3])
    k = torch.index_select(k_cache, 0, blocks).view(shape).transpose(1, 2)
    v = torch.index_select(v_cache, 0, blocks).view(shape).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < seq_lens[:, None]
    o = F.scaled_dot_product_attention(
        q[rows].unsqueeze(2),
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out[rows] = o.squeeze(2)


def _prefill_sdpa(
    out: torch.Tensor,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    seqs: list[int],
    merge: Callable[..., None] | None = None,
) -> None:
    """Multi-token queries, one sequence at a time.

    The chunk's own K/V are this step's ``key``/``value`` (already contiguous); only a cached
    prefix is read through the block table.
    """
    starts = _query_starts(meta)
    for i in seqs:
        start, query_len, seq_len = starts[i], meta.query_lens_list[i], meta.seq_lens_list[i]
        rows = slice(start, start + query_len)
        qi = q[rows].transpose(0, 1).unsqueeze(0)
        k_new = key[rows].to(k_cache.dtype).transpose(0, 1).unsqueeze(0)
        v_new = value[rows].to(v_cache.dtype).transpose(0, 1).unsqueeze(0)
        if query_len == seq_len:
            o = F.scaled_dot_product_attention(
                qi, k_new, v_new, is_causal=True, scale=scale, enable_gqa=True
            )
            out[rows] = o.squeeze(0).transpose(0, 1)
        elif _FLASH_WITH_LSE is not None and query_len * seq_len >= SPLIT_MIN_WORK:
            prefix = (k_cache, v_cache, meta.block_tables[i], seq_len - query_len)
            _attend_after_prefix(out[rows], qi, k_new, v_new, prefix, scale, merge)
        else:
            k = gather_context(k_cache, meta.block_tables[i], seq_len).transpose(0, 1)[None]
            v = gather_context(v_cache, meta.block_tables[i], seq_len).transpose(0, 1)[None]
            mask = causal_mask(query_len, seq_len, q.device)
            o = F.scaled_dot_product_attention(
                qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[rows] = o.squeeze(0).transpose(0, 1)


# SDPA's CPU flash kernel, returning the log-sum-exp of each query row's scores as well.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_after_prefix(
    out_rows: torch.Tensor,
    qi: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    scale: float,
    merge: Callable[..., None] | None,
) -> None:
    """A chunk after a cached prefix as two mask-free attentions merged by log-sum-exp.

    Every query row sees the whole prefix (no mask) and the chunk causally (a square causal
    mask, which the flash kernel applies by skipping blocks instead of reading a mask):
    less work than one masked call over the whole context, and no mask to build.
    """
    k_cache, v_cache, table, prefix_len = prefix
    k = gather_context(k_cache, table, prefix_len).transpose(0, 1)[None]
    v = gather_context(v_cache, table, prefix_len).transpose(0, 1)[None]
    o_prefix, lse_prefix = _FLASH_WITH_LSE(qi, k, v, scale=scale)
    o_chunk, lse_chunk = _FLASH_WITH_LSE(qi, k_new, v_new, is_causal=True, scale=scale)
    # [1, H, T, D] -> [T, H, D] and [1, H, T] -> [T, H] (views).
    parts = (o_prefix[0].transpose(0, 1), lse_prefix[0].transpose(0, 1))
    parts += (o_chunk[0].transpose(0, 1), lse_chunk[0].transpose(0, 1))
    (merge or _merge_torch)(out_rows, *parts)


def _merge_torch(
    out: torch.Tensor,
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
) -> None:
    """Softmax over the union of two key sets: o2 + (o1 - o2) / (1 + e^(lse2 - lse1))."""
    w = torch.sigmoid(lse1 - lse2).unsqueeze(-1)
    base = o2.float()
    out.copy_(base + (o1.float() - base) * w)


def load_extension() -> Callable[..., None] | None:
    """The paged attention kernel, or ``None`` when the C++ kernels are unavailable."""
    return torch.ops.pagedllm.paged_attention if load_library() else None
