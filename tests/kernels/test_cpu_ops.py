"""The C++ greedy argmax against torch.argmax, and the kernel build/fallback plumbing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from pagedllm.attention import cpu
from pagedllm.attention.base import write_kv
from pagedllm.kernels import build, ops, probe
from pagedllm.kernels.build import build_extension
from pagedllm.kernels.ops import argmax_rows

needs_library = pytest.mark.usefixtures("kernel_ops")


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 1000, 32000])
def test_argmax_matches_torch(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=gen).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(-1))


@needs_library
def test_argmax_ties_take_the_first_index():
    x = torch.zeros(3, 100)
    x[0, [7, 40, 99]] = 5.0  # several lanes hold the maximum
    x[1, [33, 17]] = 2.0
    x[2, 80:] = 1.0  # tail after the vector loop
    assert argmax_rows(x).tolist() == [7, 17, 80] == x.argmax(-1).tolist()
    # The same lane of AVX2's two running sets (8 apart), the later one first in the lanes.
    y = torch.zeros(2, 64)
    y[0, [9, 1]] = 3.0
    y[1, [56, 25]] = 3.0
    assert argmax_rows(y).tolist() == [1, 25] == y.argmax(-1).tolist()


@needs_library
def test_argmax_strided_rows_and_nan():
    x = torch.randn(4, 64)[:, :50]
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    y = torch.randn(2, 40)
    y[1, 21] = float("nan")
    assert argmax_rows(y).tolist() == y.argmax(-1).tolist()


def test_argmax_fallback_without_library(monkeypatch):
    monkeypatch.setattr(ops, "load_library", lambda: False)
    x = torch.randn(5, 33)
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_build_failure_raises_and_loader_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(OSError):
        build_extension(tmp_path)
    assert not list(tmp_path.glob("*.so"))


SAPPHIRE_RAPIDS = frozenset(probe.KERNEL_FLAGS) | {"sse4_2", "avx512dq", "avx512vl"}
AVX2 = {"sse4_2", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx_vnni"}


@pytest.mark.parametrize(
    ("cap", "left"),
    [
        ("avx2", AVX2),
        ("avx512", AVX512),
        ("avx512_bf16", AVX512 | {"avx512_bf16"}),
        ("amx", SAPPHIRE_RAPIDS),
    ],
)
def test_max_isa_caps_the_flags_the_kernels_see(monkeypatch, cap, left):
    monkeypatch.setenv("PAGEDLLM_MAX_ISA", cap)
    flags = probe.capped_flags(SAPPHIRE_RAPIDS)
    assert flags == left
    cpu = probe.CpuInfo("Xeon", flags, 2, cap=probe.max_isa())
    assert cpu.isa == cap
    assert cpu.label == f"Xeon ({cap}, PAGEDLLM_MAX_ISA={cap})"


def test_an_unknown_max_isa_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MAX_ISA", "avx512vnni")
    with pytest.raises(ValueError, match="PAGEDLLM_MAX_ISA='avx512vnni': use one of avx2"):
        probe.cpu_info()
    monkeypatch.setenv("PAGEDLLM_MAX_ISA", "")
    assert probe.max_isa() is None and probe.cap_switches() == []


AMX_MACROS = ["__AMX_TILE__", "__AMX_INT8__", "__AMX_BF16__"]


@pytest.mark.parametrize(
    ("cap", "gone"),
    [
        ("avx2", ["__AVX512F__", "__AVX512VNNI__", "__AVX512BF16__", "__AVXVNNI__", *AMX_MACROS]),
        ("avx512", ["__AVX512BF16__", *AMX_MACROS]),
        ("avx512_bf16", AMX_MACROS),
    ],
)
def test_a_capped_build_leaves_out_the_instructions_above_the_cap(monkeypatch, cap, gone):
    """On a compiler targeting a CPU with everything: the kernels' sources choose their
    routes by these macros. Every switch counts: GCC 12's -mno-amx-tile alone leaves
    __AMX_INT8__ and __AMX_BF16__ defined."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no compiler {compiler!r}")
    monkeypatch.setenv("PAGEDLLM_MAX_ISA", cap)
    command = [compiler, "-march=sapphirerapids", *probe.cap_switches(), "-dM", "-E", "-x", "c++"]
    macros = subprocess.run(
        [*command, os.devnull], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    defined = {line.split()[1] for line in macros if line.startswith("#define")}
    assert "__AVX2__" in defined and "__FMA__" in defined
    assert defined.isdisjoint(gone), sorted(defined & set(gone))
    if cap != "avx2":
        assert {"__AVX512F__", "__AVX512VNNI__"} <= defined


def test_every_source_and_header_is_in_the_build_and_its_hash():
    # A header left out of HEADERS is not in the build's hash: edits to it would load the
    # library built before them.
    assert {p.name for p in build.CSRC.glob("*.h")} == {p.name for p in build.HEADERS}
    assert {p.name for p in build.CSRC.glob("*.cpp")} == {p.name for p in build.SOURCES}


def test_old_builds_are_pruned_newest_kept(tmp_path):
    for age, name in enumerate(["e", "d", "c", "b", "a"]):  # "a" is the oldest
        path = tmp_path / f"pagedllm_cpu_{name}.so"
        path.write_bytes(b"")
        os.utime(path, (1_000_000 - age * 100, 1_000_000 - age * 100))
    (tmp_path / "unrelated.so").write_bytes(b"")
    removed = build.prune_builds(tmp_path, keep=3)
    assert sorted(p.name for p in removed) == ["pagedllm_cpu_a.so", "pagedllm_cpu_b.so"]
    left = sorted(p.name for p in tmp_path.glob("*.so"))
    assert left == ["pagedllm_cpu_c.so", "pagedllm_cpu_d.so", "pagedllm_cpu_e.so", "unrelated.so"]
    assert build.prune_builds(tmp_path, keep=3) == []


@needs_library
def test_a_reused_build_counts_as_new_when_pruning(tmp_path):
    """Another checkout's newer builds do not evict a build this one keeps loading."""
    target = tmp_path / build_extension().name  # this source's build, as the cache names it
    target.write_bytes(b"")
    os.utime(target, (1_000, 1_000))
    for i in range(build.KEPT_BUILDS):
        newer = tmp_path / f"pagedllm_cpu_other{i}.so"
        newer.write_bytes(b"")
        os.utime(newer, (2_000 + i, 2_000 + i))
    assert build_extension(tmp_path) == target  # reused, and touched
    removed = build.prune_builds(tmp_path, keep=build.KEPT_BUILDS)
    assert target.exists() and removed == [tmp_path / "pagedllm_cpu_other0.so"]


def test_loading_a_built_library_imports_no_compiler_machinery():
    """torch's cpp_extension (and setuptools under it) cost every process ~150 ms and 4 MiB;
    a library already built is loaded without them."""
    build_extension()  # built here first, so the child only loads it
    child = (
        "import sys; from pagedllm.kernels.build import load_library; "
        "assert load_library(); "
        "print([m for m in ('torch.utils.cpp_extension', 'setuptools') if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_disabled_extension_uses_torch_path(monkeypatch):
    monkeypatch.setattr(cpu, "load_extension", lambda: None)
    backend = cpu.CpuAttention()
    assert not backend.uses_extension
    with pytest.raises(RuntimeError, match="could not be built"):
        cpu.CpuAttention(use_extension=True)


# ---------------------------------------------------------------- fused layer ops
# Reference expressions: exactly what model/llama.py computes without the fused ops.


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# fp32: tiny differences from a different summation order; bf16: one rounding step apart at
# most, and only where an fp32 intermediate lands on a rounding boundary.
OP_TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=0, rtol=0)}
DTYPE_IDS = ["fp32", "bf16"]


def close_or_one_ulp(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        # At most 1/1000 of the elements may differ, and then by one bf16 step.
        diff = (got.float() - expected.float()).abs()
        ulp = expected.float().abs().clamp_min(1e-30) * 2**-7
        assert bool((diff <= ulp * 1.01).all()), float((diff / ulp).max())
        assert (diff > 0).float().mean().item() <= 1e-3
    else:
        torch.testing.assert_close(got, expected, **OP_TOLERANCE[got.dtype])


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 100, 512])
def test_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=gen) * 3).to(dtype)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    close_or_one_ulp(ops.layer_ops().rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6))


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
def test_add_rms_norm_updates_the_residual(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 96, generator=gen).to(dtype)
    residual = torch.randn(9, 96, generator=gen).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    expected_residual = x + residual
    expected = torch_rms_norm(expected_residual, w, 1e-5)
    got = ops.layer_ops().add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, expected_residual)
    close_or_one_ulp(got, expected)


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_in_place_on_fused_qkv_views(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 11, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected_q, expected_k = torch_rope(q, cos, sin), torch_rope(k, cos, sin)
    ops.layer_ops().rope_(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(13, 2 * inter, generator=gen) * 4).to(dtype)
    gate, up = x.split(inter, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = ops.layer_ops().silu_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    else:
        close_or_one_ulp(got, expected)


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
def test_silu_mul_extreme_gates(dtype):
    gate = torch.tensor([[-200.0, -90.0, -88.0, -20.0, 0.0, 20.0, 88.0, 200.0] * 3])
    x = torch.cat((gate, torch.full_like(gate, 3.0)), dim=-1).to(dtype)
    expected = torch.nn.functional.silu(x[:, :24]) * x[:, 24:]
    got = ops.layer_ops().silu_mul(x)
    assert not got.isnan().any()
    torch.testing.assert_close(
        got, expected, atol=1e-30, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5
    )


def float64_gelu_mul(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form in float64 as x sigmoid(2u) (= 0.5 x (1 + tanh(u))): 1 + tanh(u)
    itself cancels to 0 in float64 too, for gates below about -6."""
    gate, up = x.double().chunk(2, dim=-1)
    u = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    return gate * torch.sigmoid(2 * u) * up


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
@pytest.mark.parametrize("inter", [2048, 40, 7])
def test_gelu_tanh_mul_is_gemma_gating(dtype, inter):
    # Against the function itself in float64: ATen's float32 form, 0.5 x (1 + tanh(u)),
    # loses ~1e-3 of its value where tanh(u) nears -1; the op's x / (1 + e^-2u) does not.
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(13, 2 * inter, generator=gen) * 4).to(dtype)
    got = ops.layer_ops().gelu_tanh_mul(x)
    exact = float64_gelu_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-30, rtol=1e-5)
    else:
        # The exact GELU rounded to bf16, then the product rounded: the op's float32 GELU
        # (~1e-7 off) rounds the other way now and then, one bf16 step.
        gate, up = x.chunk(2, dim=-1)
        gelu = float64_gelu_mul(torch.cat((gate, torch.ones_like(up)), dim=-1)).to(dtype)
        expected = (gelu.float() * up.float()).to(dtype).float()
        diff = (got.float() - expected).abs()
        # (and gates below about -10: the exact ~1e-38, the op's e^-2u past float32, so 0)
        assert bool((diff <= (expected.abs() * 2**-7 * 1.01).clamp_min(1e-30)).all())
        assert (diff > 0).float().mean().item() <= 1e-2


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS)
def test_gelu_tanh_mul_extreme_gates(dtype):
    # -3.5 and -5: GELU ~6e-4 and ~5e-7, where ATen's float32 form is off by ~1e-4 and ~1e-1
    # of its value.
    gate = torch.tensor(
        [[-200.0, -90.0, -20.0, -5.0, -3.5, -0.0, 0.0, 1e-30, 5.0, 20.0, 200.0] * 3]
    )
    x = torch.cat((gate, torch.full_like(gate, 3.0)), dim=-1).to(dtype)
    got = ops.layer_ops().gelu_tanh_mul(x)
    if dtype == torch.float32:
        aten = torch.nn.functional.gelu(gate, approximate="tanh") * 3.0
        assert not torch.allclose(aten.double(), float64_gelu_mul(x), atol=1e-30, rtol=1e-5)
    assert got.isfinite().all()
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), float64_gelu_mul(x), atol=1e-30, rtol=rtol)


@needs_library
@pytest.mark.parametrize("op", ["gelu_tanh_mul", "silu_mul"])
def test_rows_split_across_threads_are_the_rows_alone(op):
    # 64 rows of 2 x 2,048: past parallel_rows' fork threshold, so two threads take chunks;
    # every row must come out as it does when it is the whole call.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 4096, generator=gen) * 3
    fn = getattr(ops.layer_ops(), op)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = fn(x)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, torch.cat([fn(x[r : r + 1]) for r in range(64)]))


@needs_library
def test_a_step_team_runs_every_index_of_every_job_once():
    # 200,000 jobs of 1-64 indices on two threads: the poster often ends a job alone, and a
    # helper arriving late must not claim indices of the next job under the last one's epoch.
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.pagedllm.team_selftest(200_000, 64) == 0
    finally:
        torch.set_num_threads(saved)


def _kv_step(dtype, tokens, seed=0):
    """Caches with random contents, a fused qkv output's K/V views, distinct random slots."""
    gen = torch.Generator().manual_seed(seed)
    shape = (12, 16, 2, 64)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    qkv = torch.randn(tokens, 8 * 64 + 2 * 2 * 64, generator=gen).to(dtype)
    _, key, value = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1)
    slots = torch.randperm(12 * 16, generator=gen)[:tokens]
    return k_cache, v_cache, key.view(tokens, 2, 64), value.view(tokens, 2, 64), slots


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [0, 1, 64, 192])
def test_write_kv_matches_the_reference(dtype, tokens):
    k_cache, v_cache, key, value, slots = _kv_step(dtype, tokens, seed=tokens)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_ref, v_ref, slots)
    torch.ops.pagedllm.write_kv_(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@needs_library
def test_write_kv_rejects_bad_slots_and_layouts():
    k_cache, v_cache, key, value, slots = _kv_step(torch.float32, 4)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.pagedllm.write_kv_(k_cache, v_cache, key, value, torch.tensor([0, 1, 2, 12 * 16]))
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.pagedllm.write_kv_(k_cache, v_cache, key.bfloat16(), value.bfloat16(), slots)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.pagedllm.write_kv_(k_cache, v_cache, key, value, slots.int())
    assert torch.equal(k_cache, before)  # nothing written by a rejected call


@needs_library
def test_backend_refuses_bad_slots_without_writing():
    k_cache, v_cache, key, value, _ = _kv_step(torch.bfloat16, 4)
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.CpuAttention()._write_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 12 * 16]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@needs_library
def test_backend_writes_through_the_reference_when_the_fast_copy_does_not_apply():
    k_cache, v_cache, key, value, slots = _kv_step(torch.bfloat16, 8)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_ref, v_ref, slots)
    backend = cpu.CpuAttention()
    heads_apart = key.transpose(1, 2).contiguous().transpose(1, 2)  # head stride 1, dim stride 2
    for k, v in ((key.float(), value.float()), (heads_apart, value)):  # fp32 into bf16; layout
        k_out, v_out = k_cache.clone(), v_cache.clone()
        backend._write_kv(k, v, k_out, v_out, slots)
        assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
