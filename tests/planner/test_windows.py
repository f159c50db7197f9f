"""The planner's model of sliding windows: which layers slide (from HF configs), how the
engine groups them, and what a sequence holds in each group's blocks."""

from __future__ import annotations

import pytest

from pagedllm.planner import capacity as cap
from pagedllm.planner.presets import layer_windows, spec_from_config

BASE = {
    "num_hidden_layers": 6,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 320,
    "max_position_embeddings": 32768,
}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"model_type": "llama"}, ()),
        ({"model_type": "mistral", "sliding_window": 4096}, (4096,) * 6),
        ({"model_type": "mistral", "sliding_window": 32768}, ()),  # as wide as the context
        ({"model_type": "qwen2", "sliding_window": 64}, ()),  # use_sliding_window off
        (
            {
                "model_type": "qwen2",
                "sliding_window": 64,
                "use_sliding_window": True,
                "max_window_layers": 4,
            },
            (None,) * 4 + (64,) * 2,
        ),  # fmt: skip
        ({"model_type": "gemma2", "sliding_window": 8}, (8, None) * 3),
        ({"model_type": "gemma3_text", "sliding_window": 8}, (8,) * 5 + (None,)),
        (
            {
                "model_type": "gemma3_text",
                "sliding_window": 8,
                "layer_types": ["full_attention"] + ["sliding_attention"] * 5,
            },
            (None,) + (8,) * 5,
        ),  # fmt: skip
    ],
)
def test_layer_windows_from_configs(extra, expected) -> None:
    config = {**BASE, **extra}
    assert layer_windows(config) == expected
    assert spec_from_config(config).layer_windows == expected


def test_grouped_geometry_counts_a_window_per_sliding_group() -> None:
    spec = spec_from_config({**BASE, "model_type": "gemma3_text", "sliding_window": 64})
    assert cap.kv_bytes_per_token(spec, 4) == 6 * 256
    assert cap.block_bytes_per_token(spec, 4) == 256  # groups of one layer
    geometry = cap.model_geometry(spec, 620 * 16 * 256, 4, 16, step_tokens=1024)
    assert geometry.num_blocks == 620 and geometry.windows == (None,) + (64,) * 5
    assert geometry.usable_blocks == 619  # the placeholder
    # 527 tokens: 33 blocks in the full group; decoding, 64 / 16 + 1 in each sliding one;
    # computing the prompt in one step, all 33 in every group.
    assert geometry.sequence_blocks(527) == 33 + 5 * 5
    assert geometry.admission_blocks(527) == 6 * 33
    assert geometry.sequence_blocks(40) == 6 * 3  # shorter than the window: every block
    conc = cap.concurrency_at_length(geometry, 527, 32768)
    assert conc.paged == 1 + (619 - 198) // 58
    assert conc.contiguous_exact == (620 * 16 // 6) // 527  # every layer, contiguous
    # Chunks of 16 tokens: a prompt's step sees the window plus 16 tokens.
    chunked = cap.model_geometry(spec, 620 * 16 * 256, 4, 16, step_tokens=16)
    assert chunked.admission_blocks(527) == 33 + 5 * (-(-(63 + 16) // 16) + 1)


def test_one_group_keeps_the_plain_figures() -> None:
    spec = spec_from_config({**BASE, "model_type": "llama"})
    geometry = cap.model_geometry(spec, 1000 * 16 * 1536, 4, 16)
    assert geometry.windows == () and geometry.num_blocks == 1000
    assert cap.concurrency_at_length(geometry, 1000, 4096).paged == 1000 // 63
    mistral = spec_from_config({**BASE, "model_type": "mistral", "sliding_window": 64})
    uniform = cap.model_geometry(mistral, 1000 * 16 * 1536, 4, 16, step_tokens=16)
    assert uniform.windows == (64,) and uniform.kv_bytes_per_token == 1536
    assert uniform.sequence_blocks(4000) == 5
