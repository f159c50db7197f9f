"""Every fast attention path against ReferenceAttention, the ground truth."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention import AttentionMetadata, ReferenceAttention, cpu
from pagedllm.attention.base import FULL_ATTENTION, AttentionKind
from pagedllm.attention.cpu import CpuAttention
from pagedllm.attention.select import get_backend

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# The backends the tests taking ``make_backend`` run on: CpuAttention's arguments by id
# (None: the torch path, no kernels).
BACKENDS = {
    "cpu-torch": None,
    "cpu-kernel": {},
    "cpu-kernel-fp32dot": {"bf16_dot": False},
    "cpu-kernel-no-amx": {"amx": False},
    # The kernel with every query length routed to it (prefill tiles included).
    "cpu-kernel-all": {"max_kernel_query_len": 10**9},
}
needs_kernels = pytest.mark.usefixtures("kernel_ops")


@pytest.fixture(params=list(BACKENDS))
def make_backend(request):
    """A factory of the backend the parameter names; the kernel ones need the kernels built."""
    kwargs = BACKENDS[request.param]
    if kwargs is None:
        return lambda: CpuAttention(use_extension=False)
    request.getfixturevalue("kernel_ops")
    return lambda: CpuAttention(use_extension=True, **kwargs)


def make_step(
    shapes: list[tuple[int, int]],
    *,
    block_size: int,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    extra_columns: int = 2,
    seed: int = 0,
):
    """A random step: each (query_len, seq_len) sequence gets shuffled blocks, its cached prefix
    already in the cache, and fresh K/V for its query rows. The query is a strided view into a
    fused QKV tensor, as a model produces it."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-seq_len // block_size) for _, seq_len in shapes]
    num_blocks = sum(blocks_needed) + 3
    ids = list(range(1, num_blocks))  # block 0 is only padding
    rng.shuffle(ids)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    width = max(blocks_needed) + extra_columns
    tables = torch.zeros(len(shapes), width, dtype=torch.int32)
    slots = []
    for i, ((query_len, seq_len), n) in enumerate(zip(shapes, blocks_needed)):
        table = [ids.pop() for _ in range(n)]
        tables[i, :n] = torch.tensor(table, dtype=torch.int32)
        for p in range(seq_len - query_len, seq_len):
            slots.append(table[p // block_size] * block_size + p % block_size)
    num_tokens = sum(q for q, _ in shapes)
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    fused = fused.to(dtype)
    q_end = num_heads * head_dim
    k_end = q_end + num_kv_heads * head_dim
    query = fused[:, :q_end].view(num_tokens, num_heads, head_dim)
    key = fused[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    query_lens = [q for q, _ in shapes]
    seq_lens = [s for _, s in shapes]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return query, key, value, k_cache, v_cache, meta, head_dim**-0.5


def check_against_reference(backend, step, kind: AttentionKind = FULL_ATTENTION) -> None:
    query, key, value, k_cache, v_cache, meta, scale = step
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = ReferenceAttention().forward(query, key, value, k_ref, v_ref, meta, scale, kind)
    got = backend.forward(query, key, value, k_cache, v_cache, meta, scale, kind)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    # The step's K/V landed in the same slots (bit for bit; NaN where a test put NaN).
    for cache, ref in ((k_cache, k_ref), (v_cache, v_ref)):
        torch.testing.assert_close(cache, ref, rtol=0, atol=0, equal_nan=True)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_decode(make_backend, dtype, block_size):
    shapes = [(1, n) for n in (1, 5, 16, 17, 33, 100)]
    step = make_step(shapes, block_size=block_size, dtype=dtype, seed=block_size)
    check_against_reference(make_backend(), step)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_prefill(make_backend, dtype, block_size):
    shapes = [(n, n) for n in (1, 3, 16, 40)]
    step = make_step(shapes, block_size=block_size, dtype=dtype, seed=10 + block_size)
    check_against_reference(make_backend(), step)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_prefill_after_cached_prefix(make_backend, dtype, block_size):
    # Query chunks below and above the kernel's length limit, prefixes ending mid-block.
    shapes = [(4, 20), (16, 48), (17, 50), (30, 31), (2, 9)]
    step = make_step(shapes, block_size=block_size, dtype=dtype, seed=20 + block_size)
    check_against_reference(make_backend(), step)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_mixed_chunked_batch(make_backend, dtype):
    # A chunked-prefill step: decodes, a first chunk, a middle chunk, a last chunk.
    shapes = [(1, 70), (24, 24), (1, 3), (24, 48), (9, 57), (1, 129)]
    step = make_step(shapes, block_size=16, dtype=dtype, seed=3)
    check_against_reference(make_backend(), step)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (8, 1, 64), (6, 2, 128), (4, 2, 32), (4, 2, 24)],
    ids=["mha", "mqa", "gqa-d128", "gqa-d32", "gqa-d24-scalar"],
)
def test_head_layouts(make_backend, num_heads, num_kv_heads, head_dim):
    shapes = [(1, 37), (5, 21), (20, 20), (1, 1)]
    step = make_step(
        shapes,
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=head_dim,
    )
    check_against_reference(make_backend(), step)


def test_long_context_decode_bf16(make_backend):
    shapes = [(1, 1000), (1, 777), (3, 513), (40, 1100), (300, 300)]
    step = make_step(shapes, block_size=16, dtype=torch.bfloat16, seed=7)
    check_against_reference(make_backend(), step)


# Forces each route of a long chunk after a cached prefix: (kernel context limit, least work
# for the two-call SDPA). (0, 0): two SDPA calls merged by log-sum-exp for every chunk;
# (0, huge): one masked SDPA call; (huge, 0): the kernel wherever it has the tile unit,
# (bf16) AVX-512-bf16 dot products or (fp32) the AVX2 path.
PREFIX_ROUTES = [(0, 0), (0, 10**12), (10**6, 0)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 7])
@pytest.mark.parametrize("route", PREFIX_ROUTES, ids=["split-sdpa", "masked-sdpa", "kernel"])
def test_prefix_routes(make_backend, dtype, block_size, route, monkeypatch):
    monkeypatch.setattr(cpu, "LONG_QUERY_MAX_SEQ_LEN", route[0])
    monkeypatch.setattr(cpu, "DOT_LONG_QUERY_MAX_SEQ_LEN", route[0])
    monkeypatch.setattr(cpu, "AVX2_LONG_QUERY_MAX_SEQ_LEN", route[0])
    monkeypatch.setattr(cpu, "SPLIT_MIN_WORK", route[1])
    # Prefixes ending mid-block and on a block edge, one-token prefixes, whole prompts and
    # decodes in the same step; tables padded past the last block.
    shapes = [(17, 50), (30, 31), (33, 65), (48, 48), (1, 40), (20, 36)]
    step = make_step(shapes, block_size=block_size, dtype=dtype, seed=30 + block_size)
    check_against_reference(make_backend(), step)


@pytest.mark.parametrize("block_size", [16, 7])
def test_long_context_after_cached_prefix_bf16(make_backend, block_size):
    # The benchmark's shapes, shortened: contexts on both sides of the kernel's limit and
    # chunks on both sides of the two-call SDPA's threshold.
    shapes = [(64, 2100), (200, 1500), (17, 2049), (1, 2100), (130, 1030)]
    step = make_step(shapes, block_size=block_size, dtype=torch.bfloat16, seed=8)
    check_against_reference(make_backend(), step)


@needs_kernels
def test_long_prompts_are_one_batched_kernel_call_with_bf16_dot_products(monkeypatch):
    backend = CpuAttention(use_extension=True)
    if backend.amx or not backend.dot_products:
        pytest.skip("this CPU has the tile unit or no bf16 dot products: another route")
    calls = []
    monkeypatch.setattr(cpu, "_prefill_sdpa", lambda *a, **k: calls.append("sdpa"))
    # Whole prompts and chunks after a prefix, over 1024 tokens: every one in the kernel.
    shapes = [(1100, 1100), (300, 1500), (1, 1200)]
    check_against_reference(backend, make_step(shapes, block_size=16, dtype=torch.bfloat16))
    assert calls == []
    assert "every query over a context of up to" in backend.route(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_merge_attention_matches_torch(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    o1, o2 = (torch.randn(37, 6, head_dim, generator=gen).to(dtype) for _ in range(2))
    # Log-sum-exps far apart too: the weights must saturate to 0 and 1 without NaNs.
    lse1 = torch.randn(37, 6, generator=gen) * 3
    lse2 = torch.randn(37, 6, generator=gen) * 3
    lse1[0], lse2[1] = 200.0, 200.0
    expected = torch.empty(37, 6, head_dim, dtype=dtype)
    cpu._merge_torch(expected, o1, lse1, o2, lse2)
    got = torch.full_like(expected, float("nan"))
    torch.ops.pagedllm.merge_attention(got, o1, lse1, o2, lse2)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernels
@pytest.mark.parametrize("rows_per_task", [None, 1, 5, 64])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(8, 2), (8, 1), (16, 1), (2, 2)], ids=["g4", "g8", "g16", "g1"]
)
def test_kernel_row_tiles(rows_per_task, num_heads, num_kv_heads):
    # Tasks of one or many row tiles (the tile-unit path shares V across them), ranges that
    # end mid-tile, every GQA group size the tile unit takes.
    backend = CpuAttention(
        use_extension=True, rows_per_task=rows_per_task, max_kernel_query_len=10**9
    )
    shapes = [(37, 90), (64, 64), (5, 200), (1, 33)]
    step = make_step(
        shapes,
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=torch.bfloat16,
        seed=rows_per_task or 0,
    )
    check_against_reference(backend, step)


def test_float32_query_with_bf16_cache(make_backend):
    query, key, value, k_cache, v_cache, meta, scale = make_step(
        [(1, 30), (6, 6), (3, 40)], block_size=16, dtype=torch.bfloat16, seed=5
    )
    step = (query.float(), key.float(), value.float(), k_cache, v_cache, meta, scale)
    backend = make_backend()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = ReferenceAttention().forward(*step[:3], k_ref, v_ref, meta, scale)
    got = backend.forward(*step)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@needs_kernels
def test_kernel_reads_through_block_table():
    # Swapping two blocks in the cache without fixing the table must change the output:
    # proves the kernel follows the table rather than assuming a layout.
    query, key, value, k_cache, v_cache, meta, scale = make_step([(1, 40)], block_size=16)
    backend = CpuAttention(use_extension=True)
    first = backend.forward(query, key, value, k_cache, v_cache, meta, scale)
    b0, b1 = int(meta.block_tables[0, 0]), int(meta.block_tables[0, 1])
    k_cache[[b0, b1]] = k_cache[[b1, b0]].clone()
    second = backend.forward(query, key, value, k_cache, v_cache, meta, scale)
    assert not torch.allclose(first, second)


def test_get_backend():
    assert get_backend("reference").name == "reference"
    assert get_backend("cpu").name == "cpu"
    assert get_backend().name == "cpu"
    with pytest.raises(ValueError, match="attention backend"):
        get_backend("gpu")


def test_bad_arguments():
    with pytest.raises(ValueError, match="rows_per_task"):
        CpuAttention(rows_per_task=0)


@needs_kernels
def test_kernel_leaves_matmuls_intact():
    # The kernel borrows the CPU's tile unit, whose configuration oneDNN caches per thread:
    # bf16 matmuls and SDPA before and after it must give identical results.
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 512, generator=gen).bfloat16()
    w = torch.randn(768, 512, generator=gen).bfloat16()
    q = torch.randn(1, 8, 40, 64, generator=gen).bfloat16()
    kv = torch.randn(1, 2, 40, 64, generator=gen).bfloat16()

    def work():
        linear = torch.nn.functional.linear(x, w)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, kv, kv, is_causal=True, enable_gqa=True
        )
        return linear, sdpa

    before = work()
    step = make_step([(1, 300), (1, 64), (4, 90)], block_size=16, dtype=torch.bfloat16)
    CpuAttention(use_extension=True).forward(*step)
    after = work()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


# Sliding windows (smaller and larger than the contexts; edges inside a block and on block
# edges for block size 16) and Gemma 2's soft-capping, alone and together.
WINDOW_KINDS = [
    AttentionKind(sliding_window=1),
    AttentionKind(sliding_window=5),
    AttentionKind(sliding_window=16),
    AttentionKind(sliding_window=37),
    AttentionKind(sliding_window=4096),
    AttentionKind(softcap=2.0),
    AttentionKind(sliding_window=20, softcap=3.0),
]
WINDOW_IDS = ["w1", "w5", "w16", "w37", "w4096", "cap2", "w20-cap3"]
# Decodes, whole prompts, chunks after a cached prefix (prefixes ending mid-block and on a
# block edge), one-token contexts: one chunked-prefill step.
WINDOW_SHAPES = [(1, 1), (1, 70), (1, 129), (24, 24), (40, 40), (17, 50), (24, 48), (9, 57)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kind", WINDOW_KINDS, ids=WINDOW_IDS)
def test_windows_and_softcap(make_backend, dtype, block_size, kind):
    step = make_step(WINDOW_SHAPES, block_size=block_size, dtype=dtype, seed=40 + block_size)
    check_against_reference(make_backend(), step, kind)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 1, 256), (8, 1, 64), (6, 2, 128), (4, 2, 32), (4, 2, 24)],
    ids=["mqa-d256", "mqa", "gqa-d128", "gqa-d32", "gqa-d24-scalar"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_windows_every_head_layout(make_backend, num_heads, num_kv_heads, head_dim, dtype):
    step = make_step(
        [(1, 300), (33, 100), (20, 20)],
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        seed=head_dim,
    )
    check_against_reference(make_backend(), step, AttentionKind(sliding_window=40, softcap=5.0))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 1, 256), (8, 1, 64), (9, 3, 64), (14, 2, 64), (6, 2, 128), (3, 1, 24)],
    ids=["mqa-d256", "mqa", "g3-d64", "g7-d64", "gqa-d128", "g3-d24-scalar"],
)
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_one_sequence_shares_its_heads(
    make_backend, num_heads, num_kv_heads, head_dim, threads, dtype
):
    # One decoding sequence has fewer tasks (kv heads) than threads: the kernel cuts each
    # task's query heads into pieces, one thread a piece; every head must still land in its
    # own output rows, with and without a window and soft-capping.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seq_len, kind in (
            (300, FULL_ATTENTION),
            (1, FULL_ATTENTION),
            (300, AttentionKind(sliding_window=40, softcap=5.0)),
        ):
            step = make_step(
                [(1, seq_len)],
                block_size=16,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                seed=seq_len + head_dim,
            )
            check_against_reference(make_backend(), step, kind)
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_window_reads_no_block_before_it(dtype):
    # Every table entry before the window's first block points at a block of NaNs: a
    # read of any of them would poison the output.
    block_size, window = 16, 40
    shapes = [(1, 300), (30, 200), (1, 41)]
    query, key, value, k_cache, v_cache, meta, scale = make_step(
        shapes, block_size=block_size, dtype=dtype, seed=5
    )
    nan_block = 0  # make_step never hands out block 0
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    for i, (query_len, seq_len) in enumerate(shapes):
        first = max(0, seq_len - query_len - window + 1) // block_size
        meta.block_tables[i, :first] = nan_block
    kind = AttentionKind(sliding_window=window)
    step = (query, key, value, k_cache, v_cache, meta, scale)
    check_against_reference(CpuAttention(use_extension=True), step, kind)


@needs_kernels
def test_windowed_layers_give_every_query_to_the_kernel(monkeypatch):
    # Full layers here send long prompts to SDPA (the AVX2 path's context limit off).
    monkeypatch.setattr(cpu, "AVX2_LONG_QUERY_MAX_SEQ_LEN", 0)
    calls = []
    monkeypatch.setattr(cpu, "_prefill_sdpa", lambda *a, **k: calls.append("sdpa"))
    monkeypatch.setattr(cpu, "paged_attention", lambda *a, **k: calls.append("reference"))
    backend = CpuAttention(use_extension=True)
    step = make_step([(600, 600), (300, 900), (1, 50)], block_size=16, seed=9)
    check_against_reference(backend, step, AttentionKind(sliding_window=64))
    assert calls == []
    query, _, _, k_cache, v_cache, meta, _ = step
    kind = AttentionKind(sliding_window=64)
    assert backend.kernel_step(torch.float32, 8, 64, k_cache, v_cache, meta, kind) is not None
    assert backend.kernel_step(torch.float32, 8, 64, k_cache, v_cache, meta) is None
    assert "blocks before the window are not read" in backend.kind_route(torch.float32, kind)
    assert backend.kind_route(torch.float32, FULL_ATTENTION) == backend.route(torch.float32)


def flash_backend(**kwargs) -> CpuAttention:
    """The kernel on its flash prompt path (prefill_attention.cpp): bf16 dot products, no
    tile unit; skips where this CPU has no bf16 dot products."""
    backend = CpuAttention(use_extension=True, amx=False, max_kernel_query_len=10**9, **kwargs)
    if not backend.dot_products:
        pytest.skip("no AVX-512-bf16 dot products on this CPU: the flash prompt path is not built")
    return backend


@needs_kernels
@pytest.mark.parametrize("block_size", [16, 7, 1])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(8, 2, 64), (4, 4, 64), (8, 1, 64), (9, 3, 64), (6, 2, 128)],
    ids=["g4", "g1", "g8", "g3", "g3-d128"],
)
def test_flash_prompt_kernel_across_key_blocks(block_size, num_heads, num_kv_heads, head_dim):
    # Queries and prefixes on both sides of the kernel's 64-key blocks (a row's first key
    # block, the diagonal block, a lone odd key in the last block), whole prompts, chunks
    # after a cached prefix, and decodes beside them.
    shapes = [(63, 63), (64, 64), (65, 65), (129, 129), (40, 104), (70, 200), (17, 81), (1, 77)]
    step = make_step(
        shapes,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=block_size + head_dim,
    )
    check_against_reference(flash_backend(), step)


@needs_kernels
@pytest.mark.parametrize("rows_per_task", [4, 16, 37, 64])
def test_flash_prompt_kernel_long_context_and_row_tasks(rows_per_task):
    # A long chunk after a cached prefix and a long whole prompt (the 4k benchmark's shapes,
    # shortened), split into tasks of several row counts (ranges ending mid-block).
    shapes = [(700, 1900), (1100, 1100), (5, 300)]
    step = make_step(shapes, block_size=16, dtype=torch.bfloat16, seed=rows_per_task)
    check_against_reference(flash_backend(rows_per_task=rows_per_task), step)


@needs_kernels
def test_flash_prompt_kernel_ignores_unwritten_cache_rows():
    # Cache rows past each context (the rest of its last block, padding columns of the
    # table) hold NaN bits: the kernel must never multiply them in, even by a zero weight.
    query, key, value, k_cache, v_cache, meta, scale = make_step(
        [(33, 33), (50, 71), (3, 9)], block_size=16, dtype=torch.bfloat16, seed=4
    )
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    # The cached prefixes (positions before each query) hold real values.
    gen = torch.Generator().manual_seed(4)
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        for p in range(s_len - q_len):
            block = int(meta.block_tables[i, p // 16])
            k_cache[block, p % 16] = torch.randn(k_cache.shape[2:], generator=gen).bfloat16()
            v_cache[block, p % 16] = torch.randn(v_cache.shape[2:], generator=gen).bfloat16()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = ReferenceAttention().forward(query, key, value, k_ref, v_ref, meta, scale)
    got = flash_backend().forward(query, key, value, k_cache, v_cache, meta, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize(
    "kind",
    [
        AttentionKind(sliding_window=1),
        AttentionKind(sliding_window=37),
        AttentionKind(sliding_window=64),
        AttentionKind(sliding_window=100, softcap=4.0),
        AttentionKind(softcap=2.0),
    ],
    ids=["w1", "w37", "w64", "w100-cap4", "cap2"],
)
def test_flash_prompt_kernel_windows_and_softcap(kind):
    # Windows narrower and wider than a 64-key block, over prompts and chunks after a prefix
    # long enough that rows leave blocks behind them.
    shapes = [(200, 200), (150, 400), (20, 90)]
    step = make_step(shapes, block_size=16, dtype=torch.bfloat16, seed=kind.sliding_window or 0)
    check_against_reference(flash_backend(), step, kind)


def avx2_backend(**kwargs) -> CpuAttention:
    """The kernel with every query length routed to it (unless kwargs say otherwise), on its
    AVX2 + FMA path (paged_attention_avx2.cpp); skips where this build runs fp32 on another
    path."""
    backend = CpuAttention(use_extension=True, **{"max_kernel_query_len": 10**9, **kwargs})
    if backend.fp32_isa != "avx2":
        pytest.skip(
            f"this build's fp32 kernel path is {backend.fp32_isa}, not AVX2 "
            "(AVX-512 builds keep their own; the AVX2 path needs AVX2 + FMA)"
        )
    return backend


def check_on_kernel(backend, step, monkeypatch, kind: AttentionKind = FULL_ATTENTION) -> None:
    """check_against_reference, and every query row computed by the kernel (none by SDPA)."""
    calls = []
    monkeypatch.setattr(cpu, "_prefill_sdpa", lambda *a, **k: calls.append("sdpa"))
    check_against_reference(backend, step, kind)
    assert calls == []


# The AVX2 path's tiles: 1, 2 and 3 query vectors per tile (groups 1, 3, 4, 8 give every mix),
# head dims 32 to 256.
AVX2_LAYOUTS = [
    (4, 4, 64),
    (9, 3, 64),
    (8, 2, 64),
    (8, 1, 64),
    (4, 4, 128),
    (6, 2, 128),
    (8, 2, 128),
    (16, 2, 128),
    (4, 2, 32),
    (2, 1, 256),
]
AVX2_IDS = [
    "g1-d64",
    "g3-d64",
    "g4-d64",
    "g8-d64",
    "g1-d128",
    "g3-d128",
    "g4-d128",
    "g8-d128",
    "g2-d32",
    "g2-d256",
]
# Decodes on both sides of block edges and over many blocks, short chunks after cached prefixes
# (ending mid-block and on an edge), short whole prompts, a one-token context.
AVX2_SHAPES = [(1, n) for n in (1, 7, 16, 17, 130, 300)] + [(3, 50), (16, 40), (5, 21), (16, 16)]


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), AVX2_LAYOUTS, ids=AVX2_IDS)
def test_avx2_decode_and_short_chunks(block_size, num_heads, num_kv_heads, head_dim, monkeypatch):
    step = make_step(
        AVX2_SHAPES,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=block_size + head_dim + num_heads,
    )
    check_on_kernel(avx2_backend(), step, monkeypatch)


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 64)],
    ids=["g1-d64", "g3-d64", "g4-d128", "g8-d64"],
)
@pytest.mark.parametrize("kind", WINDOW_KINDS, ids=WINDOW_IDS)
def test_avx2_windows_and_softcap(block_size, num_heads, num_kv_heads, head_dim, kind, monkeypatch):
    step = make_step(
        WINDOW_SHAPES,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=60 + block_size,
    )
    check_on_kernel(avx2_backend(), step, monkeypatch, kind)


@needs_kernels
@pytest.mark.parametrize("rows_per_task", [1, 3, 4, 16, 64])
@pytest.mark.parametrize("kind", [FULL_ATTENTION, AttentionKind(sliding_window=40, softcap=5.0)])
def test_avx2_row_tasks(rows_per_task, kind, monkeypatch):
    # Tasks of one to many query rows (row ranges ending mid-block, rows that see different
    # keys), long prompts and chunks after a prefix.
    shapes = [(37, 90), (64, 64), (5, 200), (1, 33), (130, 400)]
    step = make_step(shapes, block_size=16, num_heads=9, num_kv_heads=3, seed=rows_per_task)
    check_on_kernel(avx2_backend(rows_per_task=rows_per_task), step, monkeypatch, kind)


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (8, 2, 128), (4, 2, 32), (2, 1, 256)],
    ids=["g3-d64", "g4-d128", "g2-d32", "g2-d256"],
)
def test_avx2_bf16_cache(block_size, num_heads, num_kv_heads, head_dim, monkeypatch):
    # bf16 storage, widened to fp32 on the AVX2 path.
    step = make_step(
        AVX2_SHAPES,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=block_size + head_dim,
    )
    check_on_kernel(avx2_backend(), step, monkeypatch)
    kind = AttentionKind(sliding_window=20, softcap=3.0)
    check_on_kernel(avx2_backend(), step, monkeypatch, kind)


@needs_kernels
def test_avx2_route_is_named():
    backend = avx2_backend()
    assert "C++ paged_attention (AVX2 fp32)" in backend.route(torch.float32)
    kind = AttentionKind(sliding_window=8)
    assert backend.kind_route(torch.float32, kind).startswith("C++ paged_attention (AVX2 fp32)")


@needs_kernels
def test_avx2_fp32_prompts_over_any_context_are_one_batched_kernel_call(monkeypatch):
    backend = avx2_prompt_backend()
    # Whole prompts and chunks after a prefix on both sides of the old 1024-token limit, and
    # a decode: every one in the kernel.
    shapes = [(300, 300), (200, 1024), (64, 1025), (1, 1200), (40, 2000)]
    step = make_step(shapes, block_size=16, num_heads=9, num_kv_heads=3, seed=3)
    check_on_kernel(backend, step, monkeypatch)
    assert "every query, batched" in backend.route(torch.float32)
    _, _, _, k_cache, v_cache, meta, _ = step
    ks = backend.kernel_step(torch.float32, 9, 64, k_cache, v_cache, meta)
    assert ks is not None and ks.rows_per_task == cpu.AVX2_ROWS_PER_TASK


@needs_kernels
def test_avx2_context_limit_sends_longer_prompts_to_sdpa(monkeypatch):
    # The route's limit, where one is set: sequences over a longer context go to SDPA.
    monkeypatch.setattr(cpu, "AVX2_LONG_QUERY_MAX_SEQ_LEN", 1024)
    backend = avx2_prompt_backend()
    sdpa = []
    real = cpu._prefill_sdpa

    def record(*args):  # the sequences SDPA takes (its 9th argument), then SDPA
        sdpa.append(args[8])
        real(*args)

    monkeypatch.setattr(cpu, "_prefill_sdpa", record)
    shapes = [(300, 300), (200, 1024), (64, 1025), (1, 1200)]
    step = make_step(shapes, block_size=16, num_heads=9, num_kv_heads=3, seed=3)
    check_against_reference(backend, step)
    assert sdpa == [[2]]  # only the chunk over a context past the limit
    assert "every query over a context of up to 1024 tokens" in backend.route(torch.float32)
    _, _, _, k_cache, v_cache, meta, _ = step
    assert backend.kernel_step(torch.float32, 9, 64, k_cache, v_cache, meta) is None


def avx2_prompt_backend(**kwargs) -> CpuAttention:
    """The AVX2 path with the backend's own routing: prompt steps in 16-row tasks, whose tasks
    of 16 query vectors or more (rows x group) take the online-softmax prompt path
    (prefill_attention_avx2.cpp), the rest (decodes, a prompt's last few rows with group 1)
    the two passes; skips where this build runs fp32 on another path."""
    return avx2_backend(max_kernel_query_len=cpu.MAX_KERNEL_QUERY_LEN, **kwargs)


# The prompt path's tiles (1, 2 and 3 slices of 8 query vectors, padded lanes for groups 3 and
# 9 x 1), head dims 32 to 256.
AVX2_PROMPT_LAYOUTS = [
    (4, 4, 64),
    (9, 3, 64),
    (8, 2, 64),
    (8, 1, 64),
    (6, 2, 128),
    (4, 2, 32),
    (2, 1, 256),
]
AVX2_PROMPT_IDS = ["g1-d64", "g3-d64", "g4-d64", "g8-d64", "g3-d128", "g2-d32", "g2-d256"]
# Both sides of its 64-key blocks (a row's first block, the diagonal block, a short last
# block), whole prompts, chunks after cached prefixes ending mid-block, decodes beside them.
AVX2_PROMPT_SHAPES = [
    (63, 63),
    (64, 64),
    (65, 65),
    (129, 129),
    (40, 104),
    (70, 200),
    (17, 81),
    (1, 77),
]


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), AVX2_PROMPT_LAYOUTS, ids=AVX2_PROMPT_IDS
)
def test_avx2_prompt_path_across_key_blocks(
    block_size, num_heads, num_kv_heads, head_dim, monkeypatch
):
    step = make_step(
        AVX2_PROMPT_SHAPES,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=70 + block_size + head_dim,
    )
    check_on_kernel(avx2_prompt_backend(), step, monkeypatch)


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_avx2_prompt_path_past_the_old_context_limit(block_size, monkeypatch):
    # SmolLM2's heads over contexts past 1024 tokens (where SDPA took them before): whole
    # prompts, long and short chunks after a cached prefix, a decode.
    shapes = [(1100, 1100), (300, 1500), (64, 2100), (17, 1040), (1, 1200)]
    step = make_step(shapes, block_size=block_size, num_heads=9, num_kv_heads=3, seed=80)
    check_on_kernel(avx2_prompt_backend(), step, monkeypatch)


@needs_kernels
@pytest.mark.parametrize("rows_per_task", [1, 5, 16, 37, 64])
def test_avx2_prompt_path_row_tasks(rows_per_task, monkeypatch):
    # Tasks of few and many rows (up to 64 rows x 4 = 256 query vectors: many tiles), ranges
    # ending mid-block; one row (4 query vectors) stays on the two passes.
    shapes = [(300, 1100), (130, 130), (1, 50)]
    step = make_step(shapes, block_size=16, seed=rows_per_task)
    check_on_kernel(avx2_prompt_backend(rows_per_task=rows_per_task), step, monkeypatch)


@needs_kernels
@pytest.mark.parametrize("block_size", [7, 16])
@pytest.mark.parametrize("kind", WINDOW_KINDS, ids=WINDOW_IDS)
def test_avx2_prompt_path_windows_and_softcap(block_size, kind, monkeypatch):
    # Windows narrower and wider than a 64-key block over prompts and chunks long enough
    # that rows leave blocks behind them, and a prompt past the old context limit.
    shapes = [(200, 200), (150, 400), (20, 90), (1, 300), (1100, 1100)]
    step = make_step(shapes, block_size=block_size, num_heads=9, num_kv_heads=3, seed=90)
    check_on_kernel(avx2_prompt_backend(), step, monkeypatch, kind)


@needs_kernels
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (8, 2, 128), (4, 2, 32)],
    ids=["g3-d64", "g4-d128", "g2-d32"],
)
def test_avx2_prompt_path_bf16_cache(num_heads, num_kv_heads, head_dim, monkeypatch):
    # bf16 storage, widened to fp32 a block at a time.
    shapes = [*AVX2_PROMPT_SHAPES, (100, 1100)]
    step = make_step(
        shapes,
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seed=head_dim,
    )
    # bf16 queries take the kernel here with every query routed to it (16-row tasks: the
    # prompt path).
    backend = avx2_backend(rows_per_task=16)
    check_on_kernel(backend, step, monkeypatch)
    check_on_kernel(backend, step, monkeypatch, AttentionKind(sliding_window=50, softcap=4.0))


@needs_kernels
def test_avx2_prompt_path_ignores_unwritten_cache_rows(monkeypatch):
    # Cache rows past each context (the rest of its last block, the table's padding columns)
    # hold NaN: the prompt path must never multiply them in, not even by a zero weight.
    query, key, value, k_cache, v_cache, meta, scale = make_step(
        [(33, 33), (50, 71), (70, 135), (3, 9)], block_size=16, num_heads=9, num_kv_heads=3, seed=4
    )
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    gen = torch.Generator().manual_seed(4)
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        for p in range(s_len - q_len):  # the cached prefixes hold real values
            block = int(meta.block_tables[i, p // 16])
            k_cache[block, p % 16] = torch.randn(k_cache.shape[2:], generator=gen)
            v_cache[block, p % 16] = torch.randn(v_cache.shape[2:], generator=gen)
    step = (query, key, value, k_cache, v_cache, meta, scale)
    check_on_kernel(avx2_prompt_backend(), step, monkeypatch)
