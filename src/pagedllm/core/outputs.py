"""Plain frozen records that cross from the scheduler to the worker and back.

Nothing here holds a tensor: the worker is the only place block ids become tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.core.tiers import NO_DISK_OPS, DiskOps

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams


class ScheduledSequence(NamedTuple):
    """One sequence's share of a step.

    The worker computes K/V for ``token_ids`` at positions
    ``start_position .. start_position + len(token_ids) - 1`` and writes them to
    the slots given by ``block_table`` (slot of position p:
    ``block_table[p // block_size] * block_size + p % block_size``). The context
    the new tokens attend to is positions ``0 .. start_position + len - 1``.

    ``num_samples`` is 0 for a prompt chunk that is not the last one (no logits
    needed), 1 for a normal decode or last prompt chunk, and ``n`` when a parent
    of n parallel samples finishes its prompt (the sampler draws n tokens from
    the same logits; the scheduler then forks n-1 children).

    A named tuple, not a frozen dataclass: one is built per running sequence per step,
    and a frozen dataclass costs more to build (every field goes through
    ``object.__setattr__``).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    num_samples: int = 1
    sampling_params: SamplingParams | None = None
    # References (not copies) for repetition/presence/frequency penalties.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # A model whose layers are grouped by attention kind (``core/kv_groups.py``): the
    # block tables of groups 1.. (``block_table`` is group 0's); empty for one group.
    group_block_tables: tuple[tuple[int, ...], ...] = ()
    # Which parallel sample of its request this sequence is (``Request.sample_index``).
    sample_index: int = 0
    # Speculative decoding: the last ``num_draft_tokens`` of ``token_ids`` are drafts
    # (unverified guesses after the sampled token that leads them). The worker scores
    # every one of the ``1 + num_draft_tokens`` positions and returns the accepted drafts
    # and one token more (``ModelRunnerOutput.sampled_token_ids``).
    num_draft_tokens: int = 0

    @property
    def num_prompt_logprobs(self) -> int:
        """How many prompt tokens this chunk's rows score for ``prompt_logprobs``: rows at
        prompt positions ``s .. e-1`` predict tokens ``s+1 .. e`` (the last prompt token at
        most); 0 when not asked for."""
        params = self.sampling_params
        if params is None or params.prompt_logprobs is None:
            return 0
        end = min(self.start_position + len(self.token_ids), len(self.prompt_token_ids) - 1)
        return max(0, end - self.start_position)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What the worker must do this step, in this order:
    0. ``disk.stores``: read those device blocks (written to disk in the background),
    1. ``swap_out`` (device block -> host block) for requests preempted by swap,
    2. ``swap_in`` (host block -> device block) for requests resumed,
    3. ``disk.loads`` (disk -> fresh device blocks), then ``disk.drops``,
    4. ``block_copies`` (src -> dst device blocks, copy-on-write),
    5. the forward pass over ``scheduled``, then sampling.
    ``finished_request_ids`` lets the worker drop per-request state (generators);
    ``released_block_ids`` (device blocks whose contents nobody reads any more, since the
    last output: ``BlockPool.take_released``) per-block state kept outside the pool, after
    the moves and except for blocks the moves just wrote.

    ``token_bitmasks``: request id -> the tokens its next draw may take (structured
    outputs: bit ``t % 32`` of little-endian 32-bit word ``t // 32`` is token t), for the
    constrained sequences that draw this step; the worker masks their logits rows (every
    one of a parent's ``num_samples`` draws) before sampling. Empty for an unconstrained
    batch, which then pays nothing. A sequence with drafts has one mask per scored
    position, concatenated (position j's: after its first j drafts; ``position_masks``).

    ``num_steps > 1`` (multi-step decoding, ``SchedulerConfig.num_scheduler_steps``): every
    scheduled sequence is a greedy decode of one token whose block table already holds
    ``num_steps`` slots from ``start_position`` on; the worker runs ``num_steps`` forward
    passes in a row, each step's argmax the next step's input, and returns the
    ``num_steps`` tokens of each sequence in order (``sampled_token_ids[i]`` is then a
    sequence of steps, never parallel samples).
    """

    scheduled: tuple[ScheduledSequence, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    finished_request_ids: frozenset[str] = field(default_factory=frozenset)
    num_steps: int = 1
    disk: DiskOps = NO_DISK_OPS
    released_block_ids: tuple[int, ...] = ()
    token_bitmasks: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def has_block_moves(self) -> bool:
        return bool(self.block_copies or self.swap_out or self.swap_in or self.disk)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.has_block_moves)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one sampled token, with the top-k alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Aligned with ``SchedulerOutput.scheduled``: one entry per scheduled sequence.

    ``sampled_token_ids[i]`` has ``num_samples`` tokens (empty for a mid-prompt
    chunk); for a sequence with drafts, the accepted drafts and the token sampled after
    them (1 to ``num_draft_tokens + 1`` tokens). ``logprobs[i]`` is None unless the request asked for logprobs, else
    one ``TokenLogprob`` per sampled token. ``failed_loads``: device blocks of
    ``SchedulerOutput.disk.loads`` that could not be read (missing, truncated or corrupt
    on disk); their holders must be recomputed (``Scheduler.reject_loads``).
    ``prompt_logprobs`` is empty when no
    scheduled sequence asked for them, else aligned too: for a sequence whose chunk
    covers prompt positions ``s .. e-1``, one ``TokenLogprob`` for each prompt token
    ``s+1 .. min(e, num_prompt_tokens - 1)`` (predicted from the position before it);
    None for the others.
    """

    sampled_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: tuple[tuple[TokenLogprob, ...] | None, ...] = ()
    failed_loads: tuple[int, ...] = ()
    prompt_logprobs: tuple[tuple[TokenLogprob, ...] | None, ...] = ()


def position_masks(mask: bytes | None, num_positions: int) -> list[bytes | None]:
    """A ``SchedulerOutput.token_bitmasks`` entry split into its ``num_positions`` masks
    of one length (``1 + num_draft_tokens`` of them; one for a sequence without drafts)."""
    if mask is None:
        return [None] * num_positions
    size = len(mask) // num_positions
    return [mask[i * size : (i + 1) * size] for i in range(num_positions)]
