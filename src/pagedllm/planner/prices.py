"""Provider price profiles for prompt caching, and what a log costs under each.

A profile is dated: list prices change, so every figure says which date's prices it used,
and ``load_profiles(FILE)`` replaces or adds profiles (same fields, JSON). The built-in
figures are the providers' published list prices per million input tokens as of each
profile's ``as_of`` date; check them against the provider's page before quoting money.

The model of a provider's prefix cache (automatic prefix caching, entries never expire
within the log):

    shared    = longest token prefix this request shares with an earlier one
    cached    = cacheable(shared)        0 below min_cacheable_tokens, else rounded down
                                         to min + k * cache_increment_tokens
    written   = cacheable(prompt) - cached   (the new cacheable prefix, at the write price)
    fresh     = prompt - cached - written
    cost      = (fresh * input + cached * cached_input + written * cache_write) / 1e6

Tokens are counted with the model's tokenizer (``--model``), not the provider's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class PriceProfile:
    """Per-million-token input prices of one provider model, as of a date."""

    name: str
    provider: str
    model: str
    as_of: str  # ISO date of the prices
    input_per_mtok: float  # fresh (uncached) input
    cached_input_per_mtok: float  # input read from the cache
    cache_write_per_mtok: float  # input written to the cache (the premium, if any)
    min_cacheable_tokens: int  # prompts shorter than this are never cached
    cache_increment_tokens: int = 1  # cached lengths are min + k * increment
    currency: str = "USD"
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("input_per_mtok", "cached_input_per_mtok", "cache_write_per_mtok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"price profile {self.name!r}: {name} must be a number >= 0")
        if self.min_cacheable_tokens < 0 or self.cache_increment_tokens < 1:
            raise ValueError(
                f"price profile {self.name!r}: min_cacheable_tokens must be >= 0 and "
                "cache_increment_tokens >= 1"
            )

    def cacheable(self, num_tokens: int) -> int:
        """The longest cacheable length not above ``num_tokens``."""
        minimum = max(self.min_cacheable_tokens, 1)
        if num_tokens < minimum:
            return 0
        step = self.cache_increment_tokens
        return minimum + (num_tokens - minimum) // step * step

    def request_cost(self, prompt_tokens: int, shared_tokens: int) -> RequestCost:
        """The input cost of one request sharing ``shared_tokens`` with an earlier one."""
        cached = self.cacheable(min(shared_tokens, prompt_tokens))
        written = max(0, self.cacheable(prompt_tokens) - cached)
        fresh = prompt_tokens - cached - written
        money = (
            fresh * self.input_per_mtok
            + cached * self.cached_input_per_mtok
            + written * self.cache_write_per_mtok
        ) / 1e6
        return RequestCost(fresh, cached, written, money)


@dataclass(frozen=True, slots=True)
class RequestCost:
    fresh_tokens: int
    cached_tokens: int
    written_tokens: int
    cost: float


BUILTIN_PROFILES: tuple[PriceProfile, ...] = (
    PriceProfile(
        "openai-gpt-4.1",
        "OpenAI",
        "gpt-4.1",
        "2025-04-14",
        2.00,
        0.50,
        2.00,
        1024,
        128,
        source="https://openai.com/api/pricing/ (automatic caching from 1,024 tokens, 128-token steps)",
    ),
    PriceProfile(
        "anthropic-claude-sonnet-4",
        "Anthropic",
        "claude-sonnet-4",
        "2025-05-22",
        3.00,
        0.30,
        3.75,
        1024,
        1,
        source="https://www.anthropic.com/pricing (5-minute cache writes at 1.25x; a cache "
        "breakpoint at the end of each prompt assumed)",
    ),
    PriceProfile(
        "deepseek-chat",
        "DeepSeek",
        "deepseek-chat (V3)",
        "2025-02-09",
        0.27,
        0.07,
        0.27,
        64,
        64,
        source="https://api-docs.deepseek.com/quick_start/pricing (disk cache in 64-token units)",
    ),
    PriceProfile(
        "google-gemini-2.5-flash",
        "Google",
        "gemini-2.5-flash",
        "2025-06-17",
        0.30,
        0.075,
        0.30,
        1024,
        1,
        source="https://ai.google.dev/gemini-api/docs/pricing (implicit caching from 1,024 tokens)",
    ),
)


def builtin_profiles() -> dict[str, PriceProfile]:
    return {p.name: p for p in BUILTIN_PROFILES}


def load_profiles(path: str | Path | None = None) -> dict[str, PriceProfile]:
    """The built-in profiles, with those of ``path`` (a JSON list, or {"profiles": [...]})
    replacing same-named ones and adding the rest."""
    profiles = builtin_profiles()
    if path is None:
        return profiles
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"price file {path}: {exc}") from None
    if isinstance(data, dict):
        data = data.get("profiles")
    if not isinstance(data, list):
        raise ValueError(
            f"price file {path}: expected a list of profiles (or {{'profiles': [...]}})"
        )
    for entry in data:
        profile = profile_from_dict(entry, base=profiles)
        profiles[profile.name] = profile
    return profiles


def profile_from_dict(entry: Any, base: Mapping[str, PriceProfile] | None = None) -> PriceProfile:
    """A profile from a JSON object; fields missing from an entry named like a known
    profile are taken from it (so a file may change just one price)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ValueError("each price profile needs a string 'name'")
    known = {f.name for f in fields(PriceProfile)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"price profile {entry['name']!r}: unknown fields {unknown}")
    merged = dict(asdict(base[entry["name"]])) if base and entry["name"] in base else {}
    merged.update(entry)
    missing = sorted(known - set(merged) - {"cache_increment_tokens", "currency", "source"})
    if missing:
        raise ValueError(f"price profile {entry['name']!r}: missing {missing}")
    try:
        return PriceProfile(**merged)
    except TypeError as exc:
        raise ValueError(f"price profile {entry['name']!r}: {exc}") from None


def log_cost(
    profile: PriceProfile, prompt_tokens: Sequence[int], shared_tokens: Iterable[int]
) -> float:
    """The input cost of a whole log under ``profile``."""
    return sum(
        profile.request_cost(p, s).cost for p, s in zip(prompt_tokens, shared_tokens, strict=True)
    )
