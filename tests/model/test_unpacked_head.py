"""Every supported architecture whose vocabulary the small-batch kernel does not pack (611
and 733 rows: small_gemm takes rows in 16s) loads, says where its LM head runs, and matches
transformers token for token, on each small_gemm route this CPU runs or emulates: the
layers' linears on small_gemm, the head beside them on another path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pagedllm.engine.llm import LLM
from pagedllm.model.config import SUPPORTED_ARCHITECTURES
from pagedllm.sampling_params import SamplingParams
from tests.kernels.isa_caps import ROUTES, small_gemm_capped

from .parity_helpers import PROMPTS, HFReference, build_checkpoint

ARCHS = sorted(set(SUPPORTED_ARCHITECTURES.values()))
# (vocabulary size, tied to the embedding): neither is a multiple of 16.
HEADS = {"own_head": (611, False), "tied_head": (733, True)}
DTYPE_ROUTES = [(dtype, isa) for dtype, isas in ROUTES.items() for isa in isas]
NUM_DECODE = 6


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(params=DTYPE_ROUTES, ids=lambda route: f"{name(route[0])}-{route[1]}")
def route(request) -> Iterator[tuple[torch.dtype, str]]:
    dtype, isa = request.param
    with small_gemm_capped(dtype, isa):
        yield dtype, isa


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, head: str) -> Path:
        if (arch, head) not in cache:
            vocab_size, tied = HEADS[head]
            path = tmp_path_factory.mktemp(f"{arch}-{head}")
            cache[arch, head] = build_checkpoint(
                path, arch, vocab_size=vocab_size, tie_word_embeddings=tied
            )
        return cache[arch, head]

    return get


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(params=HEADS)
def head(request) -> str:
    return request.param


@pytest.fixture
def llm(checkpoint, route, arch: str, head: str) -> Iterator[LLM]:
    """The engine of ``arch`` with ``head``, on ``route``."""
    path = checkpoint(arch, head)
    llm = LLM(str(path), dtype=name(route[0]), block_size=4, num_blocks=64, max_model_len=64)
    yield llm
    llm.engine.close()


def test_loads_and_reports_where_the_head_runs(llm, route, arch: str, head: str) -> None:
    dtype, isa = route
    routes = llm.engine.routes
    assert f"small_gemm ({isa})" in routes.linears  # the layers' linears are packed...
    off = "torch F.linear" if dtype == torch.float32 else "oneDNN (packed bf16)"
    rows = HEADS[head][0]
    assert routes.lm_head == f"{off}; not small_gemm: {rows} rows, not a multiple of 16"
    assert f"  lm head: {routes.lm_head}" in llm.engine.startup_report


def test_greedy_tokens_match_transformers(checkpoint, llm, route, arch: str, head: str) -> None:
    dtype, _ = route
    if dtype == torch.bfloat16 and llm.engine.runner.model.config.moe is not None:
        pytest.skip(
            "bf16 rounding upstream can flip a router's expert choice: routed models' "
            "tokens are compared in float32"
        )
    params = SamplingParams(max_tokens=NUM_DECODE, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    hf = HFReference(checkpoint(arch, head), dtype)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf.greedy(prompt, NUM_DECODE), prompt
