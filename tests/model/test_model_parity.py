"""Token-exact parity with transformers through the paged cache (float32, tiny models)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.model import load_model
from pagedllm.worker.model_runner import TorchModelRunner

from .parity_helpers import (
    NUM_DECODE,
    PROMPTS,
    VARIANTS,
    HandDriver,
    HFReference,
    assert_close,
    greedy_batch,
    make_runner,
    relative_error,
)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_transformers(checkpoints, variant: str) -> None:
    path = checkpoints(variant)
    greedy_batch(make_runner(path, block_size=16), HFReference(path), PROMPTS, NUM_DECODE)


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_block_sizes_match_transformers(tiny_llama, block_size: int) -> None:
    greedy_batch(make_runner(tiny_llama, block_size), HFReference(tiny_llama), PROMPTS, 4)


def test_every_prefill_position_matches(tiny_llama) -> None:
    """Logits of every prompt position, not only the last (checks the causal mask)."""
    runner = make_runner(tiny_llama, block_size=4)
    hf = HFReference(tiny_llama)
    driver = HandDriver(runner)
    prompt = PROMPTS[2]
    seq = driver.add("r", prompt)
    # One token at a time: each step is a decode over the growing paged context.
    for i in range(len(prompt)):
        rows = driver.step([driver.schedule(seq, 1)])
        assert_close(rows["r"], hf.logits(prompt[: i + 1])[-1], f"position {i}")


def test_greedy_tokens_identical_to_transformers(tiny_llama) -> None:
    runner = make_runner(tiny_llama, block_size=3)
    hf = HFReference(tiny_llama)
    driver = HandDriver(runner)
    prompt = PROMPTS[1]
    seq = driver.add("r", prompt)
    tokens: list[int] = []
    output = runner.execute(SchedulerOutput(scheduled=(driver.schedule(seq, len(prompt)),)))
    for _ in range(8):
        seq.num_computed = len(seq.token_ids)
        token = output.sampled_token_ids[0][0]
        tokens.append(token)
        driver.append("r", token)
        output = runner.execute(SchedulerOutput(scheduled=(driver.schedule(seq, 1),)))
    assert tokens == hf.greedy(prompt, 8)


@pytest.mark.parametrize("block_size", [4, 5])
def test_cached_prefix_computes_only_the_suffix(tiny_llama, block_size: int) -> None:
    """A second sequence sharing a prefix reuses its full blocks and gets the same logits."""
    runner = make_runner(tiny_llama, block_size)
    hf = HFReference(tiny_llama)
    driver = HandDriver(runner)
    prefix = PROMPTS[2][:13]
    first = driver.add("a", prefix + [7, 8, 9])
    driver.step([driver.schedule(first, len(first.token_ids))])
    shared = len(prefix) // block_size  # full blocks of the prefix only
    second = driver.add("b", prefix + [200, 201, 202, 203, 204])
    second.block_table = list(first.block_table[:shared])
    second.num_computed = shared * block_size
    before = [k[torch.tensor(second.block_table)].clone() for k, _ in runner.kv_caches]
    scheduled = driver.schedule(second, len(second.token_ids) - second.num_computed)
    assert scheduled.start_position == shared * block_size
    assert len(scheduled.token_ids) < len(second.token_ids)
    rows = driver.step([scheduled])
    assert_close(rows["b"], hf.logits(second.token_ids)[-1], "suffix after cached prefix")
    after = [k[torch.tensor(second.block_table[:shared])] for k, _ in runner.kv_caches]
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new), "shared prefix blocks were written"


@pytest.mark.parametrize("chunks", [[7, 9, 7], [1, 1, 21], [16, 7], [5, 5, 5, 5, 3]])
def test_chunked_prefill_boundaries(tiny_llama, chunks: list[int]) -> None:
    runner = make_runner(tiny_llama, block_size=4)
    hf = HFReference(tiny_llama)
    driver = HandDriver(runner)
    prompt = (PROMPTS[2] + PROMPTS[1])[: sum(chunks)]
    seq = driver.add("r", prompt)
    other = driver.add("o", PROMPTS[0])
    rows = driver.step([driver.schedule(other, len(PROMPTS[0]))])
    for i, size in enumerate(chunks):
        last = i == len(chunks) - 1
        # Each chunk shares its step with a decode of another sequence.
        driver.append("o", int(rows["o"].argmax()))
        rows = driver.step(
            [driver.schedule(seq, size, 1 if last else 0), driver.schedule(other, 1)]
        )
        assert ("r" in rows) == last
        assert_close(rows["o"], hf.logits(other.token_ids)[-1], f"decode beside chunk {i}")
    assert_close(rows["r"], hf.logits(prompt)[-1], "last chunk")


def test_copy_on_write_fork(tiny_llama) -> None:
    """Two samples share a partial last block; the copy lets each write its own token."""
    runner = make_runner(tiny_llama, block_size=4)
    hf = HFReference(tiny_llama)
    driver = HandDriver(runner)
    prompt = PROMPTS[1]  # 11 tokens: the third block is partial
    parent = driver.add("p", prompt)
    rows = driver.step([driver.schedule(parent, len(prompt))])
    first = int(rows["p"].argmax())
    second = int(rows["p"].topk(2).indices[1])
    child = driver.add("c", list(prompt))
    child.block_table = parent.block_table[:-1] + [driver.free.pop()]
    child.num_computed = parent.num_computed
    copies = ((parent.block_table[-1], child.block_table[-1]),)
    driver.append("p", first)
    driver.append("c", second)
    rows = driver.step([driver.schedule(parent, 1), driver.schedule(child, 1)], block_copies=copies)
    assert_close(rows["p"], hf.logits(parent.token_ids)[-1], "parent after fork")
    assert_close(rows["c"], hf.logits(child.token_ids)[-1], "child after copy")


def test_swap_out_and_in_preserves_context(tiny_llama) -> None:
    runner = make_runner(tiny_llama, block_size=4, num_blocks=32, num_host_blocks=8)
    hf = HFReference(tiny_llama)
    driver = HandDriver(runner)
    seq = driver.add("r", PROMPTS[2])
    rows = driver.step([driver.schedule(seq, len(seq.token_ids))])
    driver.append("r", int(rows["r"].argmax()))
    old_table = list(seq.block_table)
    host = list(range(len(old_table)))
    runner.apply_block_moves(SchedulerOutput(swap_out=tuple(zip(old_table, host, strict=True))))
    for k_cache, v_cache in runner.kv_caches:  # the freed device blocks get reused by others
        k_cache[torch.tensor(old_table)] = 0.0
        v_cache[torch.tensor(old_table)] = 0.0
    seq.block_table = [driver.free.pop() for _ in old_table]
    swap_in = tuple(zip(host, seq.block_table, strict=True))
    rows = driver.step([driver.schedule(seq, 1)], swap_in=swap_in)
    assert set(seq.block_table).isdisjoint(old_table)
    assert_close(rows["r"], hf.logits(seq.token_ids)[-1], "after swap in")


def test_no_logits_for_mid_prompt_chunk(tiny_llama) -> None:
    runner = make_runner(tiny_llama, block_size=4)
    driver = HandDriver(runner)
    seq = driver.add("r", PROMPTS[2])
    output = runner.execute(SchedulerOutput(scheduled=(driver.schedule(seq, 5, num_samples=0),)))
    assert output.sampled_token_ids == ((),)


def test_empty_step_applies_moves_only(tiny_llama) -> None:
    runner = make_runner(tiny_llama, block_size=2, num_blocks=4)
    runner.kv_caches[0][0][1] = 3.0
    output = runner.execute(SchedulerOutput(block_copies=((1, 2),)))
    assert output.sampled_token_ids == ()
    assert torch.equal(runner.kv_caches[0][0][2], runner.kv_caches[0][0][1])


def test_bfloat16_runs_close_to_float32(tiny_llama) -> None:
    loaded = load_model(tiny_llama, dtype="bfloat16", load_tokenizer=False)
    assert loaded.dtype == torch.bfloat16
    runner = TorchModelRunner(loaded.model, block_size=16, num_blocks=8)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    driver = HandDriver(runner)
    seq = driver.add("r", PROMPTS[1])
    rows = driver.step([driver.schedule(seq, len(PROMPTS[1]))])
    expected = HFReference(tiny_llama).logits(PROMPTS[1])[-1]
    assert rows["r"].dtype == torch.float32
    assert relative_error(rows["r"], expected) < 3e-2
