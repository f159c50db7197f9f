"""``TorchModelRunner``: real weights over the paged KV cache.

One step, in the order the ``SchedulerOutput`` contract fixes::

    swap_out -> swap_in -> block copies -> forward -> logits (sampled rows only) -> sample

The model is a ``torch.nn.Module`` with the ``CausalLM`` contract (``model/base.py``).
On CPU the runner switches on the model's fast paths (``optimize_for_cpu``: packed bf16
weights, fused C++ layer ops) and keeps step-sized buffers in malloc's heap
(``allocator.keep_step_buffers``); ``optimize=False`` keeps the plain model code and
malloc's defaults.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any, TypeVar

import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.core.outputs import (
    ModelRunnerOutput,
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprob,
)
from pagedllm.kernels.ops import argmax_rows
from pagedllm.model.base import StepOutput
from pagedllm.routes import Routes
from pagedllm.worker.allocator import keep_step_buffers
from pagedllm.worker.disk_store import DiskKVStore
from pagedllm.worker.input_batch import InputBuffers, later_decode_steps
from pagedllm.worker.kv_cache import KVCacheSpec, cache_dtypes, num_blocks_from_budget
from pagedllm.worker.kv_quant import make_kv_cache
from pagedllm.worker.sampler import (
    Sampler,
    apply_token_bitmask,
    bitmask_rows,
    forbidden_argmax,
    token_logprobs,
)
from pagedllm.worker.spec_verify import accept_argmax, has_drafts, verify
from pagedllm.worker.threads import ThreadGovernor

T = TypeVar("T")


class TorchModelRunner:
    """Implements the ``ModelRunner`` Protocol (``worker/base.py``) with a torch model.

    ``model`` follows the ``model/`` contract: ``forward(input_ids, positions,
    kv_caches, meta) -> hidden`` and ``compute_logits(hidden, *, float32=True) -> logits``;
    it must carry a ``config`` (``ModelConfig``). ``kv_cache_dtype``: ``"auto"`` (the
    model's dtype), ``"float32"``, ``"bfloat16"``, ``"float16"``, or a quantized format
    (``"int8"``, ``"int4"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``: ``worker/kv_quant.py``);
    ``unquantized_first_block``: a quantized cache keeps logical block 0 in full precision.
    ``spec``: the layout the engine planned (``engine/kv_plan.py``); when given, it is the
    cache's layout and the three arguments above are not read.
    """

    # Runs ``SchedulerOutput.num_steps > 1`` (multi-step greedy decoding).
    supports_multi_step = True
    # Verifies drafts (``worker/spec_verify.py``).
    supports_speculation = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        block_size: int,
        num_blocks: int,
        num_host_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        unquantized_first_block: bool = False,
        sampler: Sampler | None = None,
        optimize: bool = True,
        spec: KVCacheSpec | None = None,
    ) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        if spec is None:
            spec = kv_cache_spec(model, block_size, kv_cache_dtype, unquantized_first_block)
        self.spec = spec
        block_size = spec.block_size
        self.kv_cache = make_kv_cache(self.spec, num_blocks, num_host_blocks, self.device)
        self.sampler = sampler or Sampler()
        self.input_buffers = InputBuffers(self.spec.layer_groups)
        self.vocab_size = self.config.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.disk_store: DiskKVStore | None = None
        self._weights_digest = _weights_digest(model)  # before any repacking of weights
        # Fewer threads while other processes contend for the cores (worker/threads.py).
        self.threads: ThreadGovernor | None = None
        if optimize and self.device.type == "cpu":
            keep_step_buffers()
            if torch.get_num_threads() > 1:
                self.threads = ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)
            model.optimize_for_cpu()

    @classmethod
    def from_budget(
        cls,
        model: torch.nn.Module,
        *,
        block_size: int = 16,
        kv_cache_memory: int | None = None,
        memory_fraction: float | None = None,
        num_host_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        unquantized_first_block: bool = False,
        sampler: Sampler | None = None,
        optimize: bool = True,
    ) -> TorchModelRunner:
        """Size the device tier from bytes or from a fraction of the free memory (the
        pool's blocks with their scales; a quantized cache's staging is not counted). For
        a runner made by hand: the engine sizes its cache in ``engine/kv_plan.py``."""
        device = next(model.parameters()).device
        spec = kv_cache_spec(model, block_size, kv_cache_dtype, unquantized_first_block)
        num_blocks = num_blocks_from_budget(
            spec, kv_cache_memory=kv_cache_memory, memory_fraction=memory_fraction, device=device
        )
        if num_blocks == 0:
            raise ValueError(
                f"the KV cache budget holds no block ({spec.bytes_per_block} bytes per block)"
            )
        return cls(
            model,
            block_size=block_size,
            num_blocks=num_blocks,
            num_host_blocks=num_host_blocks,
            sampler=sampler,
            optimize=optimize,
            spec=spec,
        )

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_cache.device_caches

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K/V on the disk tier."""
        return self.spec.bytes_per_block

    @property
    def first_block_nbytes(self) -> int | None:
        """Bytes of an unquantized first block on the disk tier (None: none kept so)."""
        return self.spec.staging_bytes_per_slot if self.spec.unquantized_first_block else None

    def kv_fingerprint(self) -> dict[str, Any]:
        """What a disk store's blocks depend on: the model (config and a digest of its
        weights) and the KV layout."""
        fingerprint = {
            "runner": "torch",
            "model": asdict(self.config),
            "weights": self._weights_digest,
            "kv_dtype": self.spec.quantization or str(self.spec.dtype),
            "block_size": self.block_size,
            "block_shape": [self.spec.num_layers, 2, *self.spec.block_shape],
        }
        if self.spec.unquantized_first_block:
            fingerprint["first_block"] = str(self.spec.dtype)  # stored unquantized
        return fingerprint

    def attach_disk_store(self, store: DiskKVStore) -> None:
        self.disk_store = store

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one device block across every per-block tensor."""
        return sum(t[0].numel() * t.element_size() for t in self.kv_cache.device_tensors)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Keep device blocks ``0 .. num_blocks - 1`` (``ResizableRunner``)."""
        self.kv_cache.resize(num_blocks)
        self.num_blocks = num_blocks

    def close(self) -> None:
        """Nothing held outside this process: the tensors go with the runner."""

    def routes(self) -> Routes:
        """The model's routes (attention, linears, decode loop, sampler) and its dtype."""
        routes = self.model.routes(self.spec.quantization)
        dtype = next(self.model.parameters()).dtype
        return replace(routes, dtype=str(dtype).removeprefix("torch."))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Swaps, copies, forward, sampling; releases finished requests' sampler state."""
        if self.threads is None:
            return self._execute(scheduler_output)
        self.threads.step_started()
        output = self._execute(scheduler_output)
        self.threads.step_finished()
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        failed_loads: tuple[int, ...] = ()
        if scheduler_output.has_block_moves:
            failed_loads = self.apply_block_moves(scheduler_output)
        if scheduler_output.released_block_ids:
            # After the moves: blocks they just wrote keep what they hold.
            written = {d for _, d in scheduler_output.block_copies}
            written.update(d for _, d in scheduler_output.swap_in)
            written.update(d for d, _, _ in scheduler_output.disk.loads if d not in failed_loads)
            self.kv_cache.release_blocks(scheduler_output.released_block_ids, keep=written)
        scheduled = scheduler_output.scheduled
        if scheduled and scheduler_output.num_steps > 1:
            output = self._execute_steps(scheduled, scheduler_output.num_steps)
        elif scheduled and any(seq.num_prompt_logprobs for seq in scheduled):
            output = self._execute_with_prompt_logprobs(scheduled, scheduler_output.token_bitmasks)
        elif scheduled:
            # A greedy fast-path batch takes its argmax on the model's dtype, inside the LM
            # head where the model can (no logits written at all), unless a grammar masks it;
            # a quantized head runs inside the layers' call (``forward_head``).
            fast = self.sampler.uses_fast_path(scheduled)
            step = self.sampled_step(scheduled, argmax=fast)
            masks = bitmask_rows(scheduled, scheduler_output.token_bitmasks)
            if fast:
                best = self._step_tokens(step).tolist()
                if masks[0]:
                    best = self._masked_argmax(step.hidden, best, *masks)
                if has_drafts(scheduled):
                    output = accept_argmax(best, scheduled)
                else:
                    output = self.sampler.greedy_from_argmax(best, scheduled)
            else:
                float32 = not self.sampler.takes_model_dtype(scheduled)
                logits = self._step_logits(step, float32=float32)
                apply_token_bitmask(logits, *masks)
                output = self._sample(logits, scheduled)
            self._settle_drafts(scheduled, output)
        else:
            output = ModelRunnerOutput(failed_loads=failed_loads)
        if failed_loads and scheduled:
            output = replace(output, failed_loads=failed_loads)
        if scheduler_output.finished_request_ids:
            self.sampler.release(scheduler_output.finished_request_ids)
        return output

    def _execute_with_prompt_logprobs(
        self, scheduled: Sequence[ScheduledSequence], token_bitmasks: Mapping[str, bytes]
    ) -> ModelRunnerOutput:
        """A step in which some sequences want their prompt tokens' logprobs: every row's
        hidden state is kept; the sampled rows go to the sampler as usual (masked by their
        grammars first), and each prompt row's logits score the prompt token after it."""
        batch = self.input_buffers.build(scheduled, self.block_size, self.device, self.num_blocks)
        with torch.inference_mode():
            hidden = self._forward(
                batch.input_ids, batch.positions, batch.meta, drafts=_num_drafts(scheduled)
            )
            logits = self._logits(hidden[batch.logits_indices], float32=True)
            apply_token_bitmask(logits, *bitmask_rows(scheduled, token_bitmasks))
            output = self._sample(logits, scheduled)
            self._settle_drafts(scheduled, output)
            prompt: list[tuple[TokenLogprob, ...] | None] = []
            row = 0
            for seq in scheduled:
                count = seq.num_prompt_logprobs
                if count:
                    start = seq.start_position
                    targets = torch.tensor(
                        seq.prompt_token_ids[start + 1 : start + 1 + count], device=self.device
                    )
                    logits = self._logits(hidden[row : row + count], float32=True)
                    k = seq.sampling_params.prompt_logprobs
                    prompt.append(tuple(token_logprobs(logits, targets, [k] * count)))
                else:
                    prompt.append(None)
                row += len(seq.token_ids)
        return replace(output, prompt_logprobs=tuple(prompt))

    def _execute_steps(
        self, scheduled: Sequence[ScheduledSequence], num_steps: int
    ) -> ModelRunnerOutput:
        """``num_steps`` greedy decode steps in a row (``SchedulerOutput.num_steps``): each
        step's argmax is the next step's input, kept as a tensor; the tokens are read back
        once, ``num_steps`` per sequence."""
        block_size = self.block_size
        for seq in scheduled:
            if len(seq.token_ids) != 1 or seq.num_samples != 1:
                raise ValueError(f"request {seq.request_id!r}: multi-step takes one-token decodes")
            if len(seq.block_table) * block_size < seq.start_position + num_steps:
                raise ValueError(
                    f"request {seq.request_id!r}: block table of {len(seq.block_table)} blocks "
                    f"cannot hold {num_steps} steps from position {seq.start_position}"
                )
        if not self.sampler.uses_fast_path(scheduled):
            raise ValueError("multi-step decoding takes plain greedy sequences only")
        batch = self.input_buffers.build(scheduled, block_size, self.device, self.num_blocks)
        later = later_decode_steps(batch, num_steps, block_size)
        with torch.inference_mode():
            step = self._forward_head(batch.input_ids, batch.positions, batch.meta, argmax=True)
            best = self._step_tokens(step)
            steps = [best]
            for positions, meta in later:
                best = self._step_tokens(self._forward_head(best, positions, meta, argmax=True))
                steps.append(best)
            tokens = torch.stack(steps, dim=1).tolist()
        return ModelRunnerOutput(tuple(map(tuple, tokens)), (None,) * len(tokens))

    def apply_block_moves(self, scheduler_output: SchedulerOutput) -> tuple[int, ...]:
        """Disk stores, swap_out, swap_in, disk loads and drops, copy-on-write copies (the
        contract's order); returns the device blocks whose disk load failed."""
        disk = scheduler_output.disk
        store = self.disk_store
        if disk and store is None:
            raise ValueError("the step has disk-tier I/O but the runner has no disk store")
        failed: tuple[int, ...] = ()
        with torch.inference_mode():
            if store is not None:
                store.save_blocks(disk.stores, self.kv_cache)
            self.kv_cache.swap_out(scheduler_output.swap_out)
            self.kv_cache.swap_in(scheduler_output.swap_in)
            if store is not None:
                failed = store.load_blocks(disk.loads, self.kv_cache)
                store.drop(disk.drops)
            self.kv_cache.copy_blocks(scheduler_output.block_copies)
        return failed

    def compute_logits(
        self, scheduled: Sequence[ScheduledSequence], *, float32: bool = True
    ) -> torch.Tensor:
        """Forward pass; float32 logits [S, vocab] for sequences with ``num_samples > 0``
        (``float32=False``: in the model's dtype, for the sampler's greedy fast path)."""
        return self._logits(self.sampled_hidden(scheduled), float32=float32)

    def row_logits(self, scheduled: Sequence[ScheduledSequence]) -> torch.Tensor:
        """Forward pass; float32 logits of every row [T, vocab] (teacher forcing: row r
        scores the token after it), whatever each sequence's ``num_samples``."""
        batch = self.input_buffers.build(scheduled, self.block_size, self.device, self.num_blocks)
        with torch.inference_mode():
            hidden = self._forward(batch.input_ids, batch.positions, batch.meta)
        return self._logits(hidden, float32=True)

    def sampled_hidden(self, scheduled: Sequence[ScheduledSequence]) -> torch.Tensor:
        """Forward pass; the final hidden states [S, hidden] of the rows that sample."""
        batch = self.input_buffers.build(scheduled, self.block_size, self.device, self.num_blocks)
        # One row per token means every sequence has one token and samples (plain decode):
        # the rows are already in order, no selection needed.
        all_rows = batch.logits_indices.numel() == batch.input_ids.numel()
        rows = None if all_rows else batch.logits_indices
        with torch.inference_mode():
            return self._forward(
                batch.input_ids, batch.positions, batch.meta, rows, _num_drafts(scheduled)
            )

    def sampled_step(self, scheduled: Sequence[ScheduledSequence], *, argmax: bool) -> StepOutput:
        """``sampled_hidden``, with the LM head's logits in the model's dtype (``argmax``:
        each row's argmax) where the model runs its head inside the layers' call
        (``forward_head``)."""
        batch = self.input_buffers.build(scheduled, self.block_size, self.device, self.num_blocks)
        all_rows = batch.logits_indices.numel() == batch.input_ids.numel()
        rows = None if all_rows else batch.logits_indices
        with torch.inference_mode():
            return self._forward_head(
                batch.input_ids,
                batch.positions,
                batch.meta,
                rows,
                _num_drafts(scheduled),
                argmax=argmax,
            )

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        drafts: Sequence[int] = (),
    ) -> torch.Tensor:
        """One forward pass; a quantized cache plans the step's writes first and frees the
        staging of the blocks it sealed once the pass succeeded. ``drafts``: each
        sequence's draft positions (a quantized cache keeps the rows of a block it seals
        over a draft until the draft is verified: ``_settle_drafts``)."""
        return self._planned(
            meta,
            drafts,
            lambda: self.model(input_ids, positions, self.kv_caches, meta, output_rows=output_rows),
        )

    def _forward_head(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        drafts: Sequence[int] = (),
        *,
        argmax: bool,
    ) -> StepOutput:
        """``_forward`` through the model's ``forward_head``."""
        return self._planned(
            meta,
            drafts,
            lambda: self.model.forward_head(
                input_ids, positions, self.kv_caches, meta, output_rows, argmax=argmax
            ),
        )

    def _planned(self, meta: AttentionMetadata, drafts: Sequence[int], run: Callable[[], T]) -> T:
        """``run()`` (a forward pass) with the cache's plan for the step made first and its
        staging freed once the pass succeeded."""
        meta.quant = self.kv_cache.plan_step(meta, drafts)
        result = run()
        self.kv_cache.finish_step()
        return result

    def _step_tokens(self, step: StepOutput) -> torch.Tensor:
        """Each row's argmax: from the step's head where it ran, else ``_best_tokens``."""
        return step.tokens if step.tokens is not None else self._best_tokens(step.hidden)

    def _step_logits(self, step: StepOutput, *, float32: bool) -> torch.Tensor:
        """The step's logits (float32 unless ``float32`` is False): its head's where it
        ran (in the model's dtype, upcast as ``compute_logits`` does), else the model's."""
        if step.logits is None:
            return self._logits(step.hidden, float32=float32)
        return step.logits.float() if float32 else step.logits

    def _sample(
        self, logits: torch.Tensor, scheduled: Sequence[ScheduledSequence]
    ) -> ModelRunnerOutput:
        """The sampler's output; with drafts, their verification (``spec_verify``)."""
        if has_drafts(scheduled):
            return verify(self.sampler, logits, scheduled)
        return self.sampler(logits, scheduled, fast_path=False)

    def _settle_drafts(
        self, scheduled: Sequence[ScheduledSequence], output: ModelRunnerOutput
    ) -> None:
        """Tell the cache how many of each sequence's positions this step verified."""
        if has_drafts(scheduled):
            self.kv_cache.settle_drafts(
                [
                    len(tokens) if seq.num_draft_tokens else len(seq.token_ids)
                    for seq, tokens in zip(scheduled, output.sampled_token_ids, strict=True)
                ]
            )

    def _logits(self, hidden: torch.Tensor, *, float32: bool) -> torch.Tensor:
        if hidden.shape[0] == 0:
            return hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        with torch.inference_mode():
            return self.model.compute_logits(hidden, float32=float32)

    def _masked_argmax(
        self, hidden: torch.Tensor, best: list[int], rows: list[int], masks: list[bytes]
    ) -> list[int]:
        """Greedy rows under a grammar: where the unmasked argmax is allowed it is the
        answer; only the rows whose argmax the mask forbids get their logits, masked."""
        redo, redo_masks = forbidden_argmax(best, rows, masks)
        if not redo:
            return best
        index = torch.tensor(redo, dtype=torch.long, device=hidden.device)
        logits = self._logits(hidden[index], float32=False)
        apply_token_bitmask(logits, range(len(redo)), redo_masks)
        for row, token in zip(redo, argmax_rows(logits).tolist(), strict=True):
            best[row] = token
        return best

    def _best_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax [S]: inside the LM head where the model offers it, else of the
        logits in the model's dtype (as the sampler's greedy fast path takes it)."""
        best = self._greedy_tokens(hidden)
        return best if best is not None else argmax_rows(self._logits(hidden, float32=False))

    def _greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax straight from the model's LM head, where it offers one."""
        if hidden.shape[0] == 0:
            return None
        with torch.inference_mode():
            return self.model.greedy_tokens(hidden)


def _num_drafts(scheduled: Sequence[ScheduledSequence]) -> tuple[int, ...]:
    """Each sequence's draft count, or () when none has drafts."""
    if not has_drafts(scheduled):
        return ()
    return tuple(seq.num_draft_tokens for seq in scheduled)


def _weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every tensor's name, shape, dtype and first and last elements: tells
    one checkpoint from another (a fine-tune of the same config included) in
    milliseconds, without reading all the weights."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            ends = torch.cat([flat[:64], flat[-64:]]).to("cpu", torch.float32)
            digest.update(ends.numpy().tobytes())
    return digest.hexdigest()


def kv_cache_spec(
    model: torch.nn.Module,
    block_size: int,
    kv_cache_dtype: str,
    unquantized_first_block: bool = False,
) -> KVCacheSpec:
    """The cache's spec for ``model`` under ``kv_cache_dtype`` (``"auto"``: the model's dtype)."""
    dtype, quantization = cache_dtypes(kv_cache_dtype, next(model.parameters()).dtype)
    return KVCacheSpec.from_model_config(
        model.config, block_size, dtype, quantization, unquantized_first_block
    )
