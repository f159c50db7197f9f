"""Engine test fixtures: a tiny tokenizer, engines on the fake runner or a tiny model,
and an autouse check that every engine's block pools end all-free."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.worker.fake_runner import FakeModelRunner

LETTERS = "abcdefghijklmnopqrstuvwxyz .,"


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from pagedllm.testing import make_tiny_tokenizer

    return make_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def letter_ids(tokenizer: Any) -> list[int]:
    return tokenizer.encode(LETTERS)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagedllm.testing import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=3)


@pytest.fixture
def engines() -> list[LLMEngine]:
    """Engines built in this test; append any you build yourself."""
    return []


@pytest.fixture(autouse=True)
def pools_end_all_free(engines: list[LLMEngine]) -> Iterator[None]:
    """After every engine test: no request left, every block (both tiers) free."""
    yield
    for engine in engines:
        engine.close()  # the disk tier's writer, where there is one
        assert not engine.has_unfinished_requests(), "a test left requests in the engine"
        engine.kv.check_invariants()
        stats = engine.kv.stats()
        assert stats.blocks_used == 0, f"{stats.blocks_used} device blocks still held"
        assert stats.host_blocks_used == 0, f"{stats.host_blocks_used} host blocks still held"


@pytest.fixture
def fake_engine(
    tokenizer: Any, letter_ids: list[int], engines: list[LLMEngine]
) -> Callable[..., LLMEngine]:
    """``fake_engine(num_blocks=..., block_size=4, host_blocks=0, **config)``."""

    def build(
        num_blocks: int = 64,
        block_size: int = 4,
        host_blocks: int = 0,
        use_sampler: bool = False,
        fail_request_ids: tuple[str, ...] = (),
        **config: Any,
    ) -> LLMEngine:
        runner = FakeModelRunner(
            num_blocks,
            block_size,
            vocab_size=len(tokenizer),
            num_host_blocks=host_blocks,
            allowed_token_ids=letter_ids,
            use_sampler=use_sampler,
            fail_request_ids=fail_request_ids,
        )
        config.setdefault("max_model_len", min(128, num_blocks * block_size))
        engine = LLMEngine(EngineConfig(block_size=block_size, **config), runner, tokenizer)
        engines.append(engine)
        return engine

    return build


def run_all(engine: LLMEngine, limit: int = 10_000) -> dict[str, Any]:
    """Step until idle; the final output of each request, by id. Checks invariants."""
    final = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return final
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        engine.kv.check_invariants()
    raise AssertionError("engine did not finish")


def run_with_resizes(
    engine: LLMEngine, schedule: dict[int, int], check: Callable[[], None] | None = None
) -> tuple[dict[str, Any], set[int]]:
    """Step until idle, starting a resize to ``schedule[step]`` blocks before those steps:
    the final output of each request by id, and every pool size seen. Checks the manager's
    invariants (and ``check``) after each step."""
    block = engine.runner.kv_block_bytes
    final: dict[str, Any] = {}
    sizes = {engine.runner.num_blocks}
    step = 0
    while engine.has_unfinished_requests():
        if step in schedule:
            engine.elastic.start(schedule[step] * block)
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        engine.kv.check_invariants()
        if check is not None:
            check()
        sizes.add(engine.runner.num_blocks)
        step += 1
    return final, sizes


@pytest.fixture
def model_engine(tiny_model_dir: Path, engines: list[LLMEngine]) -> Callable[..., LLMEngine]:
    """``model_engine(**EngineConfig fields)``: an engine on the tiny random Llama, in float32
    unless asked (the references it is compared with are float32)."""
    import torch

    # Two cores shared by many processes: more threads only oversubscribe them.
    torch.set_num_threads(1)

    def build(**config: Any) -> LLMEngine:
        config = {"dtype": "float32", **config}
        engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), **config))
        engines.append(engine)
        return engine

    return build
