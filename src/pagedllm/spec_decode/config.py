"""``SpeculativeConfig``: what ``--speculative-config`` / ``LLM(speculative_config=...)``
takes, with vLLM's keys (pure Python, validated once, frozen).

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8}

``num_speculative_tokens`` is the most drafts a sequence takes per step: the decode
kernel takes queries of up to 16 tokens, the last sampled token and 15 drafts. The
automatic mode (``engine/speculator.py``) gives each sequence fewer, or none, where they
would not pay.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix")
# The decode kernel's longest query (attention/cpu.py MAX_KERNEL_QUERY_LEN), less the
# sampled token that leads each verification.
MAX_SPECULATIVE_TOKENS = 15
DEFAULT_LOOKUP_MIN = 2
DEFAULT_LOOKUP_MAX = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (off when an engine has none).

    ``method``: ``ngram`` (prompt lookup over the sequence's own prompt and output) or
    ``suffix`` (the same, and a bounded pool of recent requests of the same tenant:
    ``cache_salt``). ``prompt_lookup_min`` / ``max``: the n-gram sizes matched, the longest
    first. ``suffix_decoding_max_cached_requests``: the pool's bound, per tenant;
    ``suffix_decoding_min_token_prob``: a suffix draft stops at the first token fewer than
    this share of the matches continue with. ``automatic``: each step, draft only where
    the measured cost of a draft token is below its expected gain (False: always the
    ``num_speculative_tokens`` a proposer finds, for tests and measurements).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    suffix_decoding_max_cached_requests: int = 64
    suffix_decoding_min_token_prob: float = 0.1
    automatic: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {METHODS}, got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min must be at most prompt_lookup_max, got "
                f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
            )
        _check_int(
            "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0
        )
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, int | float) or not 0.0 < prob <= 1.0:
            raise ValueError(
                f"speculative_config.suffix_decoding_min_token_prob must be in (0, 1], got {prob!r}"
            )
        if not isinstance(self.automatic, bool):
            raise ValueError(f"speculative_config.automatic must be a bool, got {self.automatic!r}")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a config, a dict of its keys, or their JSON object; ``ValueError`` names an
        unknown key or a bad value."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        given = dict(value)
        # One lookup size given alone moves the other's default out of its way.
        low, high = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
        if high is None and _is_int(low):
            given["prompt_lookup_max"] = max(DEFAULT_LOOKUP_MAX, low)
        if low is None and _is_int(high):
            given["prompt_lookup_min"] = min(DEFAULT_LOOKUP_MIN, high)
        return cls(**given)

    def to_json(self) -> str:
        """The JSON object ``from_value`` reads back (a replica's command line repeats it)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})

    def __str__(self) -> str:
        return self.to_json()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise ValueError(
            f"speculative_config.{name} must be an integer >= {minimum}, got {value!r}"
        )
