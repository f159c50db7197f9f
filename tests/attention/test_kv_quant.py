"""Quantized paged K/V: codecs, the cache's bytes, the read semantics, and block moves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.base import AttentionMetadata
from pagedllm.attention.quant import BlockCodec, int4_v_group, write_step
from pagedllm.attention.reference import ReferenceAttention
from pagedllm.core.outputs import ScheduledSequence
from pagedllm.kv_dtypes import QUANTIZED_KV_DTYPES, kv_bytes_per_block
from pagedllm.worker.input_batch import build_input_batch
from pagedllm.worker.kv_cache import KVCacheSpec
from pagedllm.worker.kv_quant import QuantizedKVCache, make_kv_cache

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def spec(
    quantization: str, dtype: torch.dtype = torch.float32, first_block: bool = False
) -> KVCacheSpec:
    return KVCacheSpec(
        2, KV_HEADS, DIM, BLOCK, dtype, quantization=quantization,
        unquantized_first_block=first_block,
    )  # fmt: skip


def test_int8_round_trip_error_is_at_most_half_a_step() -> None:
    x = torch.randn(3, BLOCK, KV_HEADS, DIM) * torch.tensor([0.01, 1.0, 30.0])[:, None, None, None]
    codec = BlockCodec("int8")
    data, scale, minimum = codec.encode(x)
    assert data.dtype == torch.int8 and scale.dtype == torch.float16 and minimum is None
    assert scale.shape == (3, BLOCK, KV_HEADS)
    error = (codec.decode(data, scale, None, torch.float32) - x).abs()
    assert (error <= scale.float().unsqueeze(-1) / 2 * 1.001 + 1e-7).all()


@pytest.mark.parametrize("kind", ["int4_channel", "int4_token"])
@pytest.mark.parametrize("dim", [8, 64])
def test_int4_packs_two_a_byte_and_errs_at_most_half_a_step(kind: str, dim: int) -> None:
    x = torch.randn(2, BLOCK, KV_HEADS, dim)
    codec = BlockCodec(kind)
    data, scale, minimum = codec.encode(x)
    assert data.shape == (2, BLOCK, KV_HEADS, dim // 2) and data.dtype == torch.uint8
    groups = dim // int4_v_group(dim)
    expected = (2, KV_HEADS, dim) if kind == "int4_channel" else (2, BLOCK, KV_HEADS, groups)
    assert scale.shape == minimum.shape == expected
    assert (dim, groups) in ((8, 1), (64, 2))
    decoded = codec.decode(data, scale, minimum, torch.float32)
    if kind == "int4_channel":
        step, low = scale.float().unsqueeze(1), minimum.float().unsqueeze(1)
    else:  # per token and group of channels: broadcast each group's figures over it
        step = scale.float().repeat_interleave(dim // groups, dim=-1)
        low = minimum.float().repeat_interleave(dim // groups, dim=-1)
    # Half a step, plus the minimum's fp16 rounding.
    assert ((decoded - x).abs() <= step / 2 + low.abs() * 1e-3 + 1e-6).all()


def test_int4_low_nibble_is_the_even_channel() -> None:
    x = torch.zeros(1, BLOCK, 1, 2)
    x[..., 1] = 1.0  # token-wise: minimum 0, scale 1/15: channel 0 -> 0, channel 1 -> 15
    data, _, _ = BlockCodec("int4_token").encode(x)
    assert data.flatten().tolist() == [0xF0] * BLOCK


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_is_a_saturating_cast(kind: str) -> None:
    x = torch.tensor([0.1, -3.3, 1e6, -1e6]).view(1, 1, 1, 4)
    codec = BlockCodec(kind)
    data, scale, _ = codec.encode(x)
    assert scale is None
    decoded = codec.decode(data, None, None, torch.float32)
    fp8 = torch.float8_e4m3fn if kind == "fp8_e4m3" else torch.float8_e5m2
    limit = torch.finfo(fp8).max
    assert decoded.flatten().tolist() == x.clamp(-limit, limit).to(fp8).float().flatten().tolist()


def test_zero_blocks_stay_zero() -> None:
    for kind in ("int8", "int4_channel", "int4_token"):
        codec = BlockCodec(kind)
        decoded = codec.decode(*codec.encode(torch.zeros(1, BLOCK, 1, DIM)), torch.float32)
        assert torch.equal(decoded, torch.zeros(1, BLOCK, 1, DIM))


@pytest.mark.parametrize("quantization", QUANTIZED_KV_DTYPES)
def test_allocated_bytes_are_the_table_s_bytes(quantization: str) -> None:
    cache = QuantizedKVCache(spec(quantization), num_blocks=5)
    allocated = sum(
        part.numel() * part.element_size()
        for layer in cache.device_caches
        for side in layer
        for part in side.parts()
    )
    expected = kv_bytes_per_block(
        quantization, num_layers=2, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK
    )
    assert allocated == 5 * expected == 5 * cache.spec.bytes_per_block


def test_smollm_bytes_per_token() -> None:
    geometry = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    per_token = {name: kv_bytes_per_block(name, **geometry) / 16 for name in QUANTIZED_KV_DTYPES}
    assert per_token == {"int8": 11_880, "int4": 7_920, "fp8_e4m3": 11_520, "fp8_e5m2": 11_520}
    bf16 = kv_bytes_per_block("bfloat16", **geometry) / 16
    assert bf16 == 23_040
    assert bf16 / per_token["int8"] >= 1.9 and bf16 / per_token["int4"] >= 2.8


def _step(cache, scheduled, key, value, query):
    """One step through the reference backend on layer 0: [T, HEADS, DIM] out."""
    batch = build_input_batch(scheduled, BLOCK)
    batch.meta.quant = cache.plan_step(batch.meta)
    k_cache, v_cache = cache.device_caches[0]
    out = ReferenceAttention().forward(query, key, value, k_cache, v_cache, batch.meta, 0.5)
    cache.finish_step()
    return out, batch.meta


def _expected(
    query, keys, values, first: int, codec_k, codec_v, first_block: bool = False
) -> torch.Tensor:
    """Row by row: query at position p sees blocks before its own through the codec and its
    own block's rows up to p exactly (with ``first_block``, block 0 exactly too)."""
    rows = []
    for j in range(query.shape[0]):
        p = first + j
        own = p // BLOCK * BLOCK
        exact = min(own, BLOCK) if first_block else 0
        sealed_k = keys[exact:own].view(-1, BLOCK, KV_HEADS, DIM)
        sealed_v = values[exact:own].view(-1, BLOCK, KV_HEADS, DIM)
        k = torch.cat(
            (
                keys[:exact],
                codec_k.decode(*codec_k.encode(sealed_k), torch.float32).flatten(0, 1),
                keys[own : p + 1],
            )
        )
        v = torch.cat(
            (
                values[:exact],
                codec_v.decode(*codec_v.encode(sealed_v), torch.float32).flatten(0, 1),
                values[own : p + 1],
            )
        )
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        q = query[j].unsqueeze(1)  # [H, 1, D]
        rows.append(F.scaled_dot_product_attention(q, k, v, scale=0.5)[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8_e5m2"])
@pytest.mark.parametrize("chunks", [(11,), (3, 5, 1, 1, 1), (4, 7)])
@pytest.mark.parametrize("first_block", [False, True])
def test_each_query_reads_sealed_blocks_before_its_own_and_its_own_exactly(
    quantization: str, chunks: tuple[int, ...], first_block: bool
) -> None:
    torch.manual_seed(0)
    total = sum(chunks)
    keys, values = torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    queries = torch.randn(total, HEADS, DIM)
    cache = QuantizedKVCache(spec(quantization, first_block=first_block), num_blocks=8)
    table = (5, 2, 7)
    start = 0
    for n in chunks:
        seq = ScheduledSequence("a", tuple(range(n)), start, table)
        rows = slice(start, start + n)
        out, _ = _step(cache, [seq], keys[rows], values[rows], queries[rows])
        expected = _expected(queries[rows], keys, values, start, *cache.codecs, first_block)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        start += n
        cache.check_invariants()
    # Two full blocks sealed (or only block 1, block 0 kept), the third open.
    assert cache.num_open_blocks == (2 if first_block else 1)
    if first_block:
        assert torch.equal(cache.device_caches[0][0].stage[cache._slot_of[5]], keys[:BLOCK])


def test_copies_and_swaps_move_scales_and_staged_rows() -> None:
    torch.manual_seed(1)
    cache = QuantizedKVCache(spec("int4"), num_blocks=8, num_host_blocks=4)
    keys, values = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM)
    queries = torch.randn(6, HEADS, DIM)
    seq = ScheduledSequence("a", tuple(range(6)), 0, (1, 3))  # block 1 sealed, 3 open (2 rows)
    reference, _ = _step(cache, [seq], keys, values, queries)
    # Copy-on-write of the open block, then read it through the copy: same output.
    cache.copy_blocks([(3, 6)])
    cache.swap_out([(1, 0), (6, 2)])
    cache.release_blocks([1, 3, 6])
    assert cache.num_open_blocks == 0
    cache.swap_in([(0, 4), (2, 5)])
    assert cache.num_open_blocks == 1
    k_pool = cache.device_caches[1][0]
    assert torch.equal(k_pool.data[4], cache.device_caches[1][0].data[1])
    assert torch.equal(k_pool.scale[4], k_pool.scale[1])
    assert torch.equal(k_pool.minimum[4], k_pool.minimum[1])
    # The last query again (position 5), now through blocks (4, 5).
    again = ScheduledSequence("a", (5,), 5, (4, 5))
    out, _ = _step(cache, [again], keys[5:], values[5:], queries[5:])
    assert torch.equal(out, reference[5:])
    cache.check_invariants()


def test_a_released_block_written_afresh_gets_no_stale_rows() -> None:
    cache = QuantizedKVCache(spec("int8"), num_blocks=4)
    keys = torch.randn(3, KV_HEADS, DIM)
    q = torch.randn(3, HEADS, DIM)
    _step(cache, [ScheduledSequence("a", (1, 2, 3), 0, (2,))], keys, keys, q)
    assert cache.num_open_blocks == 1
    # Block 2 is reused by another sequence from its first slot (release not yet seen).
    out, _ = _step(cache, [ScheduledSequence("b", (9,), 0, (2,))], keys[:1] * 2, keys[:1], q[:1])
    assert cache.num_open_blocks == 1
    cache.check_invariants()


def test_resuming_a_block_without_its_rows_fails_loudly() -> None:
    cache = QuantizedKVCache(spec("int8"), num_blocks=4)
    x = torch.randn(1, KV_HEADS, DIM)
    with pytest.raises(RuntimeError, match="no staged rows"):
        _step(cache, [ScheduledSequence("a", (1,), 2, (3,))], x, x, torch.randn(1, HEADS, DIM))


def test_staging_grows_and_keeps_its_rows() -> None:
    cache = QuantizedKVCache(spec("int8"), num_blocks=64)
    start = cache.num_staging_slots
    seqs = [ScheduledSequence(str(i), (1,), 0, (i,)) for i in range(start + 3)]
    n = len(seqs)
    keys = torch.randn(n, KV_HEADS, DIM)
    _step(cache, seqs, keys, keys, torch.randn(n, HEADS, DIM))
    assert cache.num_staging_slots == 2 * start and cache.num_open_blocks == n
    # Each open block's first row is its own key, wherever its slot is.
    k_cache = cache.device_caches[0][0]
    for i in range(n):
        assert torch.equal(k_cache.stage[cache._slot_of[i], 0], keys[i])
    cache.check_invariants()


def test_full_precision_specs_make_plain_caches() -> None:
    plain = make_kv_cache(KVCacheSpec(2, KV_HEADS, DIM, BLOCK), 4)
    assert plain.plan_step(AttentionMetadata.__new__(AttentionMetadata)) is None
    assert isinstance(make_kv_cache(spec("int8"), 4), QuantizedKVCache)


def _kernel_step_pair(
    quantization: str,
    dtype: torch.dtype,
    block: int,
    seed: int,
    first_block: bool = False,
    dim: int = 64,
    heads: tuple[int, int] = (6, 2),
):
    """Two caches filled with the same sequences (several steps: prompt chunks, then decode),
    and the last step's inputs: (caches, scheduled, query, key, value)."""
    from pagedllm.attention.cpu import CpuAttention

    torch.manual_seed(seed)
    heads, kv_heads = heads
    kv_spec = KVCacheSpec(
        1, kv_heads, dim, block, dtype, quantization=quantization,
        unquantized_first_block=first_block,
    )  # fmt: skip
    caches = [QuantizedKVCache(kv_spec, num_blocks=64) for _ in range(2)]
    tables = {"a": tuple(range(0, 40, 2)), "b": tuple(range(41, 61)), "c": (63, 1, 3, 5)}
    lengths = {"a": 70, "b": 37, "c": block * 2 + 1}
    plan = [{"a": 33, "b": 37, "c": block}, {"a": 36, "c": block + 1}, {"a": 1}]
    done = dict.fromkeys(tables, 0)
    steps = []
    for chunk in plan:
        scheduled = [
            ScheduledSequence(name, tuple(range(n)), done[name], tables[name])
            for name, n in chunk.items()
        ]
        rows = sum(chunk.values())
        q = torch.randn(rows, heads, dim).to(dtype)
        k = torch.randn(rows, kv_heads, dim).to(dtype)
        v = torch.randn(rows, kv_heads, dim).to(dtype)
        steps.append((scheduled, q, k, v))
        for name, n in chunk.items():
            done[name] += n
    assert done == lengths
    return caches, steps, CpuAttention(use_extension=True)


def _fp32_tolerance(quantization: str) -> float:
    """int8 on AVX-512 VNNI rounds queries and probabilities to int16 (2^-16 of each maximum, the
    same 2e-4 the integer-vs-plain test allows); every other path attends in fp32."""
    from pagedllm.kernels.probe import cpu_info

    vnni = {"avx512bw", "avx512_vnni"} <= cpu_info().flags
    return 2e-4 if quantization == "int8" and vnni else 1e-4


def _check_kernel_against_reference(
    quantization: str,
    dtype: torch.dtype,
    block: int,
    dim: int = 64,
    first_block: bool = False,
    heads: tuple[int, int] = (6, 2),
) -> None:
    from pagedllm.kernels.build import load_library

    if not load_library():
        pytest.skip("the C++ kernels could not be built")
    caches, steps, kernel = _kernel_step_pair(
        quantization, dtype, block, seed=3, first_block=first_block, dim=dim, heads=heads
    )
    tolerance = _fp32_tolerance(quantization) if dtype == torch.float32 else 2e-2
    for scheduled, q, k, v in steps:
        outs = []
        for cache, backend in zip(caches, (ReferenceAttention(), kernel), strict=True):
            batch = build_input_batch(scheduled, block)
            batch.meta.quant = cache.plan_step(batch.meta)
            k_cache, v_cache = cache.device_caches[0]
            outs.append(backend.forward(q, k, v, k_cache, v_cache, batch.meta, 0.125))
            cache.finish_step()
        torch.testing.assert_close(outs[1], outs[0], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [16, 4])
@pytest.mark.parametrize("first_block", [False, True])
def test_the_fused_kernel_matches_dequantize_then_attend(
    quantization: str, dtype: torch.dtype, block: int, first_block: bool
) -> None:
    """The C++ kernel against the reference path, step by step, over prompt chunks that
    start mid-block, prefix reads and decode (a decode step's 3 query vectors a kv head
    read sealed blocks in place; a prompt chunk's widen them once; block 0 sealed, or read
    from staging)."""
    _check_kernel_against_reference(quantization, dtype, block, first_block=first_block)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dim", [8, 12, 32, 40, 128])
@pytest.mark.parametrize("block", [16, 5])
def test_the_fused_kernel_matches_for_other_head_dims_and_blocks(
    quantization: str, dim: int, block: int
) -> None:
    """Head dims the vector paths tile differently (8 channels a vector; int4 V in groups of
    32, or of the whole head for 8, 12 and 40; 12 is no multiple of 8 and takes the plain
    loops) and a block size that is no multiple of the 4-key tile."""
    _check_kernel_against_reference(quantization, torch.float32, block, dim)


@pytest.mark.parametrize("heads", [(4, 4), (10, 5)])
@pytest.mark.parametrize("block", [16, 5])
def test_int8_scales_are_read_for_any_number_of_kv_heads(
    heads: tuple[int, int], block: int
) -> None:
    """The int8 path reads a block's scales of up to 4 kv heads with two vector loads (the
    rows' scales 4 apart at most), more heads one by one: both against the reference."""
    _check_kernel_against_reference("int8", torch.float32, block, heads=heads)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8_e4m3"])
def test_a_row_gets_the_same_bits_in_any_batch_and_thread_count(quantization: str) -> None:
    """Decode rows of the fused kernel: alone or batched with other sequences, on one thread
    or two, each row's output is the same, bit for bit."""
    from pagedllm.kernels.build import load_library

    if not load_library():
        pytest.skip("the C++ kernels could not be built")
    caches, steps, kernel = _kernel_step_pair(quantization, torch.float32, 16, seed=5)
    cache = caches[0]
    for scheduled, q, k, v in steps[:-1]:  # fill the cache: prompt chunks
        batch = build_input_batch(scheduled, 16)
        batch.meta.quant = cache.plan_step(batch.meta)
        kernel.forward(q, k, v, *cache.device_caches[0], batch.meta, 0.125)
        cache.finish_step()
    # Each sequence decodes one more token (its open block staged; nothing seals), again and
    # again: the same inputs each time.
    tables = {seq.request_id: seq.block_table for seq in steps[0][0]}
    done = {"a": 69, "b": 37, "c": 33}
    q = torch.randn(3, 6, 64)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)

    def decode(names: list[str], threads: int) -> torch.Tensor:
        rows = [list(done).index(name) for name in names]
        scheduled = [ScheduledSequence(n, (1,), done[n], tables[n]) for n in names]
        batch = build_input_batch(scheduled, 16)
        batch.meta.quant = cache.plan_step(batch.meta)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = kernel.forward(
                q[rows], k[rows], v[rows], *cache.device_caches[0], batch.meta, 0.125
            )
        finally:
            torch.set_num_threads(before)
        cache.finish_step()
        return out

    together = decode(["a", "b", "c"], 2)
    for i, name in enumerate(done):
        for threads in (1, 2):
            assert torch.equal(decode([name], threads)[0], together[i])
    assert torch.equal(decode(["c", "a"], 1), together[[2, 0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first_block", [False, True])
def test_the_int8_integer_path_matches_the_plain_path(
    dtype: torch.dtype, first_block: bool
) -> None:
    """int8 K/V: the VNNI path (int16 queries and probabilities) against the kernel's own
    fp32 path over the same cache and step."""
    from pagedllm.kernels.build import load_library
    from pagedllm.kernels.probe import cpu_info

    if not load_library():
        pytest.skip("the C++ kernels could not be built")
    if not {"avx512bw", "avx512_vnni"} <= cpu_info().flags:
        pytest.skip("the int8 integer path needs AVX-512 BW and VNNI")
    caches, steps, _ = _kernel_step_pair("int8", dtype, 16, seed=4, first_block=first_block)
    cache = caches[0]
    for scheduled, q, k, v in steps:
        batch = build_input_batch(scheduled, 16)
        meta = batch.meta
        meta.quant = cache.plan_step(meta)
        k_cache, v_cache = cache.device_caches[0]
        k_window, v_window = write_step(k, v, k_cache, v_cache, meta.quant)
        outs = []
        for plain in (True, False):
            out = torch.empty_like(q)
            torch.ops.pagedllm.quant_attention(
                out, q, k_cache.data, k_cache.scale, None, 0, v_cache.data, v_cache.scale,
                None, 0, k_window, v_window, meta.block_tables.int(), meta.seq_lens.int(),
                meta.query_start_loc.int(), meta.quant.window_start, k_cache.stage,
                v_cache.stage, meta.quant.first_slots, 0.125, plain,
            )  # fmt: skip
            outs.append(out)
        cache.finish_step()
        tolerance = 2e-4 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(outs[1], outs[0], rtol=tolerance, atol=tolerance)


def test_an_unquantized_first_block_moves_with_its_rows() -> None:
    """Block 0 kept in full precision: copy, swap out and in, the disk tier's rows and a
    resize all carry its staged rows under its block id; reads through the moved blocks give
    the same bits."""
    torch.manual_seed(2)
    cache = QuantizedKVCache(spec("int4", first_block=True), num_blocks=8, num_host_blocks=4)
    keys, values = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM)
    queries = torch.randn(6, HEADS, DIM)
    seq = ScheduledSequence("a", tuple(range(6)), 0, (1, 3))  # block 1 full but kept, 3 open
    reference, _ = _step(cache, [seq], keys, values, queries)
    assert sorted(cache._slot_of) == [1, 3]
    cache.copy_blocks([(1, 6)])
    cache.swap_out([(6, 0), (3, 2)])
    cache.release_blocks([1, 3, 6])
    assert cache.num_open_blocks == 0
    cache.swap_in([(0, 4), (2, 5)])
    assert sorted(cache._slot_of) == [4, 5]
    again = ScheduledSequence("a", (5,), 5, (4, 5))
    out, _ = _step(cache, [again], keys[5:], values[5:], queries[5:])
    assert torch.equal(out, reference[5:])
    # The disk tier's row of a first block is its staged rows; written back, it is staged.
    rows = cache.read_blocks([4])
    assert [len(row) for row in rows] == [cache.first_block_nbytes]
    cache.write_blocks([7], rows)
    assert sorted(cache._slot_of) == [4, 5, 7]
    out, _ = _step(
        cache, [ScheduledSequence("a", (5,), 5, (7, 5))], keys[5:], values[5:], queries[5:]
    )
    assert torch.equal(out, reference[5:])
    cache.resize(6)  # block 7 goes, and its slot with it
    assert sorted(cache._slot_of) == [4, 5]
    cache.check_invariants()


def test_first_blocks_are_kept_only_at_logical_block_zero() -> None:
    cache = QuantizedKVCache(spec("int8", first_block=True), num_blocks=8)
    keys = torch.randn(9, KV_HEADS, DIM)
    q = torch.randn(9, HEADS, DIM)
    _, meta = _step(cache, [ScheduledSequence("a", tuple(range(9)), 0, (6, 2, 4))], keys, keys, q)
    assert sorted(cache._slot_of) == [4, 6]  # block 2 (logical 1) sealed, 4 open
    assert meta.quant.first_slots_list == [cache._slot_of[6]]
    plain = QuantizedKVCache(spec("int8"), num_blocks=8)
    _, meta = _step(plain, [ScheduledSequence("a", tuple(range(9)), 0, (6, 2, 4))], keys, keys, q)
    assert list(plain._slot_of) == [4] and meta.quant.first_slots.numel() == 0


def test_a_copy_that_grows_the_staging_keeps_its_rows() -> None:
    """Every slot held, then a copy-on-write: the copy takes a slot of the grown stage and
    its rows land there (not in the stage it replaced)."""
    cache = QuantizedKVCache(spec("int8"), num_blocks=64)
    start = cache.num_staging_slots
    seqs = [ScheduledSequence(str(i), (1,), 0, (i,)) for i in range(start)]
    keys = torch.randn(start, KV_HEADS, DIM)
    _step(cache, seqs, keys, keys, torch.randn(start, HEADS, DIM))
    assert cache.num_staging_slots == start
    cache.copy_blocks([(3, 40)])
    assert cache.num_staging_slots == 2 * start
    k_stage = cache.device_caches[0][0].stage
    assert torch.equal(k_stage[cache._slot_of[40], 0], keys[3])
    cache.check_invariants()
