"""The prompt slice of a step that also decodes, sized in time instead of tokens.

Every decoding stream waits for the whole step, so the prompt tokens a decoding step takes
set the streams' inter-token gaps. A fixed token count means very different gaps on
different machines and dtypes, so the server gives a time instead:
``PrefillSliceTuner`` watches the steps' durations and keeps the cap at the power of two of
prompt tokens nearest to ``target_s`` of prompt work.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# Steps with fewer prompt tokens than this say too little about a token's cost.
MIN_SAMPLE_TOKENS = 16
SMALLEST_CAP = 16
# Weight of the newest step in the running estimates.
SMOOTHING = 0.25


class PrefillSliceTuner:
    """Estimates a decode step's time and a prompt token's extra time from the steps it is
    shown (exponential moving averages), and answers the prompt-token cap that keeps a
    decoding step's prompt work near ``target_s``: a power of two between ``SMALLEST_CAP`` and
    ``largest``. ``clock`` (seconds) times the steps between ``start_step`` and ``end_step``;
    tests give a fake one."""

    def __init__(
        self, target_s: float, largest: int, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if not target_s > 0:
            raise ValueError(f"the prompt slice's time must be positive, got {target_s!r}")
        if largest < SMALLEST_CAP:
            raise ValueError(f"largest cap must be at least {SMALLEST_CAP}, got {largest}")
        self.target_s = target_s
        self.largest = largest
        self.clock = clock
        self.decode_s: float | None = None  # a step without prompt tokens
        self.token_s: float | None = None  # one prompt token beyond that
        self._started: float | None = None

    def start_step(self) -> None:
        """A step to be timed starts now."""
        self._started = self.clock()

    def end_step(self, prompt_tokens: int, num_steps: int = 1) -> None:
        """The step ``start_step`` began has ended: ``num_steps`` forwards, each with
        ``prompt_tokens`` of prompt work, observed at their mean time."""
        assert self._started is not None, "end_step without start_step"
        seconds = self.clock() - self._started
        self._started = None
        self.observe(prompt_tokens, seconds / num_steps)

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """One step: ``prompt_tokens`` of prompt work (the rest decodes), ``seconds`` long."""
        if prompt_tokens == 0:
            self.decode_s = _smooth(self.decode_s, seconds)
        elif prompt_tokens >= MIN_SAMPLE_TOKENS:
            extra = max(seconds - (self.decode_s or 0.0), 0.0)
            self.token_s = _smooth(self.token_s, extra / prompt_tokens)

    def cap(self) -> int | None:
        """The cap for the next steps; None until a prompt step has been seen."""
        if self.token_s is None:
            return None
        if self.token_s <= 0:
            return self.largest
        tokens = self.target_s / self.token_s
        nearest = 2 ** round(math.log2(max(tokens, 1.0)))
        return int(min(max(nearest, SMALLEST_CAP), self.largest))


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
