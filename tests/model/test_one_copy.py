"""One copy of each weight: a float model packed for the CPU's kernels holds its checkpoint's
bytes, not twice them (the packed layout replaces the plain weight; a tied head's table is
looked up in the head's packed copy), on every small_gemm route this CPU runs or emulates
and where a dtype has no kernel route (then the weights stay plain, unpacked). Row-major
weights for reference paths come from the packed copy on demand."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import pagedllm.model.llama as llama_module
from pagedllm.kernels.linear import dense_weight, small_rows, unpack_small
from pagedllm.kernels.ops import layer_ops
from pagedllm.model import load_model
from pagedllm.model.llama import Linear
from pagedllm.model.weights import held_weight_bytes
from pagedllm.worker.model_runner import TorchModelRunner
from tests.kernels.isa_caps import ROUTES, small_gemm_capped

from .parity_helpers import PROMPTS, HFReference

# Every small_gemm route per dtype, and "none": the dtype without a small_gemm route
# (bf16 then on oneDNN's packed layout where torch has it, float32 on torch's F.linear).
DTYPE_ROUTES = [(dtype, isa) for dtype, isas in ROUTES.items() for isa in (*isas, "none")]
VARIANTS = ("llama_gqa", "llama_tied", "gemma3")


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture(params=DTYPE_ROUTES, ids=lambda route: f"{name(route[0])}-{route[1]}")
def route(request) -> Iterator[tuple[torch.dtype, str]]:
    dtype, isa = request.param
    if isa == "none":
        ops = layer_ops()
        if ops is None:
            pytest.skip("the C++ kernels did not build")
        cap = ops.set_small_gemm_isa if dtype == torch.bfloat16 else ops.set_small_gemm_f32_isa
        saved = cap("none")
        try:
            yield dtype, isa
        finally:
            cap(saved)
        return
    with small_gemm_capped(dtype, isa):
        yield dtype, isa


def checkpoint_bytes(path: Path, dtype: torch.dtype, tied: bool) -> int:
    """Bytes of the checkpoint's tensors at ``dtype`` (a tied head's copy, if written, once)."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                if tied and key == "lm_head.weight":
                    continue
                shape = handle.get_slice(key).get_shape()
                total += int(torch.Size(shape).numel()) * size
    return total


def reachable_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor reachable from ``model``'s attributes (modules, the fast path,
    its plans' lists, packed copies), each storage once: a second copy of a weight kept
    anywhere shows here. The rotary frequencies (no weights) are left out."""
    skip = {id(model.inv_freq)}
    seen: set[int] = set()
    storages: dict[int, int] = {}

    def visit(value: object) -> None:
        if id(value) in seen or id(value) in skip:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.is_mkldnn:  # oneDNN's opaque layout
                storages[id(value)] = value.numel() * value.element_size()
            elif value.numel():
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith(
            ("pagedllm", "torch.nn")
        ):
            visit(vars(value))
        elif hasattr(value, "__slots__") and type(value).__module__.startswith("pagedllm"):
            for slot in value.__slots__:
                visit(getattr(value, slot, None))

    visit(model)
    return sum(storages.values())


def packed_runner(path: Path, dtype: torch.dtype) -> TorchModelRunner:
    loaded = load_model(path, dtype=name(dtype), load_tokenizer=False)
    return TorchModelRunner(loaded.model, block_size=4, num_blocks=32)


def oned_nn_tied_table(model: torch.nn.Module) -> int:
    """The bytes of a tied head's oneDNN copy: oneDNN's blocked layout has no rows to look
    tokens up in, so there the embedding keeps its plain table beside it."""
    packed = model.tied_packs[0] if model.lm_head is None else None
    return 0 if packed is None else packed.numel() * packed.element_size()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_packed_float_model_holds_its_checkpoint_bytes_once(checkpoints, route, variant):
    dtype, isa = route
    path = checkpoints(variant)
    model = packed_runner(path, dtype).model
    tied = model.lm_head is None
    expected = checkpoint_bytes(path, dtype, tied) + oned_nn_tied_table(model)
    assert held_weight_bytes(model) == expected  # the start-up report's weight figure
    if variant != "gemma3":  # Gemma's fast path keeps its norms as float32 1 + weight
        assert reachable_bytes(model) == expected
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if isa == "none" and dtype == torch.float32:
        assert all(m.small is None and m.packed is None for m in linears)  # plain only
    else:
        assert all(m.weight.numel() == 0 for m in linears)  # the packed copy is the only one


@pytest.mark.parametrize("variant", ("llama_gqa", "llama_tied"))
def test_packing_releases_each_plain_weight_before_packing_the_next(
    checkpoints, route, variant, monkeypatch
):
    """The plain and packed copies are never both held for the whole model: each linear's
    plain weight is gone before the next one is packed."""
    dtype, _ = route
    model = load_model(checkpoints(variant), dtype=name(dtype), load_tokenizer=False).model
    plain = [weakref.ref(m.weight) for m in model.modules() if isinstance(m, Linear)]
    packed_so_far: list[bool] = []  # per linear packed so far: whether a layout took it
    pack_for_cpu = llama_module.pack_for_cpu

    def spy(weight, ops):
        for ref, packed in zip(plain, packed_so_far, strict=False):
            assert (ref() is None) == packed, "a packed linear still holds its plain weight"
        packs = pack_for_cpu(weight, ops)
        packed_so_far.append(any(copy is not None for copy in packs))
        return packs

    monkeypatch.setattr(llama_module, "pack_for_cpu", spy)
    model.optimize_for_cpu()
    assert len(packed_so_far) >= len(plain)
    assert any(packed_so_far) == (route != (torch.float32, "none"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_copy_gives_back_the_row_major_weight_and_its_rows(dtype):
    ops = layer_ops()
    if ops is None:
        pytest.skip("the C++ kernels did not build")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=generator).to(dtype)
    small = ops.pack_small_gemm(weight)
    assert torch.equal(unpack_small(small), weight)
    ids = torch.tensor([[0, 47, 17], [16, 15, 31]])
    assert torch.equal(small_rows(small, ids), weight[ids])


def test_every_linear_gives_its_row_major_weight_on_demand(checkpoints, route):
    dtype, _ = route
    path = checkpoints("llama_gqa")
    plain = load_model(path, dtype=name(dtype), load_tokenizer=False).model
    packed = packed_runner(path, dtype).model
    pairs = zip(plain.modules(), packed.modules(), strict=True)
    linears = [(a, b) for a, b in pairs if isinstance(a, Linear)]
    for before, after in linears:
        assert torch.equal(dense_weight(after.tensors), before.weight)


def test_a_tied_table_looked_up_in_the_heads_packed_copy_matches_transformers(checkpoints, route):
    """The embedding reads its rows from the head's packed copy: greedy tokens still
    equal transformers' (float32; bf16 rounding is compared by the parity tests)."""
    dtype, isa = route
    if dtype != torch.float32:
        pytest.skip("compared in float32 (bf16 parity: tests/model/test_model_parity.py)")
    path = checkpoints("llama_tied")
    runner = packed_runner(path, dtype)
    assert isa == "none" or runner.model.embed_tokens.weight.numel() == 0
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(str(path), dtype="float32", block_size=4, num_blocks=64, max_model_len=64)
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.close()
    hf = HFReference(path, dtype)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf.greedy(prompt, 6), prompt


def test_a_tensor_parallel_rank_reads_its_tied_vocabulary_from_the_packed_copy(checkpoints):
    from pagedllm.engine.executor.collectives import LocalCollective
    from pagedllm.model.tensor_parallel import TensorParallelModel

    path = checkpoints("llama_tied")
    loaded = load_model(path, dtype="float32", load_tokenizer=False)
    table = loaded.model.embed_tokens.weight.detach().clone()
    model = TensorParallelModel(loaded.model, LocalCollective())
    model.optimize_for_cpu()
    if model.inner.tied_packs[1] is None:
        pytest.skip("no float32 small_gemm route here: the shard stays plain")
    assert model.embed_tokens.weight.numel() == 0
    ids = torch.tensor([[0, 5], [319, 17]])
    assert torch.equal(model.embed_tokens(ids), table[ids])
    assert held_weight_bytes(model.inner) == checkpoint_bytes(path, torch.float32, tied=True)
