"""What holding a context costs, and when to keep it, move it to a slower tier or recompute it.

A prefix of ``num_tokens`` tokens holds ``bytes = kv_bytes_per_token x num_tokens`` of KV
cache. Kept for ``seconds`` until its next use, each choice costs::

    resident    bytes x seconds x device price per GiB-second
    slower tier bytes x seconds x tier price per GiB-second
                + bytes / tier bandwidth  seconds of device time to load it back
    recompute   num_tokens / prefill tokens per second  seconds of device time

(device time at the device's price per second: a GPU-hour price spread over its memory
gives the GiB-hour price). Each cost grows or stays flat with the reuse interval, so two
break-even intervals split the line: resident below the first, the tier up to the second,
recompute beyond.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30
HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class HoldingPrices:
    """Prices and speeds the comparison needs (per hour, as providers quote them)."""

    device_hour: float  # one device (GPU) for an hour
    device_memory_bytes: int  # spread the device's price over its memory
    prefill_tokens_per_s: float | None = None  # measured or given; None: no recompute figure
    tier_gib_hour: float | None = None  # slower tier (host RAM, disk); None: no tier
    tier_gib_per_s: float = 25.0  # bandwidth back to the device (PCIe 4 x16 ~ 25 GiB/s)
    device_gib_hour: float | None = None  # overrides device_hour / memory when given

    def __post_init__(self) -> None:
        for name in ("device_hour", "tier_gib_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.device_memory_bytes <= 0:
            raise ValueError("device_memory_bytes must be positive")
        for name in ("prefill_tokens_per_s", "tier_gib_hour", "device_gib_hour"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def resident_gib_hour(self) -> float:
        if self.device_gib_hour is not None:
            return self.device_gib_hour
        return self.device_hour / (self.device_memory_bytes / GIB)

    @property
    def device_second(self) -> float:
        return self.device_hour / HOUR


@dataclass(frozen=True, slots=True)
class HoldingCost:
    """Costs of one reuse ``seconds`` after the last (currency of the prices)."""

    num_tokens: int
    bytes: int
    seconds: float
    resident: float
    tier: float | None
    tier_load_s: float | None
    recompute: float | None
    recompute_s: float | None
    resident_until_s: float  # keep it resident when reused within this (inf: always)
    tier_until_s: float | None  # ... else on the tier within this; beyond, recompute
    cheapest: str


def holding_cost(
    kv_bytes_per_token: int, num_tokens: int, seconds: float, prices: HoldingPrices
) -> HoldingCost:
    """Resident, slower tier and recompute, and the break-even reuse intervals."""
    if num_tokens < 1 or seconds < 0 or kv_bytes_per_token < 1:
        raise ValueError("num_tokens and kv_bytes_per_token must be >= 1, seconds >= 0")
    size = kv_bytes_per_token * num_tokens
    gib = size / GIB
    resident_rate = gib * prices.resident_gib_hour / HOUR  # per second held
    recompute_s = num_tokens / prices.prefill_tokens_per_s if prices.prefill_tokens_per_s else None
    recompute = recompute_s * prices.device_second if recompute_s is not None else None
    tier_rate = tier = load_s = None
    if prices.tier_gib_hour is not None:
        tier_rate = gib * prices.tier_gib_hour / HOUR
        load_s = gib / prices.tier_gib_per_s
        tier = tier_rate * seconds + load_s * prices.device_second
    resident_until, tier_until = _break_even(
        resident_rate,
        tier_rate,
        None if load_s is None else load_s * prices.device_second,
        recompute,
    )
    options = {"resident": resident_rate * seconds, "tier": tier, "recompute": recompute}
    cheapest = min((c, name) for name, c in options.items() if c is not None)[1]
    return HoldingCost(
        num_tokens,
        size,
        seconds,
        resident_rate * seconds,
        tier,
        load_s,
        recompute,
        recompute_s,
        resident_until,
        tier_until,
        cheapest,
    )


def _break_even(
    resident_rate: float,
    tier_rate: float | None,
    load_cost: float | None,
    recompute: float | None,
) -> tuple[float, float | None]:
    """(resident below this interval, tier below the second; None: no tier)."""
    inf = math.inf
    to_recompute = recompute / resident_rate if recompute is not None else inf
    if tier_rate is None or load_cost is None:
        return to_recompute, None
    # A tier dearer than the device never wins.
    to_tier = inf if tier_rate >= resident_rate else load_cost / (resident_rate - tier_rate)
    if recompute is None:
        tier_to_recompute = inf
    elif load_cost >= recompute:
        tier_to_recompute = 0.0  # loading back costs more than recomputing
    else:
        tier_to_recompute = (recompute - load_cost) / tier_rate
    if to_tier >= tier_to_recompute:  # the tier is never the cheapest
        return to_recompute, None
    return to_tier, tier_to_recompute
