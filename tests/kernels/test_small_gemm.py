"""The small-batch linear kernel (csrc/small_gemm*.cpp) against torch: bf16 on each route this
CPU has (the AMX tile unit, AVX-512-bf16 dot products), float32 on each of its routes (AVX-512,
AVX2 with FMA), which give the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.linear import (
    SMALL_GEMM_MAX_ROWS,
    SMALL_GEMM_MAX_ROWS_BF16,
    SMALL_GEMM_MAX_ROWS_F32_AVX2,
    pack_small_weight,
    small_gemm_max_rows,
)
from pagedllm.model.llama import Linear

from .isa_caps import ROUTES, small_gemm_capped


@pytest.fixture
def ops(kernel_ops):
    """The kernels (tests/conftest.py builds them), by this file's short name."""
    return kernel_ops


@pytest.fixture(params=ROUTES[torch.bfloat16])
def bf16_route(ops, request):
    """Runs the test on one bf16 route; skips where this CPU (or the build) lacks it."""
    with small_gemm_capped(torch.bfloat16, request.param):
        yield request.param


on_bf16_routes = pytest.mark.usefixtures("bf16_route")


@pytest.fixture(params=ROUTES[torch.float32])
def f32_route(ops, request):
    """Runs the test on one float32 route; skips where this CPU (or the build) lacks it."""
    with small_gemm_capped(torch.float32, request.param):
        yield request.param


on_f32_routes = pytest.mark.usefixtures("f32_route")


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@on_bf16_routes
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (768, 512), (512, 1536), (4000, 64)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 63, 64, 65, 130])
def test_matches_linear(ops, m, n, k):
    w, x, bias = bf16(n, k, seed=n), bf16(m, k, seed=m), bf16(n, seed=k)
    packed = ops.pack_small_gemm(w)
    for b in (None, bias):
        got = ops.small_gemm(x, packed, b)
        exact = x.double() @ w.double().T + (0 if b is None else b.double())
        # fp32 sums rounded once to bf16: within one bf16 step of the exact result...
        err = (got.double() - exact).abs()
        assert bool((err <= exact.abs() * 2**-8 + 1e-3).all())
        # ...and equal to torch's bf16 linear but for rare ties in the order of the sums.
        assert (got != F.linear(x, w, b)).float().mean().item() <= 1e-3


@on_bf16_routes
def test_strided_rows_and_empty_batch(ops):
    w = bf16(64, 64, seed=1)
    packed = ops.pack_small_gemm(w)
    wide = bf16(20, 96, seed=2)
    x = wide[:, 16:80]  # row stride 96, unit column stride
    torch.testing.assert_close(ops.small_gemm(x, packed), F.linear(x.contiguous(), w))
    assert ops.small_gemm(wide[:0, :64], packed).shape == (0, 64)


@on_bf16_routes
@pytest.mark.parametrize("m", [16, 21])
def test_rows_off_cache_lines_give_the_same_bits(ops, m):
    # x starting 16 bytes into a line, rows 144 bytes apart: read through an aligned copy.
    w = bf16(96, 64, seed=3)
    packed = ops.pack_small_gemm(w)
    x = bf16(m, 72, seed=4)[:, 8:]
    assert x.data_ptr() % 64 != 0
    assert torch.equal(ops.small_gemm(x, packed), ops.small_gemm(x.contiguous(), packed))
    assert torch.equal(
        ops.small_gemm_argmax(x, packed), ops.small_gemm_argmax(x.contiguous(), packed)
    )


@on_bf16_routes
def test_bad_shapes_raise(ops):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.pack_small_gemm(bf16(24, 64, seed=0))
    packed = ops.pack_small_gemm(bf16(32, 64, seed=0))
    with pytest.raises(RuntimeError, match="columns"):
        ops.small_gemm(bf16(2, 96, seed=0), packed)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.small_gemm(torch.randn(2, 64), packed)


@on_bf16_routes
def test_linear_routes_by_row_count(ops):
    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    layer.pack(ops)
    assert layer.small is not None and layer.weight.numel() == 0  # the packed copy only
    for rows in (1, 300, SMALL_GEMM_MAX_ROWS_BF16, SMALL_GEMM_MAX_ROWS_BF16 + 1):
        x = bf16(rows, 64, seed=rows)
        with torch.inference_mode():
            got = layer(x)
        assert (got != F.linear(x, weight, layer.bias)).float().mean().item() <= 1e-3
        # Every row count on the kernel: each row has the bits of that row multiplied alone.
        assert torch.equal(got[-1:], ops.small_gemm(x[-1:], layer.small, layer.bias))


def test_route_cap_is_checked_and_restored(ops):
    best = ops.small_gemm_isa()
    saved = ops.set_small_gemm_isa("none")
    try:
        assert ops.small_gemm_isa() == "none" and not ops.small_gemm_available(True)
        with pytest.raises(RuntimeError, match="AMX tile unit or AVX-512-bf16"):
            ops.small_gemm(bf16(2, 64, seed=0), ops.pack_small_gemm(bf16(32, 64, seed=0)))
        with pytest.raises(RuntimeError, match="unknown ISA"):
            ops.set_small_gemm_isa("sse")
    finally:
        ops.set_small_gemm_isa(saved)
    assert ops.small_gemm_isa() == best


def test_not_packed_where_it_does_not_apply(ops):
    assert pack_small_weight(torch.randn(32, 64).half(), ops) is None  # float16
    assert pack_small_weight(bf16(24, 64, seed=0), ops) is None  # rows not in 16s
    assert pack_small_weight(bf16(32, 40, seed=0), ops) is None  # columns not in 32s


def test_not_packed_without_kernels():
    assert pack_small_weight(bf16(32, 64, seed=0), None) is None


@on_f32_routes
@pytest.mark.parametrize("n,k", [(16, 1), (64, 40), (48, 100), (768, 512), (960, 576), (512, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 9, 15, 16, 17, 64, 65])
def test_float32_matches_linear(ops, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    w, x, bias = (torch.randn(*s, generator=gen) for s in ((n, k), (m, k), (n,)))
    packed = ops.pack_small_gemm(w)
    assert pack_small_weight(w, ops) is not None
    # fp32 sums in another order than MKL's: rounding differences grow like sqrt(k).
    tol = {"rtol": 1e-5, "atol": 1e-5 * k**0.5}
    for b in (None, bias):
        torch.testing.assert_close(ops.small_gemm(x, packed, b), F.linear(x, w, b), **tol)
    wide = torch.randn(m, k + 8, generator=gen)[:, 3 : 3 + k]  # strided rows
    torch.testing.assert_close(ops.small_gemm(wide, packed), F.linear(wide.contiguous(), w), **tol)


def float32_problem(n: int, k: int, m: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=gen) for s in ((n, k), (m, k), (n,)))


@on_f32_routes
@pytest.mark.parametrize("n,k", [(48, 40), (576, 576), (960, 576), (576, 1536), (3072, 64)])
def test_float32_rows_do_not_depend_on_the_batch_or_threads(ops, n, k):
    # Each sum runs over K in order from zero whatever the register block and whichever
    # thread takes its chunk of column groups (3072 columns: 192 groups in many chunks):
    # row r of a batch has the bits of row r multiplied alone (what the fused decode path
    # relies on when it computes only the rows it reads).
    w, x, bias = float32_problem(n, k, 256, seed=n + k)
    packed = ops.pack_small_gemm(w)
    saved = torch.get_num_threads()
    try:
        for b in (None, bias):
            results = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                batch = ops.small_gemm(x, packed, b)
                part = ops.small_gemm(x[:37], packed, b)
                assert torch.equal(part, batch[:37])
                for r in (0, 5, 36):
                    assert torch.equal(ops.small_gemm(x[r : r + 1], packed, b)[0], part[r])
                assert torch.equal(ops.small_gemm(x[3:5], packed, b), part[3:5])
                results.append(batch)
            assert all(torch.equal(results[0], r) for r in results[1:])
    finally:
        torch.set_num_threads(saved)


def in_order_fma_sums(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T as the kernels compute it: per output, from 0.0, one fused multiply-add per k
    in increasing order (a float32 product is exact in float64, the sum rounded once to
    float32: a double rounding could differ, about once in 2**28 terms), then + bias."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for t in range(x.shape[1]):
        acc = (x[:, t, None].double() * w[None, :, t].double() + acc.double()).float()
    return acc + (0.0 if bias is None else bias)


@on_f32_routes
@pytest.mark.parametrize("n,k", [(64, 40), (48, 576)])
def test_float32_is_the_in_order_fma_sum(ops, n, k):
    # The arithmetic both ISAs share, so each gives the other's bits.
    w, x, bias = float32_problem(n, k, 7, seed=n * k)
    packed = ops.pack_small_gemm(w)
    for b in (None, bias):
        assert torch.equal(ops.small_gemm(x, packed, b), in_order_fma_sums(x, w, b))


def test_float32_routes_give_the_same_bits(ops):
    if ops.small_gemm_f32_isa() != "avx512":
        pytest.skip("needs the AVX-512 float32 route beside the AVX2 one")
    w, x, bias = float32_problem(960, 576, 37, seed=9)
    packed = ops.pack_small_gemm(w)
    best = ops.small_gemm(x, packed, bias)
    saved = ops.set_small_gemm_f32_isa("avx2")
    try:
        if ops.small_gemm_f32_isa() != "avx2":
            pytest.skip("built without the AVX2 float32 route")
        assert torch.equal(ops.small_gemm(x, packed, bias), best)
    finally:
        ops.set_small_gemm_f32_isa(saved)


def test_float32_route_cap_is_checked_and_restored(ops):
    best = ops.small_gemm_f32_isa()
    packed = ops.pack_small_gemm(torch.randn(32, 64))
    saved = ops.set_small_gemm_f32_isa("none")
    try:
        assert ops.small_gemm_f32_isa() == "none" and not ops.small_gemm_available(False)
        with pytest.raises(RuntimeError, match="AVX-512 or AVX2 with FMA"):
            ops.small_gemm(torch.randn(2, 64), packed)
        with pytest.raises(RuntimeError, match="unknown ISA"):
            ops.set_small_gemm_f32_isa("sse")
    finally:
        ops.set_small_gemm_f32_isa(saved)
    assert ops.small_gemm_f32_isa() == best


def test_float32_row_limit_follows_the_route(ops):
    # The one-call decoder loop: on AVX2 up to prompt-chunk sizes, on AVX-512 decode
    # batches only (every row count runs on the kernel either way).
    layer = Linear(64, 48, bias=True)
    layer.pack(ops)
    saved = ops.set_small_gemm_f32_isa("avx2")
    try:
        if ops.small_gemm_f32_isa() != "avx2":
            pytest.skip("this CPU has no AVX2 with FMA (small_gemm float32 runs none)")
        assert small_gemm_max_rows(layer.small) == SMALL_GEMM_MAX_ROWS_F32_AVX2
        x = torch.randn(
            SMALL_GEMM_MAX_ROWS_F32_AVX2, 64, generator=torch.Generator().manual_seed(3)
        )
        with torch.inference_mode():
            got = layer(x)
        # On the kernel each row has the bits of that row multiplied alone.
        assert torch.equal(got[700:702], ops.small_gemm(x[700:702], layer.small, layer.bias))
        ops.set_small_gemm_f32_isa("avx512")
        if ops.small_gemm_f32_isa() == "avx512":
            assert small_gemm_max_rows(layer.small) == SMALL_GEMM_MAX_ROWS
    finally:
        ops.set_small_gemm_f32_isa(saved)


@on_bf16_routes
@pytest.mark.parametrize("n,k", [(16, 32), (4000, 96), (32000, 512)])
@pytest.mark.parametrize("m", [1, 5, 17, 64])
def test_argmax_equals_argmax_of_the_logits(ops, m, n, k):
    w, x, bias = bf16(n, k, seed=n + 1), bf16(m, k, seed=m + 1), bf16(n, seed=k + 1)
    packed = ops.pack_small_gemm(w)
    for b in (None, bias):
        logits = ops.small_gemm(x, packed, b)
        assert torch.equal(ops.small_gemm_argmax(x, packed, b), logits.argmax(-1))


@on_bf16_routes
def test_argmax_ties_take_the_first_column_and_nan_wins(ops):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two column ranges to merge
    try:
        w = bf16(256, 64, seed=3)
        w[200] = w[37] = w[150]  # identical columns: equal logits at 37, 150 and 200
        x = bf16(9, 64, seed=4) * 0 + w[37]  # every row is most aligned with those columns
        packed = ops.pack_small_gemm(w)
        got = ops.small_gemm_argmax(x, packed)
        assert got.tolist() == ops.small_gemm(x, packed).argmax(-1).tolist() == [37] * 9
        w[220, 0] = w[240, 0] = float("nan")  # NaN logits win over any number (torch.argmax)
        packed = ops.pack_small_gemm(w)
        got = ops.small_gemm_argmax(x, packed)
        assert got.tolist() == ops.small_gemm(x, packed).argmax(-1).tolist() == [220] * 9
    finally:
        torch.set_num_threads(threads)


@on_bf16_routes
@pytest.mark.parametrize("n", [16, 48, 3072])
@pytest.mark.parametrize("m", [17, 32, 33, 48, 100, 256, 300])
def test_register_blocks_at_the_edges(ops, m, n):
    # Blocks of 2 row tiles x 2 column groups: odd numbers of either, and a part-filled last
    # row tile, go through the 1-tile blocks; over 256 rows, blocks of rows.
    k = 64
    w, x, bias = bf16(n, k, seed=n + 2), bf16(m, k, seed=m + 2), bf16(n, seed=k + 2)
    packed = ops.pack_small_gemm(w)
    for b in (None, bias):
        got = ops.small_gemm(x, packed, b)
        assert (got != F.linear(x, w, b)).float().mean().item() <= 1e-3
        # Rows are independent: each equals the same row multiplied alone.
        assert torch.equal(got[m - 1 :], ops.small_gemm(x[m - 1 :], packed, b))
        assert torch.equal(ops.small_gemm_argmax(x, packed, b), got.argmax(-1))


@on_bf16_routes
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_ties_across_column_group_pairs(ops, threads):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Groups of 16 columns are multiplied in pairs and 48 rows in blocks of 32 and 16:
        # equal logits in both groups of a pair (17 and 30), in the next pair (40) and in the
        # last, odd group (68), for rows of either row block.
        w = bf16(80, 64, seed=5)
        w[30] = w[40] = w[68] = w[17]
        x = bf16(48, 64, seed=6) * 0 + w[17]
        packed = ops.pack_small_gemm(w)
        logits = ops.small_gemm(x, packed)
        assert logits.argmax(-1).tolist() == ops.small_gemm_argmax(x, packed).tolist() == [17] * 48
    finally:
        torch.set_num_threads(saved)


@on_bf16_routes
@pytest.mark.parametrize("m", [1, 7, 16, 64])
def test_same_bits_with_any_thread_count(ops, m):
    # The thread governor (worker/threads.py) changes torch's thread count mid-run: every
    # sum must run in an order that does not depend on it, so greedy outputs stay the same.
    w, x = bf16(3072, 576, seed=7), bf16(m, 576, seed=8)
    packed = ops.pack_small_gemm(w)
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append((ops.small_gemm(x, packed), ops.small_gemm_argmax(x, packed)))
    finally:
        torch.set_num_threads(saved)
    for out, best in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(best, results[0][1])
