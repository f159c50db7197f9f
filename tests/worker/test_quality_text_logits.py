"""text_logits (worker/quality.py) on a model whose layers fall into several KV cache groups
(Gemma 3: sliding-window layers beside full ones, core/kv_groups.py): each group gets its own
blocks, and the text fed in chunks gives the logits of one whole-text step."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.loader import load_model
from pagedllm.testing import make_tiny_checkpoint
from pagedllm.worker.model_runner import TorchModelRunner
from pagedllm.worker.quality import kv_groups, text_logits

TOKENS = 40
BLOCK = 4
# Gemma 3's pattern: two window layers, one full: three groups of one layer each.
LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]


def tiny_gemma(tmp_path) -> torch.nn.Module:
    path = make_tiny_checkpoint(
        tmp_path / "gemma",
        "gemma3_text",
        seed=5,
        sliding_window=8,
        num_hidden_layers=3,
        layer_types=LAYERS,
    )
    return load_model(str(path), "float32", load_tokenizer=False).model


def runner_for(model: torch.nn.Module, blocks: int) -> TorchModelRunner:
    return TorchModelRunner(model, block_size=BLOCK, num_blocks=blocks)


def test_grouped_model_in_chunks_matches_one_step(tmp_path) -> None:
    model = tiny_gemma(tmp_path)
    ids = torch.randint(
        0, model.config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(5)
    )
    ids = ids.tolist()
    groups = kv_groups(runner_for(model, 1))
    assert groups == 3
    blocks = -(-TOKENS // BLOCK) * groups
    whole = text_logits(runner_for(model, blocks), ids, chunk=TOKENS)
    chunked = text_logits(runner_for(model, blocks), ids, chunk=8)
    assert whole.shape == (TOKENS - 1, model.config.vocab_size)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)


def test_too_few_blocks_for_every_group_is_refused(tmp_path) -> None:
    model = tiny_gemma(tmp_path)
    with pytest.raises(ValueError, match="blocks"):
        text_logits(runner_for(model, -(-TOKENS // BLOCK)), list(range(TOKENS)))
