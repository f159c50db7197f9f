"""The allocator paged attention replaces, kept for measurement only.

Each sequence reserves one contiguous run of token slots at admission and keeps
it until it finishes; nothing is shared. Runs are placed first-fit over a sorted
list of free holes, and a freed run merges with its neighbours::

    slots  |AAAAAAaaaa|....|BBBbbbbbbbbbbbb|......|CCcccc|
            A: 6 tokens in a 10-slot run (4 slots internal waste)
            ....: a hole too small for the next reservation (external waste)

Policies: ``"max_len"`` reserves ``max_model_len`` slots (the engine cannot know
how long the output will be), ``"exact"`` reserves prompt + ``max_tokens``.
"""

from __future__ import annotations

import bisect

POLICIES = ("max_len", "exact")


class ContiguousAllocator:
    """``num_slots`` token slots handed out as one contiguous run per sequence."""

    def __init__(self, num_slots: int, policy: str = "max_len", max_model_len: int = 2048) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.num_slots = num_slots
        self.policy = policy
        self.max_model_len = max_model_len
        self._hole_starts: list[int] = [0]  # sorted; parallel to _hole_lengths
        self._hole_lengths: list[int] = [num_slots]
        self._runs: dict[str, tuple[int, int]] = {}  # request_id -> (start, length)
        self._num_tokens: dict[str, int] = {}

    def reservation_size(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Slots a sequence with this prompt and output limit reserves."""
        if self.policy == "max_len":
            return self.max_model_len
        return min(num_prompt_tokens + max_tokens, self.max_model_len)

    def allocate(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> int | None:
        """Reserve a run for the sequence and hold its prompt; returns the run's first
        slot, or ``None`` (no change) when no hole is large enough."""
        if request_id in self._runs:
            raise ValueError(f"request {request_id!r} already holds a run")
        if num_prompt_tokens <= 0 or max_tokens < 0:
            raise ValueError("num_prompt_tokens must be positive and max_tokens >= 0")
        size = self.reservation_size(num_prompt_tokens, max_tokens)
        if num_prompt_tokens > size:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens exceeds max_model_len")
        for i, length in enumerate(self._hole_lengths):
            if length >= size:
                start = self._hole_starts[i]
                if length == size:
                    del self._hole_starts[i], self._hole_lengths[i]
                else:
                    self._hole_starts[i] += size
                    self._hole_lengths[i] -= size
                self._runs[request_id] = (start, size)
                self._num_tokens[request_id] = num_prompt_tokens
                return start
        return None

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Record that the sequence now holds ``num_tokens``; False (no change) when
        that exceeds its reservation."""
        _, length = self._runs[request_id]
        if num_tokens > length:
            return False
        self._num_tokens[request_id] = num_tokens
        return True

    def free(self, request_id: str) -> None:
        """Return the sequence's run to the holes, merging with its neighbours."""
        run = self._runs.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        if run is None:
            return
        start, length = run
        i = bisect.bisect_left(self._hole_starts, start)
        if i < len(self._hole_starts) and start + length == self._hole_starts[i]:
            length += self._hole_lengths[i]
            del self._hole_starts[i], self._hole_lengths[i]
        if i > 0 and self._hole_starts[i - 1] + self._hole_lengths[i - 1] == start:
            self._hole_lengths[i - 1] += length
        else:
            self._hole_starts.insert(i, start)
            self._hole_lengths.insert(i, length)

    # ---- views --------------------------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return sum(self._hole_lengths)

    def free_holes(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every hole, in slot order."""
        return list(zip(self._hole_starts, self._hole_lengths, strict=True))

    def runs(self) -> dict[str, tuple[int, int]]:
        """``(start, length)`` of every live sequence's run."""
        return dict(self._runs)

    def num_tokens(self, request_id: str) -> int:
        return self._num_tokens.get(request_id, 0)

    def check_invariants(self) -> None:
        """Holes and runs tile the slots exactly; holes are merged and non-empty."""
        extents = sorted([*self.free_holes(), *self._runs.values()])
        position = 0
        for start, length in extents:
            assert start == position and length > 0, f"gap or overlap at slot {start}"
            position += length
        assert position == self.num_slots, "extents do not cover every slot"
        holes = self.free_holes()
        for (s1, l1), (s2, _) in zip(holes, holes[1:], strict=False):
            assert s1 + l1 < s2, f"adjacent holes at {s1} and {s2} were not merged"
        for request_id, (_, length) in self._runs.items():
            assert 0 < self._num_tokens[request_id] <= length
