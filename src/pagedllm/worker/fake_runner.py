"""A model runner with no weights, for scheduler, engine and server tests.

It keeps a *fake KV cache* holding token ids instead of keys and values: every
scheduled token is written to its slot through the block table, copies and swaps
move those ids between blocks and tiers exactly as the real runner moves K/V, and
the next token is derived from the whole context *read back through the block
table*. A paging bug (a wrong slot, a missed copy-on-write, a lost swap) therefore
changes the output, and with ``strict=True`` it raises ``PagingError`` at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pagedllm.core.outputs import (
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprob,
    position_masks,
)
from pagedllm.routes import Routes
from pagedllm.spec_decode.acceptance import num_kept

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagedllm.worker.disk_store import DiskKVStore
    from pagedllm.worker.sampler import Sampler

_MASK = (1 << 61) - 1  # a Mersenne prime: a cheap, well-mixed rolling hash
# The log-probability this runner gives a prompt token it would not have generated.
MISS_LOGPROB = -20.0


class PagingError(RuntimeError):
    """The context read back through the block table is not the sequence's tokens."""


class InjectedFailure(RuntimeError):
    """Raised on purpose (``fail_request_ids``) to test failure handling."""

    def __init__(self, request_ids: Iterable[str]) -> None:
        self.request_ids = tuple(sorted(request_ids))
        super().__init__(f"injected failure for requests {list(self.request_ids)}")


def context_hash(token_ids: Sequence[int], salt: int = 0) -> int:
    """A deterministic hash of a whole token sequence (not Python's ``hash``)."""
    h = 1469598103934665603 ^ salt
    for token in token_ids:
        h = (h * 1099511628211 + token + 1) & _MASK
    return h


class FakeModelRunner:
    """``ModelRunner`` that stores token ids in a fake paged cache.

    ``allowed_token_ids`` restricts the generated tokens (for example to printable
    bytes, so that text stays readable and EOS never appears by chance).
    ``use_sampler=True`` turns each context into a pseudo-random logits row and
    samples it with the real ``Sampler``, so that every sampling parameter works.
    ``fail_request_ids``: a step that schedules one of them raises
    ``InjectedFailure`` before touching anything. ``step_delay_s`` slows each step.
    ``kv_block_bytes`` is the size it reports for a block (the elastic pool's sizing).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        vocab_size: int = 256,
        num_host_blocks: int = 0,
        allowed_token_ids: Sequence[int] | None = None,
        use_sampler: bool = False,
        strict: bool = True,
        fail_request_ids: Iterable[str] = (),
        step_delay_s: float = 0.0,
        kv_block_bytes: int = 4096,
    ) -> None:
        self.num_blocks = num_blocks
        self.kv_block_bytes = kv_block_bytes
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.num_host_blocks = num_host_blocks
        self.allowed_token_ids = tuple(allowed_token_ids or range(vocab_size))
        self.strict = strict
        self.fail_request_ids: set[str] = set(fail_request_ids)
        self.step_delay_s = step_delay_s
        self.device_slots: list[int | None] = [None] * (num_blocks * block_size)
        self.host_slots: list[int | None] = [None] * (num_host_blocks * block_size)
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.disk_store: DiskKVStore | None = None
        self._sampler: Sampler | None = None
        if use_sampler:
            from pagedllm.worker.sampler import Sampler

            self._sampler = Sampler()

    @property
    def supports_multi_step(self) -> bool:
        """``SchedulerOutput.num_steps > 1`` runs in the deterministic mode only."""
        return self._sampler is None

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block on the disk tier (a token id per slot, int64)."""
        return 8 * self.block_size

    # Verifies drafts, deterministic or through the real sampler.
    supports_speculation = True
    # Every block in one layout.
    first_block_nbytes: int | None = None
    # Token ids in lists, no KV tensors.
    spec = None

    def kv_fingerprint(self) -> dict[str, Any]:
        return {"runner": "fake", "vocab_size": self.vocab_size, "block_size": self.block_size}

    def attach_disk_store(self, store: DiskKVStore) -> None:
        self.disk_store = store

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """Blocks as rows of int64 token ids (-1 for an empty slot), viewed as bytes."""
        import numpy as np

        bs = self.block_size
        rows = [
            [-1 if t is None else t for t in self.device_slots[b * bs : (b + 1) * bs]]
            for b in block_ids
        ]
        return np.array(rows, dtype=np.int64).reshape(len(block_ids), bs).view(np.uint8)

    def write_blocks(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        import numpy as np

        bs = self.block_size
        rows = np.ascontiguousarray(data).view(np.int64).reshape(len(block_ids), bs)
        for block_id, row in zip(block_ids, rows.tolist(), strict=True):
            self.device_slots[block_id * bs : (block_id + 1) * bs] = [
                None if t == -1 else t for t in row
            ]

    def routes(self) -> Routes | None:
        """None: no model runs here."""
        return None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        failing = {s.request_id for s in scheduler_output.scheduled} & self.fail_request_ids
        if failing:
            raise InjectedFailure(failing)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self._sampler is not None:
            self._sampler.release(scheduler_output.finished_request_ids)
        disk, store = scheduler_output.disk, self.disk_store
        if disk and store is None:
            raise ValueError("the step has disk-tier I/O but the runner has no disk store")
        if store is not None:
            store.save_blocks(disk.stores, self)
        for device_block, host_block in scheduler_output.swap_out:
            self._move(self.device_slots, device_block, self.host_slots, host_block)
        for host_block, device_block in scheduler_output.swap_in:
            self._move(self.host_slots, host_block, self.device_slots, device_block)
        failed_loads: tuple[int, ...] = ()
        if store is not None:
            failed_loads = store.load_blocks(disk.loads, self)
            store.drop(disk.drops)
        for src, dst in scheduler_output.block_copies:
            self._move(self.device_slots, src, self.device_slots, dst)
        if scheduler_output.num_steps > 1:
            output = self._multi_step(scheduler_output)
        else:
            contexts = [self._forward(seq) for seq in scheduler_output.scheduled]
            self.num_steps += 1
            masks = scheduler_output.token_bitmasks
            if self._sampler is not None:
                output = self._sample(contexts, scheduler_output.scheduled, masks)
            else:
                output = self._deterministic(contexts, scheduler_output.scheduled, masks)
            if any(seq.num_prompt_logprobs for seq in scheduler_output.scheduled):
                prompt = tuple(self._prompt_logprobs(s) for s in scheduler_output.scheduled)
                output = replace(output, prompt_logprobs=prompt)
        return replace(output, failed_loads=failed_loads) if failed_loads else output

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Keep blocks ``0 .. num_blocks - 1``; new blocks hold nothing (``ResizableRunner``)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        size = num_blocks * self.block_size
        del self.device_slots[size:]
        self.device_slots.extend([None] * (size - len(self.device_slots)))
        self.num_blocks = num_blocks

    def close(self) -> None:
        """Nothing held outside this object."""

    def next_token(self, context: Sequence[int], sample_index: int = 0) -> int:
        """The token this runner generates after ``context`` (used by tests as a
        reference: a sequence's expected output is a fold of this function)."""
        h = context_hash(context, salt=sample_index)
        return self.allowed_token_ids[h % len(self.allowed_token_ids)]

    # ------------------------------------------------------------------ internals

    def _move(self, src_slots: list, src: int, dst_slots: list, dst: int) -> None:
        bs = self.block_size
        dst_slots[dst * bs : (dst + 1) * bs] = src_slots[src * bs : (src + 1) * bs]

    def _slot(self, block_table: Sequence[int], position: int) -> int:
        return (
            block_table[position // self.block_size] * self.block_size + position % self.block_size
        )

    def _forward(self, seq: ScheduledSequence) -> list[int]:
        """Write this step's tokens, then read the whole context back."""
        for offset, token in enumerate(seq.token_ids):
            self.device_slots[self._slot(seq.block_table, seq.start_position + offset)] = token
        self.num_tokens_computed += len(seq.token_ids)
        if seq.num_samples == 0:
            return []
        end = seq.start_position + len(seq.token_ids)
        context = [self.device_slots[self._slot(seq.block_table, p)] for p in range(end)]
        if self.strict:
            expected = [*seq.prompt_token_ids, *seq.output_token_ids]
            expected += seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :]
            if context != expected[:end]:
                raise PagingError(
                    f"request {seq.request_id!r}: context read through block table "
                    f"{list(seq.block_table)} differs from its tokens"
                )
        return [-1 if t is None else t for t in context]

    def _prompt_logprobs(self, seq: ScheduledSequence) -> tuple[TokenLogprob, ...] | None:
        """The prompt tokens this chunk scores, as this runner's certain model sees them:
        the token it would generate after the context (read back through the block table)
        has log-probability 0, any other ``MISS_LOGPROB`` with rank 2. The top-k, as a real
        sampler gives k: that token, then the lowest other ids (ties at rank 2)."""
        count = seq.num_prompt_logprobs
        if not count:
            return None
        end = seq.start_position + count
        context = [self.device_slots[self._slot(seq.block_table, p)] for p in range(end)]
        k = seq.sampling_params.prompt_logprobs if seq.sampling_params else 0
        result = []
        for p in range(seq.start_position, end):
            predicted = self.next_token([-1 if t is None else t for t in context[: p + 1]])
            actual = seq.prompt_token_ids[p + 1]
            hit = actual == predicted
            top = _certain_top(predicted, k)
            result.append(TokenLogprob(actual, 0.0 if hit else MISS_LOGPROB, 1 if hit else 2, *top))
        return tuple(result)

    def _multi_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """``num_steps`` decode steps per sequence, each token the next step's input (as
        ``TorchModelRunner`` runs them)."""
        if self._sampler is not None:
            raise ValueError("multi-step decoding takes greedy decodes; this runner samples")
        sampled = []
        for seq in scheduler_output.scheduled:
            tokens: list[int] = []
            step = seq
            for _ in range(scheduler_output.num_steps):
                token = self.next_token(self._forward(step))
                tokens.append(token)
                step = step._replace(
                    token_ids=(token,),
                    start_position=step.start_position + 1,
                    output_token_ids=[*step.output_token_ids, token],
                )
            sampled.append(tuple(tokens))
        self.num_steps += scheduler_output.num_steps
        return ModelRunnerOutput(tuple(sampled), (None,) * len(sampled))

    def _deterministic(
        self,
        contexts: list[list[int]],
        scheduled: Sequence[ScheduledSequence],
        token_bitmasks: Mapping[str, bytes],
    ) -> ModelRunnerOutput:
        sampled, logprobs = [], []
        for context, seq in zip(contexts, scheduled, strict=True):
            mask = token_bitmasks.get(seq.request_id)
            if seq.num_draft_tokens:
                tokens = self._verify(context, seq, mask)
            else:
                tokens = tuple(
                    _first_allowed(self.next_token(context, j), mask, self.vocab_size)
                    for j in range(seq.num_samples)
                )
            sampled.append(tokens)
            k = seq.sampling_params.logprobs if seq.sampling_params is not None else None
            if k is None or not tokens:
                logprobs.append(None)
            else:
                logprobs.append(tuple(_certain(t, k) for t in tokens))
        return ModelRunnerOutput(sampled_token_ids=tuple(sampled), logprobs=tuple(logprobs))

    def _verify(
        self, context: list[int], seq: ScheduledSequence, mask: bytes | None
    ) -> tuple[int, ...]:
        """A speculating sequence's tokens: the drafts this runner would have generated
        too, then its own next token (``context`` ends with the drafts); each position
        under its own grammar mask."""
        positions = seq.num_draft_tokens + 1
        first = len(context) - seq.num_draft_tokens  # the context of the first position
        masks = position_masks(mask, positions)
        tokens = [
            _first_allowed(self.next_token(context[: first + j]), masks[j], self.vocab_size)
            for j in range(positions)
        ]
        return tuple(tokens[: num_kept(tokens, seq.token_ids[1:])])

    def _sample(
        self,
        contexts: list[list[int]],
        scheduled: Sequence[ScheduledSequence],
        token_bitmasks: Mapping[str, bytes],
    ) -> ModelRunnerOutput:
        rows = [
            self._logits_row(context[: len(context) - seq.num_draft_tokens + j])
            for context, seq in zip(contexts, scheduled, strict=True)
            if seq.num_samples
            for j in range(seq.num_draft_tokens + 1)
        ]
        import torch

        from pagedllm.worker.sampler import apply_token_bitmask, bitmask_rows

        assert self._sampler is not None
        logits = torch.stack(rows) if rows else torch.empty(0, self.vocab_size)
        apply_token_bitmask(logits, *bitmask_rows(scheduled, token_bitmasks))
        if any(seq.num_draft_tokens for seq in scheduled):
            from pagedllm.worker.spec_verify import verify

            return verify(self._sampler, logits, scheduled)
        return self._sampler(logits, scheduled)

    def _logits_row(self, context: list[int]) -> torch.Tensor:
        """Pseudo-random logits seeded by the context, peaked on ``next_token``."""
        import torch

        generator = torch.Generator().manual_seed(context_hash(context) % (2**63))
        row = torch.randn(self.vocab_size, generator=generator)
        allowed = torch.full((self.vocab_size,), float("-inf"))
        allowed[list(self.allowed_token_ids)] = 0.0
        row = row + allowed
        row[self.next_token(context)] += 4.0
        return row


def _first_allowed(token_id: int, mask: bytes | None, vocab_size: int) -> int:
    """``token_id`` if the grammar's mask allows it (or there is none), else the next
    allowed id after it, wrapping around: still a function of the context alone."""
    if mask is None:
        return token_id
    for offset in range(vocab_size):
        candidate = (token_id + offset) % vocab_size
        if mask[candidate // 8] >> (candidate % 8) & 1:
            return candidate
    return token_id  # nothing allowed: the grammar reports the token it rejects


def _certain_top(token_id: int, k: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The top-k of a distribution certain of ``token_id``: it, then the lowest other ids."""
    others = [t for t in range(k) if t != token_id][: max(k - 1, 0)]
    return (token_id, *others)[:k], (0.0, *[MISS_LOGPROB] * len(others))[:k]


def _certain(token_id: int, k: int) -> TokenLogprob:
    return TokenLogprob(token_id, 0.0, 1, *_certain_top(token_id, k))
