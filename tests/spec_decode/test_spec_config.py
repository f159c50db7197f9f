"""``SpeculativeConfig``: vLLM's keys, validated, with errors that name the key."""

from __future__ import annotations

import pytest

from pagedllm.spec_decode.config import SpeculativeConfig


def test_defaults_and_json_round_trip():
    config = SpeculativeConfig.from_value('{"method": "suffix", "num_speculative_tokens": 8}')
    assert config.method == "suffix" and config.num_speculative_tokens == 8
    assert SpeculativeConfig.from_value(config.to_json()) == config
    assert SpeculativeConfig.from_value(config) is config


def test_one_lookup_size_alone_stands_for_both_ends():
    assert SpeculativeConfig.from_value({"prompt_lookup_max": 1}).prompt_lookup_min == 1
    config = SpeculativeConfig.from_value({"prompt_lookup_min": 7})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (7, 7)


@pytest.mark.parametrize(
    "value,field",
    [
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 16}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"prompt_lookup_max": "5"}, "prompt_lookup_max"),
        ({"suffix_decoding_min_token_prob": 0}, "suffix_decoding_min_token_prob"),
        ({"draft_model": "x"}, "draft_model"),
        ("{not json", "JSON"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_values_name_their_key(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_value(value)
