"""A GGUF's linears kept quantized as stored (every format of kernels/quant.py) against the
same file with every tensor dequantised to float32 by the ``gguf`` package.

Both models run the same tokens (the reference's greedy ones, so that one flipped token cannot
send the two down different texts): a prompt step (32 rows) then decode steps (4 rows), both
on quant_gemm's integer kernel with int8 activations (it takes any number of float32 rows). Each step's
logits stay within a KL of 1e-5 nats of the reference's (measured: at most 1.5e-6 on the
64-wide models, 6e-6 on the 256-wide one the K-quants need), and the top-1 token agrees on at
least 95% of the rows whose reference top-2 gap is at least ``TIE_GAP`` (measured: 96-100%;
a random tiny model has near ties: the flips seen were at gaps of 6e-4 to 2e-3, its logits'
spread about 0.3).
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.quant import QuantParts, QuantWeight
from pagedllm.model import load_model
from pagedllm.model.llama import Linear
from pagedllm.quant_layout import CODES, INT8_ACTIVATIONS
from pagedllm.worker.model_runner import TorchModelRunner

from .parity_helpers import PROMPTS, HandDriver
from .test_gguf_and_default_model import write_tiny_gguf

pytest.importorskip("gguf")

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
MAX_KL = 1e-5
MIN_TOP1 = 0.95
TIE_GAP = 5e-3
DECODE_STEPS = 6


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) of the softmaxes, in nats, the largest over the rows."""
    log_p = torch.log_softmax(reference.double(), -1)
    log_q = torch.log_softmax(other.double(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).max())


def run_in_lockstep(
    reference, quantized, prompts, tie_gap=TIE_GAP, decode_steps=DECODE_STEPS
) -> tuple[float, float]:
    """(largest KL, top-1 agreement on the rows whose reference top-2 gap is at least
    ``tie_gap``) over a prompt step and ``decode_steps`` decode steps, both models fed the
    reference's greedy tokens."""
    drivers = [
        HandDriver(TorchModelRunner(model, block_size=4, num_blocks=256))
        for model in (reference, quantized)
    ]
    seqs = [[d.add(f"r{i}", p) for i, p in enumerate(prompts)] for d in drivers]
    steps = [
        d.step([d.schedule(s, len(s.token_ids)) for s in ss])
        for d, ss in zip(drivers, seqs, strict=True)
    ]
    worst, agree, total = 0.0, 0, 0
    for step in range(decode_steps + 1):
        expected = torch.stack([steps[0][f"r{i}"] for i in range(len(prompts))])
        actual = torch.stack([steps[1][f"r{i}"] for i in range(len(prompts))])
        worst = max(worst, kl_divergence(expected, actual))
        top2 = expected.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) >= tie_gap
        agree += int(((expected.argmax(-1) == actual.argmax(-1)) & decided).sum())
        total += int(decided.sum())
        if step == decode_steps:
            break
        tokens = expected.argmax(-1).tolist()
        for d, ss in zip(drivers, seqs, strict=True):
            for seq, token in zip(ss, tokens, strict=True):
                d.append(seq.request_id, token)
        steps = [
            d.step([d.schedule(s, 1) for s in ss]) for d, ss in zip(drivers, seqs, strict=True)
        ]
    return worst, agree / total


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias"])
def test_quantized_linears_stay_close_to_the_dequantised_model(
    tmp_path, checkpoints, variant, format
) -> None:
    gguf_file = write_tiny_gguf(checkpoints(variant), tmp_path / "t.gguf", False, linears=format)
    quantized = load_model(gguf_file, dtype="float32", load_tokenizer=False)
    reference = load_model(gguf_file, dtype="float32", load_tokenizer=False, keep_quantized=False)
    kept = [m for m in quantized.model.modules() if isinstance(m, Linear) and m.quant is not None]
    # qkv, o, gate/up, down per layer, and the untied head: the only copies of their weights.
    assert len(kept) == 4 * quantized.config.num_hidden_layers + 1
    assert all(m.weight.numel() == 0 and m.quant.format == format for m in kept)
    worst, top1 = run_in_lockstep(reference.model, quantized.model, PROMPTS)
    assert worst <= MAX_KL, f"KL {worst:.2e}"
    assert top1 >= MIN_TOP1, f"top-1 agreement {top1:.3f}"


@pytest.mark.parametrize("format", K_QUANTS)
def test_k_quants_stay_close_to_the_dequantised_model(tmp_path, checkpoints, format) -> None:
    gguf_file = write_tiny_gguf(checkpoints("qwen2_wide"), tmp_path / "t.gguf", False, format)
    quantized = load_model(gguf_file, dtype="float32", load_tokenizer=False)
    reference = load_model(gguf_file, dtype="float32", load_tokenizer=False, keep_quantized=False)
    kept = [m for m in quantized.model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert len(kept) == 4 * quantized.config.num_hidden_layers + 1
    assert all(m.quant.format == format for m in kept)
    worst, top1 = run_in_lockstep(reference.model, quantized.model, PROMPTS)
    assert worst <= MAX_KL, f"KL {worst:.2e}"
    assert top1 >= MIN_TOP1, f"top-1 agreement {top1:.3f}"


def qwen_coder_formats(name: str) -> str:
    """The real Qwen2.5-Coder-0.5B GGUF's mix: v Q8_0 in some layers (here layer 0), down
    Q6_K, the head Q8_0, the rest Q5_0."""
    if name.startswith("model.layers.0.") and "v_proj" in name or name == "lm_head.weight":
        return "Q8_0"
    return "Q6_K" if "down_proj" in name else "Q5_0"


def q4_k_m_formats(name: str) -> str:
    """llama.cpp's Q4_K_M: Q4_K, with v and down in Q6_K in some layers (layer 0 here)
    and the head in Q6_K."""
    if name == "lm_head.weight" or (name.startswith("model.layers.0.") and "v_proj" in name):
        return "Q6_K"
    return "Q6_K" if name.startswith("model.layers.0.") and "down_proj" in name else "Q4_K"


MIXES = {
    "qwen_coder": (qwen_coder_formats, "Q5_0", "Q8_0"),
    "q4_k_m": (q4_k_m_formats, "Q4_K", "Q6_K"),
}


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_q_k_v_stay_apart_as_stored(tmp_path, checkpoints, dtype, mix) -> None:
    """The real files' mixes: where v is stored in another format than q/k (layer 0), the
    three stay apart, each as stored (no widening, no float copy); where they match (layer
    1), one fused linear; every linear and the embedding stay quantized; the one-call
    decoder takes decode steps; logits close to the dequantised model's."""
    formats, common, v_format = MIXES[mix]
    source = checkpoints("qwen2_wide")
    path = write_tiny_gguf(source, tmp_path / "t.gguf", False, formats, "Q5_0")
    quantized = load_model(path, dtype=dtype, load_tokenizer=False)
    reference = load_model(path, dtype=dtype, load_tokenizer=False, keep_quantized=False)
    model = quantized.model
    apart = model.layers[0].self_attn.qkv_proj.quant
    assert isinstance(apart, QuantParts) and apart.format == f"{common}+{common}+{v_format}"
    fused = model.layers[1].self_attn.qkv_proj.quant
    assert isinstance(fused, QuantWeight) and fused.format == common
    assert model.embed_tokens.quant.format == "Q5_0"
    assert all(m.quant is not None for m in model.modules() if isinstance(m, Linear))
    worst, top1 = run_in_lockstep(reference.model, model, PROMPTS)
    assert worst <= (MAX_KL if dtype == "float32" else 5e-3), f"KL {worst:.2e}"
    assert top1 >= MIN_TOP1, f"top-1 agreement {top1:.3f}"
    routes = model.routes()
    assert f"{common}+{common}+{v_format} kept as stored, a call a part" in routes.linears
    if model.fast_path is not None:
        plan = model.fast_path.plan
        assert plan is not None and len(plan.qkv) == 3 * len(model.layers)
        code = CODES[common]
        # Qwen's Q8_0 v among lower-bit weights: int8 activations, in its code.
        assert plan.weight_formats[:3] == [code, code, apart.parts[2].code]
        assert apart.parts[2].activations == "int8"
        assert plan.weight_formats[6:9] == [code, code, code]  # layer 1: its rows as views


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_one_call_with_q_k_v_apart_equals_the_layer_loop(
    tmp_path, checkpoints, monkeypatch, mix, kv_cache_dtype
) -> None:
    """q/k/v apart in some layers: decoder_layers (quant_decoder_layers over an int8 cache)
    gives the per-layer loop's logits bit for bit."""
    from pagedllm.model import fast_path

    from .test_decoder_layers import run_steps

    name = "decoder_layers" if kv_cache_dtype == "auto" else "quant_decoder_layers"
    path = write_tiny_gguf(checkpoints("qwen2_wide"), tmp_path / "t.gguf", False, MIXES[mix][0])
    calls = []
    real = getattr(fast_path, name)
    monkeypatch.setattr(fast_path, name, lambda *a: calls.append(1) or real(*a))
    results = []
    for whole in (True, False):
        model = load_model(path, "bfloat16", load_tokenizer=False).model
        runner = TorchModelRunner(
            model, block_size=16, num_blocks=64, kv_cache_dtype=kv_cache_dtype
        )
        if model.fast_path is None or model.fast_path.plan is None:
            pytest.skip("no one-call decoder here (no kernels)")
        if not whole:
            model.fast_path.plan = None
        results.append(run_steps(runner))
    assert len(calls) >= 6  # the decode steps
    for whole_step, loop_step in zip(*results, strict=True):
        for request_id, row in whole_step.items():
            assert torch.equal(row, loop_step[request_id])


def test_a_quantized_embedding_is_the_tied_head_too(tmp_path, checkpoints) -> None:
    """SmolLM2's layout: linears Q4_1, the token embedding Q8_0 and tied to the head; the
    embedding is kept as stored, looked up and multiplied in that one copy."""
    source = checkpoints("llama_tied")
    gguf_file = write_tiny_gguf(source, tmp_path / "t.gguf", False, "Q4_1", embedding="Q8_0")
    quantized = load_model(gguf_file, dtype="float32", load_tokenizer=False)
    reference = load_model(gguf_file, dtype="float32", load_tokenizer=False, keep_quantized=False)
    table = quantized.model.embed_tokens
    assert table.quant is not None and table.quant.format == "Q8_0"
    assert table.weight.numel() == 0 and quantized.dtype == torch.float32
    ids = torch.tensor([[3, 200], [0, 319]])
    assert torch.equal(table(ids), reference.model.embed_tokens(ids))
    worst, top1 = run_in_lockstep(reference.model, quantized.model, PROMPTS)
    assert worst <= MAX_KL, f"KL {worst:.2e}"
    assert top1 >= MIN_TOP1, f"top-1 agreement {top1:.3f}"
    routes = quantized.model.routes()
    assert "Q8_0 kept as stored" in routes.lm_head and "Q4_1 kept as stored" in routes.linears


def test_route_names_the_quantized_kernel(tmp_path, checkpoints) -> None:
    gguf_file = write_tiny_gguf(checkpoints("llama_tied"), tmp_path / "t.gguf", False, "Q4_1")
    loaded = load_model(gguf_file, dtype="float32", load_tokenizer=False)
    loaded.model.optimize_for_cpu()
    linears = loaded.model.routes().linears
    ops = loaded.model.head_ops
    if ops is None:
        assert "8 on torch, Q4_1 dequantised per call" in linears
    else:
        isa = ops.quant_gemm_isa()
        limit = _row_limit(ops.quant_gemm_int_rows(loaded.dtype, CODES["Q4_1"]))
        assert f"8 on own kernel quant_gemm ({isa}, Q4_1 kept as stored) {limit}" in linears


def _row_limit(rows: int) -> str:
    """How a route names the integer kernel's row limit (-1: none)."""
    return "at any number of rows" if rows < 0 else f"up to {rows} rows"


@pytest.mark.parametrize(("format", "activations"), [("Q8_0", "int16"), ("Q4_0", "int8")])
def test_route_names_the_activations(tmp_path, checkpoints, format, activations) -> None:
    """A model all Q8_0 runs on int16 activations, the other formats on int8 ones."""
    gguf_file = write_tiny_gguf(checkpoints("llama_tied"), tmp_path / "t.gguf", False, format)
    loaded = load_model(gguf_file, dtype="float32", load_tokenizer=False)
    loaded.model.optimize_for_cpu()
    if loaded.model.head_ops is None:
        pytest.skip("the C++ kernels did not build")
    code = CODES[format] + (INT8_ACTIVATIONS if format == "Q8_0" and activations == "int8" else 0)
    limit = _row_limit(loaded.model.head_ops.quant_gemm_int_rows(loaded.dtype, code))
    assert f"{limit} ({activations} activations)" in loaded.model.routes().linears


@pytest.mark.parametrize(
    ("choice", "activations"), [("auto", "int8"), ("int16", "int16"), ("int8", "int8")]
)
def test_a_q8_0_head_among_lower_bit_weights_takes_int8(
    tmp_path, checkpoints, choice, activations
) -> None:
    """A Q4_1 file's Q8_0 embedding (its tied head) takes int8 activations, as llama.cpp
    runs it, unless int16 is asked for; the logits stay close to the dequantised model's."""
    gguf_file = write_tiny_gguf(
        checkpoints("llama_tied"), tmp_path / "t.gguf", False, "Q4_1", embedding="Q8_0"
    )
    loaded = load_model(gguf_file, "float32", load_tokenizer=False, q8_0_activations=choice)
    head = loaded.model.embed_tokens.quant
    assert head.format == "Q8_0" and head.activations == activations
    if loaded.model.head_ops is not None:
        assert f"({activations} activations)" in loaded.model.routes().lm_head
    reference = load_model(gguf_file, dtype="float32", load_tokenizer=False, keep_quantized=False)
    worst, top1 = run_in_lockstep(reference.model, loaded.model, PROMPTS)
    assert worst <= MAX_KL and top1 >= MIN_TOP1, (worst, top1)


def test_q8_0_activations_choice_is_checked(tmp_path, checkpoints) -> None:
    gguf_file = write_tiny_gguf(checkpoints("llama_tied"), tmp_path / "t.gguf", False, "Q8_0")
    with pytest.raises(ValueError, match="q8_0_activations must be one of"):
        load_model(gguf_file, load_tokenizer=False, q8_0_activations="int4")


def test_env_names_the_quantized_route(tmp_path, checkpoints, capsys) -> None:
    import json

    from pagedllm.cli import main
    from pagedllm.kernels.ops import layer_ops

    gguf_file = write_tiny_gguf(checkpoints("llama_tied"), tmp_path / "t.gguf", False, "Q4_0")
    assert main(["env", "--model", str(gguf_file), "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    ops = layer_ops()
    isa = "none" if ops is None else ops.quant_gemm_isa()
    assert env["kernels"]["quant_gemm"] == isa
    if ops is not None:
        dtype = getattr(torch, env["routes"]["dtype"].split()[0])
        limit = _row_limit(ops.quant_gemm_int_rows(dtype, CODES["Q4_0"]))
        expected = f"8 on own kernel quant_gemm ({isa}, Q4_0 kept as stored) {limit}"
        assert expected in env["routes"]["linears"]


def test_a_linear_only_partly_quantized_is_dequantised(tmp_path, checkpoints) -> None:
    """q and k quantized (in different formats), v not: the fused qkv_proj holds the
    dequantised floats beside v's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pagedllm.kernels.quant import dequantize, from_gguf_blocks
    from pagedllm.model.weights import place_quantized

    gguf_file = write_tiny_gguf(checkpoints("llama_gqa"), tmp_path / "t.gguf", False)
    model = load_model(gguf_file, dtype="float32", load_tokenizer=False).model
    rng = torch.Generator().manual_seed(0)
    parts = {}
    for part, rows, kind in (("q", 64, "Q4_1"), ("k", 32, "Q4_0")):
        blocks = quantize(
            (torch.randn(rows, 64, generator=rng) * 0.1).numpy(), GGMLQuantizationType[kind]
        )
        parts[part] = from_gguf_blocks(blocks, kind, (rows, 64))
    qkv = model.layers[0].self_attn.qkv_proj
    v = qkv.weight[96:].clone()
    place_quantized(model, "layers.0.self_attn.qkv_proj.weight", parts, qkv.weight)
    assert qkv.quant is None
    expected = torch.cat([dequantize(parts["q"]), dequantize(parts["k"]), v])
    assert torch.equal(qkv.weight, expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_decoder_equals_the_layer_loop(tmp_path, checkpoints, monkeypatch, dtype) -> None:
    """Decode steps of a quantized model run every layer in one C++ call (quant_gemm inside
    decoder_layers), with the per-layer loop's results bit for bit."""
    from pagedllm.model import fast_path

    from .test_decoder_layers import run_steps

    gguf_file = write_tiny_gguf(checkpoints("qwen2_bias"), tmp_path / "t.gguf", False, "Q4_1")
    calls = []
    real = fast_path.decoder_layers
    monkeypatch.setattr(fast_path, "decoder_layers", lambda *a: calls.append(1) or real(*a))
    results = []
    for whole in (True, False):
        model = load_model(gguf_file, dtype, load_tokenizer=False).model
        runner = TorchModelRunner(model, block_size=16, num_blocks=64)
        if model.fast_path is None or model.fast_path.plan is None:
            pytest.skip("no one-call decoder here (no kernels, or no small_gemm for the head)")
        if not whole:
            model.fast_path.plan = None
        results.append(run_steps(runner))
    assert len(calls) >= 6  # the decode steps
    for whole_step, loop_step in zip(*results, strict=True):
        for request_id, row in whole_step.items():
            assert torch.equal(row, loop_step[request_id])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_one_call_over_a_quantized_cache_equals_the_layer_loop(
    tmp_path, checkpoints, monkeypatch, kv_cache_dtype
) -> None:
    """Quantized weights over a quantized cache: decode steps in quant_decoder_layers (with
    two or more threads, one step team: products and quant_attention's tasks handed out
    as threads come free) give the per-layer loop's logits bit for bit."""
    from pagedllm.model import fast_path

    from .test_decoder_layers import run_steps

    gguf_file = write_tiny_gguf(checkpoints("qwen2_bias"), tmp_path / "t.gguf", False, "Q4_1")
    calls = []
    real = fast_path.quant_decoder_layers
    monkeypatch.setattr(fast_path, "quant_decoder_layers", lambda *a: calls.append(1) or real(*a))
    results = []
    for whole in (True, False):
        model = load_model(gguf_file, "bfloat16", load_tokenizer=False).model
        runner = TorchModelRunner(
            model, block_size=16, num_blocks=64, kv_cache_dtype=kv_cache_dtype
        )
        if model.fast_path is None or model.fast_path.plan is None:
            pytest.skip("no one-call decoder here (no kernels, or no small_gemm for the head)")
        if not whole:
            model.fast_path.plan = None
        results.append(run_steps(runner))
    assert len(calls) >= 6  # the decode steps
    for whole_step, loop_step in zip(*results, strict=True):
        for request_id, row in whole_step.items():
            assert torch.equal(row, loop_step[request_id])


def test_tensor_parallel_shards_keep_the_quantized_rows(tmp_path, checkpoints) -> None:
    """A rank keeps its rows of a quantized linear (q/k/v pieces in order), still quantized."""
    from pagedllm.kernels.quant import dequantize
    from pagedllm.model.tensor_parallel import _shard_rows

    gguf_file = write_tiny_gguf(checkpoints("llama_gqa"), tmp_path / "t.gguf", False, "Q8_0")
    qkv = load_model(gguf_file, dtype="float32", load_tokenizer=False).model.layers[0].self_attn
    qkv = qkv.qkv_proj
    full = dequantize(qkv.quant)
    _shard_rows(qkv, [(0, 32), (64, 80), (96, 112)])
    assert qkv.out_features == 64 and qkv.quant.shape == (64, 64)
    assert torch.equal(dequantize(qkv.quant), torch.cat((full[0:32], full[64:80], full[96:112])))


def test_held_weight_bytes_count_quantized_weights_as_stored(tmp_path, checkpoints) -> None:
    """The start-up report's weight figure: a quantized linear counts its stored bytes, a
    float one its parameters and packed copies, each tensor once."""
    from pagedllm.model.weights import held_weight_bytes

    source = checkpoints("qwen2_wide")
    path = write_tiny_gguf(source, tmp_path / "t.gguf", False, qwen_coder_formats, "Q5_0")
    model = load_model(path, dtype="float32", load_tokenizer=False).model
    quantized = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    floats = sum(p.numel() * 4 for p in model.parameters())
    stored = sum(q.nbytes for q in quantized)
    assert held_weight_bytes(model) == stored + floats
    # Layer 0's q/k in Q5_0 (176 bytes a row of 256), v in Q8_0 (272): as the file, apart.
    assert model.layers[0].self_attn.qkv_proj.quant.nbytes == (256 + 128) * 176 + 128 * 272
    model.optimize_for_cpu()  # quantized weights get no packed copy
    assert held_weight_bytes(model) == stored + floats
