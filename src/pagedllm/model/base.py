"""What the runner needs of a model (``CausalLM``) and what a model needs of its fast path
(``FastPath``): the contracts between ``worker/model_runner.py``, the decoders
(``llama.py``, ``decoder.py``, ``tensor_parallel.py``) and ``fast_path.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from pagedllm.attention.base import AttentionMetadata
from pagedllm.model.config import ModelConfig
from pagedllm.routes import Routes

# One (key, value) cache tensor pair per layer.
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class StepHead(NamedTuple):
    """The LM head a fast path may run inside its one-call layer loop, after the final norm
    (``kernels/csrc/step_head.h``): a block-quantized weight in the kernels' layout, its GGML
    type and bias; ``argmax``: each row's argmax instead of its logits (a greedy batch)."""

    weight: torch.Tensor
    format: int
    bias: torch.Tensor | None
    argmax: bool


class StepOutput(NamedTuple):
    """A forward pass with its head (``forward_head``): the final-normed hidden states and,
    where the head ran inside the layers' call, its logits in the model's dtype
    ([S, vocab]; asked without ``argmax``) or each row's argmax (int64 [S]); None where it
    did not run (the caller then uses ``compute_logits`` on the hidden states)."""

    hidden: torch.Tensor
    logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


class FastPath(Protocol):
    """A faster way to run the model's decoder on this machine, with the model's results."""

    def forward_head(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None,
        head: StepHead | None,
    ) -> StepOutput:
        """The embedded tokens [T, hidden] -> final-normed hidden states, as the model's own
        forward (only ``output_rows`` when given), and ``head`` (if any) inside the same
        call where the one-call loop takes the step (else only the hidden states)."""
        ...

    def runs_head(self) -> bool:
        """Whether ``forward_head`` can run a head inside a one-call loop (for the routes)."""
        ...

    def route(self, kv_quantization: str | None = None) -> str:
        """How a decode step's layers run (for ``Routes.decode_loop``), over a cache quantized
        as ``kv_quantization`` if given."""
        ...


# (the model, its linears already packed; the C++ layer ops or None) -> its fast path, or
# None where this CPU or the model's dtype has none.
FastPathBuilder = Callable[[Any, Any], FastPath | None]


class CausalLM(Protocol):
    """A decoder with its LM head, as the model runner drives it."""

    config: ModelConfig

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states (only ``output_rows``
        when given)."""
        ...

    def forward_head(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
        *,
        argmax: bool,
    ) -> StepOutput:
        """The forward pass, with the LM head's logits in the model's dtype (``argmax``:
        each row's argmax instead) where the model runs its head inside the layers' call;
        else the hidden states alone. The same logits and argmax as ``compute_logits(hidden,
        float32=False)``."""
        ...

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] (float32 unless asked otherwise)."""
        ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax from inside the LM head, or None where the model has no such
        kernel (then the argmax of ``compute_logits``)."""
        ...

    def optimize_for_cpu(self) -> None:
        """Pack the linears for this CPU's kernels and switch on any fast path; a no-op
        elsewhere."""
        ...

    def routes(self, kv_quantization: str | None = None) -> Routes:
        """Which implementation runs each capability of this model's steps;
        ``kv_quantization``: the cache's quantized format, if any (its attention runs
        through another kernel)."""
        ...
