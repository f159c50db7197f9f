"""A quantized KV cache in the engine: paging never changes tokens, a prefix hit gives the
logits a recomputation gives, staging does not leak, and prompt_logprobs."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm.core.outputs import ScheduledSequence
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from tests.engine.conftest import run_all, run_with_resizes
from tests.engine.test_engine_model import BASE, VARIANTS, generate, prompts

LOSSY = ("int8", "int4", "fp8_e4m3")


@pytest.fixture(scope="module")
def baselines() -> dict[str, list]:
    return {}


def check_slots(engine: LLMEngine) -> None:
    """Every staging slot is held by a block someone can read: a referenced one, or a
    cached-free first block (at most max_num_seqs of them); once idle, only the latter."""
    cache, pool = engine.runner.kv_cache, engine.kv.pool
    cache.check_invariants()
    engine.kv.check_invariants()
    # Blocks released by the last step reach the worker with the next step's output.
    held = set(cache._slot_of) - set(pool.pending_released())
    cached_first = {b for b in pool.cached_free_order() if pool.is_first_block(b)}
    assert all(pool.ref_count(b) > 0 or b in cached_first for b in held), held
    assert pool.num_cached_first_blocks <= engine.config.max_num_seqs
    if not engine.scheduler.has_unfinished_requests():
        kept = cached_first if engine.config.unquantized_first_block else set()
        assert held == kept


# (kv_cache_dtype, kv_cache_unquantized_first_block): int4 keeps first blocks by default.
QUANT_CASES = [("int8", None), ("int8", True), ("int4", None), ("int4", False)]


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize(("kv_cache_dtype", "first_block"), QUANT_CASES)
def test_quantized_tokens_do_not_depend_on_paging(
    kv_cache_dtype: str,
    first_block: bool | None,
    name: str,
    baselines: dict,
    model_engine: Callable[..., LLMEngine],
) -> None:
    """Each query reads the blocks before its own sealed (or block 0 unquantized) and its
    own in full precision, whatever the chunking, preemption, swapping or prefix hits: the
    same greedy tokens."""
    quant = dict(kv_cache_dtype=kv_cache_dtype, kv_cache_unquantized_first_block=first_block)
    key = (kv_cache_dtype, first_block)
    if key not in baselines:
        engine = model_engine(num_blocks=256, enable_prefix_caching=False, **quant, **BASE)
        baselines[key] = generate(engine)
    engine = model_engine(**VARIANTS[name], **quant, **BASE)
    assert generate(engine) == baselines[key]
    if "tiny" in name:
        assert engine.get_stats().num_preemptions > 0
    if name in ("prefix-cache", "multi-step-4"):
        assert generate(engine) == baselines[key]
        assert engine.get_stats().cache.prefix_hits_tokens > 0
    check_slots(engine)


@pytest.mark.parametrize(("kv_cache_dtype", "first_block"), QUANT_CASES)
@pytest.mark.parametrize("name", ["chunk-5", "recompute-tiny"])
def test_the_one_call_loop_gives_the_layer_loop_s_tokens(
    kv_cache_dtype: str,
    first_block: bool | None,
    name: str,
    model_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer in one C++ call over the quantized cache (quant_decoder_layers) and the
    per-layer loop: the same greedy tokens, chunked prompts and preemptions included."""
    from pagedllm.model import fast_path

    calls = []
    real = fast_path.quant_decoder_layers
    monkeypatch.setattr(fast_path, "quant_decoder_layers", lambda *a: calls.append(1) or real(*a))
    quant = dict(kv_cache_dtype=kv_cache_dtype, kv_cache_unquantized_first_block=first_block)
    tokens = []
    for whole in (True, False):
        engine = model_engine(**VARIANTS[name], **quant, **BASE)
        path = engine.runner.model.fast_path
        if path is None or path.plan is None:
            pytest.skip("no one-call decoder loop here (no small_gemm for float32, or no kernels)")
        if not whole:
            path.plan = None
        tokens.append(generate(engine))
        check_slots(engine)
    assert calls  # the first engine's steps went through the one call
    assert tokens[0] == tokens[1]


def test_the_first_block_option_changes_what_block_0_reads(
    model_engine: Callable[..., LLMEngine],
) -> None:
    """int4 with and without the unquantized first block: the logits of a query past block
    0 differ (the option reaches attention), those of a query in block 0 do not."""
    rng = random.Random(2)
    prompt = tuple(rng.randrange(256) for _ in range(9))
    logits = []
    for first_block in (True, False):
        runner = model_engine(
            num_blocks=16, kv_cache_dtype="int4", kv_cache_unquantized_first_block=first_block,
            **BASE,
        ).runner  # fmt: skip
        logits.append(runner.row_logits([ScheduledSequence("a", prompt, 0, (3, 1, 2))]))
    assert torch.equal(logits[0][:4], logits[1][:4])
    assert not torch.equal(logits[0][4:], logits[1][4:])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
@pytest.mark.parametrize("prompt_len", [26, 3])
def test_parallel_samples_share_a_staged_block(
    model_engine: Callable[..., LLMEngine], kv_cache_dtype: str, prompt_len: int
) -> None:
    """n=4 forks share the prompt's open block; copy-on-write copies its staged rows. A
    3-token prompt's open block is also its first block (int4 keeps it unquantized after it
    fills): each fork's copy carries its rows."""
    prompt = prompts()[4][:prompt_len]  # 26 tokens: 6 full blocks of 4 and 2 staged rows
    params = SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    results = []
    for extra in ({}, {"enable_prefix_caching": False}):
        engine = model_engine(num_blocks=64, kv_cache_dtype=kv_cache_dtype, **extra, **BASE)
        engine.add_request("n4", prompt, params)
        results.append([c.token_ids for c in run_all(engine)["n4"].outputs])
        check_slots(engine)
    assert results[0] == results[1]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "first_block"),
    [("int8", None), ("int8", True), ("int4", None), ("int4", False), ("fp8_e5m2", None)],
)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_prefix_hit_gives_the_logits_a_recomputation_gives(
    kv_cache_dtype: str,
    first_block: bool | None,
    backend: str,
    model_engine: Callable[..., LLMEngine],
) -> None:
    """Bit for bit: the hit reads the very sealed blocks (and unquantized first block) the
    recomputation writes and reads (and a prompt in chunks reads them too)."""
    runner = model_engine(
        num_blocks=64,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_unquantized_first_block=first_block,
        attention_backend=backend,
        **BASE,
    ).runner
    rng = random.Random(1)
    prompt = tuple(rng.randrange(256) for _ in range(30))
    whole = runner.compute_logits([ScheduledSequence("a", prompt, 0, tuple(range(8)))])
    # The first 6 blocks (24 tokens) from the cache, the rest computed into fresh blocks.
    hit_table = (0, 1, 2, 3, 4, 5, 20, 21)
    hit = runner.compute_logits([ScheduledSequence("b", prompt[24:], 24, hit_table)])
    table = tuple(range(30, 38))
    runner.compute_logits([ScheduledSequence("c", prompt[:10], 0, table, num_samples=0)])
    chunked = runner.compute_logits([ScheduledSequence("c", prompt[10:], 10, table)])
    assert torch.equal(whole, hit)
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_staging_slots_are_returned(
    model_engine: Callable[..., LLMEngine], kv_cache_dtype: str
) -> None:
    """Released blocks give their staging slots back: many requests in a row, few held
    (int4: plus each distinct prompt's cached first block, at most max_num_seqs)."""
    engine = model_engine(num_blocks=64, kv_cache_dtype=kv_cache_dtype, max_num_seqs=3, **BASE)
    cache = engine.runner.kv_cache
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i in range(40):
        engine.add_request(str(i), prompts()[i % 5], params)
        run_all(engine)
        kept = engine.kv.pool.num_cached_first_blocks if kv_cache_dtype == "int4" else 0
        assert kept <= cache.num_open_blocks <= kept + 2 and kept <= 3
        check_slots(engine)
    assert cache.num_staging_slots == 16


def test_cached_first_blocks_are_evicted_past_max_num_seqs(
    model_engine: Callable[..., LLMEngine],
) -> None:
    """Distinct prompts, two at a time: each leaves its first block cached-free holding a
    slot until a third would exceed max_num_seqs; the oldest then leaves the prefix cache
    (its next request recomputes it) and gives its slot back."""
    engine = model_engine(num_blocks=64, kv_cache_dtype="int4", max_num_seqs=2, **BASE)
    pool = engine.kv.pool
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    distinct = [[40 * k + j for j in range(6)] for k in range(3)]  # three first blocks
    firsts = []
    for i in range(3):
        engine.add_request(str(i), distinct[i], params)
        engine.step()
        firsts.append(engine.kv.block_table(str(i))[0])
        run_all(engine)
    assert [b for b in pool.cached_free_order() if pool.is_first_block(b)] == firsts[1:]
    assert firsts[0] in pool.pending_released()
    check_slots(engine)
    engine.add_request("again", distinct[0], params)
    engine.step()
    assert engine.scheduler.requests["again"].num_cached_tokens == 0
    run_all(engine)
    check_slots(engine)


def test_prompt_logprobs_score_every_prompt_token(model_engine: Callable[..., LLMEngine]) -> None:
    prompt = prompts()[4]
    engine = model_engine(num_blocks=64, max_num_batched_tokens=7, **BASE)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    outputs = []
    for i in range(2):  # the second would hit the prefix cache, but must not
        engine.add_request(str(i), prompt, params)
        outputs.append(run_all(engine)[str(i)])
    first, second = outputs
    assert second.num_cached_tokens == 0
    logprobs = first.prompt_logprobs
    assert len(logprobs) == len(prompt) and logprobs[0] is None
    # vLLM's shape: the prompt token and the top 3 (the prompt token among them, or not).
    assert all(prompt[p] in position for p, position in enumerate(logprobs) if p)
    assert all(len(position) in (3, 4) for position in logprobs[1:])
    # The plain construction: log_softmax of the teacher-forced logits of the whole prompt.
    logits = engine.runner.row_logits([ScheduledSequence("x", tuple(prompt), 0, tuple(range(7)))])
    expected = torch.log_softmax(logits[:-1], dim=-1)
    for p, position in enumerate(logprobs[1:]):
        lp = position[prompt[p + 1]]
        assert lp.logprob == pytest.approx(float(expected[p, prompt[p + 1]]), abs=1e-4)
        assert position[int(expected[p].argmax())].rank == 1
        assert lp.rank == int((expected[p] > expected[p, prompt[p + 1]]).sum()) + 1
    assert [
        position[prompt[p + 1]].logprob for p, position in enumerate(second.prompt_logprobs[1:])
    ] == pytest.approx(
        [position[prompt[p + 1]].logprob for p, position in enumerate(logprobs[1:])], abs=1e-4
    )


def test_prompt_logprobs_survive_preemption(model_engine: Callable[..., LLMEngine]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1)
    results = []
    for config in (dict(num_blocks=256), dict(num_blocks=18, preemption_mode="recompute")):
        engine = model_engine(**config, kv_cache_dtype="int8", **BASE)
        for i, prompt in enumerate(prompts()):
            engine.add_request(str(i), prompt, params)
        final = run_all(engine)
        results.append([final[str(i)].prompt_logprobs for i in range(len(prompts()))])
    assert results[0] == results[1]


def test_bad_prompt_logprobs_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int3")


def test_the_unquantized_first_block_option() -> None:
    import argparse

    from pagedllm.engine.args import add_engine_arguments, config_from_args

    assert EngineConfig(kv_cache_dtype="int4").unquantized_first_block
    assert not EngineConfig(kv_cache_dtype="int8").unquantized_first_block
    assert EngineConfig(
        kv_cache_dtype="int8", kv_cache_unquantized_first_block=True
    ).unquantized_first_block
    assert not EngineConfig(kv_cache_dtype="auto").unquantized_first_block
    with pytest.raises(ValueError, match="needs a quantized kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="bfloat16", kv_cache_unquantized_first_block=True)
    with pytest.raises(TypeError, match="bool"):
        EngineConfig(kv_cache_dtype="int4", kv_cache_unquantized_first_block="yes")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-cache-dtype", "int4", "--no-kv-cache-unquantized-first-block"])
    assert not config_from_args(args).unquantized_first_block
    assert config_from_args(parser.parse_args(["--kv-cache-dtype", "int4"])).unquantized_first_block


def test_startup_report_counts_scales_and_staging(tiny_model_dir: Path) -> None:
    from pagedllm.engine.config import EngineConfig

    engine = LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int8", kv_cache_memory=1 << 20)
    )
    spec = engine.runner.spec
    assert f"KV cache (int8, scales included): {int(spec.bytes_per_token):,} bytes" in (
        engine.startup_report
    )
    assert "open block stays in the model's dtype" in engine.startup_report
    assert "first block" not in engine.startup_report
    int4 = LLMEngine.from_config(
        EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int4", kv_cache_memory=1 << 20)
    )
    staged = int4.runner.spec.staging_bytes_per_slot
    assert "first block (tokens 0-15) stays in the model's dtype" in int4.startup_report
    assert f"up to 2 x 256 x {staged:,} bytes" in int4.startup_report
    int4.close()
    stats = engine.get_stats()
    assert stats.kv_cache_dtype == "int8" and stats.kv_bytes_per_token == spec.bytes_per_token
    assert engine.runner.num_blocks == (1 << 20) // spec.bytes_per_block


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4", "fp8_e5m2"])
def test_a_quantized_cache_resized_mid_generation_changes_no_token(
    model_engine: Callable[..., LLMEngine], kv_cache_dtype: str
) -> None:
    # int4 keeps first blocks unquantized: compaction moves them with their staged rows.
    # Shrinks compact live blocks (data, scales and open blocks' staged rows move with
    # them) and release the tail; grows add zeroed blocks. Tokens equal an undisturbed run.
    batch = [[(7 * i + j) % 90 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(resize: bool) -> list[tuple[int, ...]]:
        engine = model_engine(num_blocks=96, kv_cache_dtype=kv_cache_dtype, **BASE)
        for i, ids in enumerate(batch):
            engine.add_request(str(i), ids, params)
        schedule = {3: 40, 7: 96, 9: 30, 14: 120, 18: 36} if resize else {}

        def check() -> None:
            check_slots(engine)
            assert engine.runner.num_blocks == engine.kv.num_blocks

        final, sizes = run_with_resizes(engine, schedule, check)
        if resize:  # shrunk below the start (live blocks moved) and grown past it
            assert min(sizes) < 96 < max(sizes), sizes
        return [tuple(final[str(i)].outputs[0].token_ids) for i in range(len(batch))]

    assert run(resize=True) == run(resize=False)
    # An elastic pool (MIN:MAX) takes a quantized format too.
    EngineConfig(kv_cache_memory=1 << 20, kv_cache_memory_max=1 << 22, kv_cache_dtype="int4")
