"""Gemma's one-call fast path (``gemma_layers``) against the model's own module loop, the
ground truth: the same steps through both, decode steps in one C++ call, every other step
in the loop; and where the fast path is not built. (Token parity with transformers through
the fast path: ``test_family_parity.py``.)"""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.cpu import CpuAttention
from pagedllm.kernels.ops import layer_ops
from pagedllm.model.loader import load_model
from pagedllm.testing import make_tiny_checkpoint
from pagedllm.worker.model_runner import TorchModelRunner

from .parity_helpers import relative_error
from .test_decoder_layers import run_steps

# head_dim 64 (the kernel's vector paths), windows edging inside the 16-token blocks.
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    query_pre_attn_scalar=64,
    sliding_window=9,
    num_hidden_layers=3,
)
VARIANTS = {
    "gemma2": ("gemma2", {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 30.0}),
    "gemma3": (
        "gemma3_text",
        {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    ),
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gemma-fast-path")
    return {
        name: make_tiny_checkpoint(root / name, arch, seed=5, **SHAPE, **extra)
        for name, (arch, extra) in VARIANTS.items()
    }


def make_runner(path, dtype: str, fused: bool) -> TorchModelRunner:
    loaded = load_model(path, dtype, CpuAttention())
    runner = TorchModelRunner(loaded.model, block_size=16, num_blocks=64)
    if loaded.model.fast_path is None:
        pytest.skip("no small_gemm for this dtype here, or no C++ kernels")
    if not fused:
        loaded.model.fast_path = None
    return runner


class CountingOps:
    """The C++ ops, counting the calls of ``gemma_layers``."""

    def __init__(self, ops) -> None:
        self.ops = ops
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self.ops, name)

    def gemma_layers(self, *args):
        self.calls += 1
        return self.ops.gemma_layers(*args)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_matches_the_module_loop(checkpoints, variant: str, dtype: str):
    fused_runner = make_runner(checkpoints[variant], dtype, fused=True)
    counting = CountingOps(fused_runner.model.fast_path.ops)
    fused_runner.model.fast_path.ops = counting
    fused = run_steps(fused_runner)
    loop = run_steps(make_runner(checkpoints[variant], dtype, fused=False))
    assert counting.calls >= 6  # every decode step in one call
    assert len(fused) == len(loop)
    for mine, theirs in zip(fused, loop, strict=True):
        assert mine.keys() == theirs.keys()
        for request_id in mine:
            error = relative_error(mine[request_id].float(), theirs[request_id].float())
            assert error <= TOLERANCE[dtype], (request_id, error)
            assert int(mine[request_id].argmax()) == int(theirs[request_id].argmax())


def test_route_names_the_gemma_loop(checkpoints):
    runner = make_runner(checkpoints["gemma3"], "float32", fused=True)
    routes = runner.model.routes()
    assert routes.decode_loop.startswith("fused C++: every Gemma layer in one call")
    assert routes.windowed_attention.startswith("sliding window 9 (2 of 3 layers): C++")


def test_offset_rms_norm_matches_the_gemma_norm():
    ops = layer_ops()
    if ops is None:
        pytest.skip("no C++ kernels here")
    from pagedllm.model.decoder import OffsetRMSNorm

    norm = OffsetRMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(1)))
    qkv = torch.randn(5, 6 * 64, generator=torch.Generator().manual_seed(2))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        heads = qkv.to(dtype).view(5, 6, 64)[:, 1:4]  # a strided [T, H, D] view, like q
        got = ops.offset_rms_norm(heads, (1.0 + norm.weight.float()).contiguous(), 1e-6)
        torch.testing.assert_close(got, norm.to(dtype)(heads), atol=tol, rtol=tol)


def test_no_fast_path_for_a_mixture_of_experts(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "mixtral", "mixtral", sliding_window=None)
    loaded = load_model(path, "float32", CpuAttention())
    TorchModelRunner(loaded.model, block_size=16, num_blocks=16)
    assert loaded.model.fast_path is None
    assert loaded.model.routes().decode_loop == "module by module (torch ops)"
