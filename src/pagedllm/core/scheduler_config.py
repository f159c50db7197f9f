"""The scheduler's limits: one step's budget, and how to preempt (``core/scheduler.py``)."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step, and how to preempt."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    preemption_mode: str = "auto"
    enable_chunked_prefill: bool = True
    # Up to this many greedy decode steps per schedule (multi-step decoding, see
    # ``Scheduler.schedule``); 1 schedules every step.
    num_scheduler_steps: int = 1
    # A waiting request whose next uncached block a running request computes waits for it
    # (``_schedule_waiting``); only with prefix caching.
    enable_inflight_sharing: bool = True
    # Most prompt tokens in a step that also decodes (None: the step's budget): the decoding
    # requests wait for the whole step, so a smaller slice shortens their longest gaps
    # (tail inter-token latency); steps without decodes keep the full budget.
    max_prefill_tokens_while_decoding: int | None = None
    # A request arriving pins the blocks of its cached prefix while it waits, so that
    # eviction cannot take them from under it (``KVCacheManager.pin_prefix``); a pin gives
    # way to any allocation that needs its room (``Scheduler._give_up_pins``).
    pin_waiting_prefixes: bool = True

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "num_scheduler_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(
                f"max_prefill_tokens_while_decoding must be a positive integer, got {cap!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled"
            )
