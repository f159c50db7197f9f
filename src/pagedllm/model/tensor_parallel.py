"""Tensor parallelism for the Llama-family decoder, bit-identical to one rank.

Each of N ranks holds 1/N of every weight and its KV heads' share of every KV block (the
same block ids on every rank). No reduction is ever split across ranks: every output
element is computed whole by one rank, as one rank computes it, and the pieces are only
*gathered* (concatenated in rank order), so TP=N gives TP=1's float32 logits exactly::

    x (replicated) --qkv cols--> my q/k/v heads --attention--> my heads' out
        --all-gather--> all heads' out --o cols--> my hidden cols --all-gather--> hidden
    norm --gate/up cols--> my intermediate slice --all-gather--> intermediate
        --down cols--> my hidden cols --all-gather--> hidden
    embedding: my vocabulary rows, zeros elsewhere; gathered and added in rank order
    LM head: my vocabulary's logits --all-gather--> every logit

Megatron's row-parallel o/down layers would all-reduce partial sums instead (less data
moved: one all-reduce of ``[T, hidden]`` a layer against gathers of ``[T, heads x dim]``,
``[T, intermediate]`` and twice ``[T, hidden]``), but a sum split in two rounds differently
from the single matmul. The column split relies on a linear kernel computing each output
column the same whatever the others: true of ``small_gemm`` and of MKL's sgemm for shards
in whole 16-column tiles (``tests/model/test_tensor_parallel.py`` checks it on every
family): the vocabulary is cut on 16-column boundaries, the other sizes in equal parts.

Steps run through the same fused C++ ops as the single-rank fast path where this CPU has
them (``fast_path.CpuFastPath`` with a ``gather``), else through the modules
(``GatheredLinear``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.base import AttentionMetadata
from pagedllm.kernels.linear import LinearTensors, linear, small_rows
from pagedllm.kernels.quant import dequantize
from pagedllm.kernels.routes import sampled_route
from pagedllm.model.base import KVCaches, StepOutput
from pagedllm.model.llama import Linear, LlamaForCausalLM, head_tensors, packed_table
from pagedllm.routes import Routes

SHARD_ALIGN = 16  # output columns per tile of the linear kernels: shards start on one


class Collective(Protocol):
    """What tensor parallelism needs from the ranks' process group."""

    rank: int
    world_size: int
    kind: str  # how the pieces travel, in the routes' words ("gloo", "shared memory", ...)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on all ranks), in rank order."""
        ...


def check_divisible(config: Any, world_size: int) -> None:
    """``ValueError`` naming the model's sizes when they cannot be split ``world_size`` ways."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    for name, size in (
        ("num_key_value_heads", config.num_key_value_heads),
        ("num_attention_heads", config.num_attention_heads),
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
    ):
        if size % world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} does not divide the model's {name} "
                f"({size}); choose a size that divides it"
            )


def check_supported(model: nn.Module, world_size: int) -> None:
    """``ValueError`` unless ``model`` can run split ``world_size`` ways: the Llama-family
    decoder (Llama, Mistral, Qwen2, Qwen3) with sizes that divide."""
    if not isinstance(model, LlamaForCausalLM):
        arch = getattr(getattr(model, "config", None), "architecture", type(model).__name__)
        raise ValueError(
            f"tensor parallelism covers the Llama-family decoder (Llama, Mistral, Qwen2, "
            f"Qwen3), not {arch}"
        )
    check_divisible(model.config, world_size)


def shard_range(size: int, world_size: int, rank: int, align: int = 1) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` of ``size`` rows split ``world_size`` ways, each
    shard a multiple of ``align`` (the last takes what is left)."""
    step = -(-size // world_size)
    step = -(-step // align) * align
    start = min(size, rank * step)
    return start, min(size, start + step)


def gather_cat(comm: Collective, x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension, in rank order."""
    if comm.world_size == 1:
        return x
    return torch.cat(comm.all_gather(x.contiguous()), dim=-1)


def gather_padded(comm: Collective, x: torch.Tensor, width: int, total: int) -> torch.Tensor:
    """``gather_cat`` for shards of unequal width: each padded to ``width`` columns, the
    result cut back to each rank's own columns (``total`` in all)."""
    if comm.world_size == 1:
        return x
    pad = width - x.shape[-1]
    parts = comm.all_gather(F.pad(x, (0, pad)) if pad else x.contiguous())
    sizes = [shard_range(total, comm.world_size, r, SHARD_ALIGN) for r in range(comm.world_size)]
    return torch.cat([p[..., : stop - start] for p, (start, stop) in zip(parts, sizes)], dim=-1)


class GatheredLinear(nn.Module):
    """A linear whose input arrives split by ranks and whose output columns are split by
    ranks: gather the input, compute my columns with the whole reduction, gather them."""

    def __init__(self, shard: Linear, comm: Collective) -> None:
        super().__init__()
        self.shard = shard
        self.comm = comm

    @property
    def tensors(self) -> LinearTensors:
        return self.shard.tensors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_cat(self.comm, self.shard(gather_cat(self.comm, x)))


class VocabEmbedding(nn.Module):
    """My vocabulary rows of the embedding; other tokens embed to zeros, and the ranks'
    rows are added in rank order (one of them is the token's, the others exact zeros)."""

    quant = None  # a shard is float (``head_tensors`` asks every embedding)
    small: torch.Tensor | None = None  # the tied head's packed shard, once it replaces mine

    def __init__(self, weight: torch.Tensor, start: int, comm: Collective) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.num_rows = weight.shape[0]
        self.start = start
        self.comm = comm

    def read_from_packed(self, small: torch.Tensor) -> None:
        """Look rows up in the tied head's small_gemm copy of this shard (its only copy)."""
        self.small = packed_table(self.weight, small)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.num_rows)
        ids = local.clamp(0, self.num_rows - 1)
        rows = F.embedding(ids, self.weight) if self.small is None else small_rows(self.small, ids)
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)
        if self.comm.world_size == 1:
            return rows
        parts = self.comm.all_gather(rows)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total


class TensorParallelModel(nn.Module):
    """A ``LlamaForCausalLM`` cut to one rank's share, with the model contract the runner
    expects (``forward``, ``compute_logits``, ``optimize_for_cpu``, ``config``: the
    per-rank heads, so the KV cache holds this rank's heads)."""

    def __init__(self, model: LlamaForCausalLM, comm: Collective) -> None:
        super().__init__()
        check_supported(model, comm.world_size)
        config = model.config
        self.comm = comm
        self.full_config = config
        self.inner = model
        n, r = comm.world_size, comm.rank
        self.vocab_range = shard_range(config.vocab_size, n, r, SHARD_ALIGN)
        first = shard_range(config.vocab_size, n, 0, SHARD_ALIGN)
        self.vocab_width = first[1] - first[0]  # the widest shard (every one but the last)
        with torch.no_grad():
            for layer in model.layers:
                _shard_attention(layer.self_attn, comm)
                _shard_mlp(layer.mlp, comm)
            _shard_vocab(model, self.vocab_range, comm)
        self.config = dataclasses.replace(
            config,
            num_attention_heads=config.num_attention_heads // n,
            num_key_value_heads=config.num_key_value_heads // n,
        )

    @property
    def embed_tokens(self) -> nn.Module:
        return self.inner.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.inner(input_ids, positions, kv_caches, meta, output_rows)

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
        """The hidden states alone: each rank holds a slice of the head, whose logits are
        gathered in ``compute_logits``."""
        return StepOutput(self(input_ids, positions, kv_caches, meta, output_rows))

    def optimize_for_cpu(self) -> None:
        """The single-rank packing, then the fast path with its gathers (where the CPU
        has the fused ops)."""
        from pagedllm.model.fast_path import CpuFastPath

        self.inner.optimize_for_cpu()
        fast = self.inner.fast_path
        if isinstance(fast, CpuFastPath):
            gather = functools.partial(gather_cat, self.comm)
            self.inner.fast_path = CpuFastPath(
                fast.ops, fast.layers, fast.final_norm, fast.rotary_table, gather
            )

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """My vocabulary's logits, then everyone's (the runner samples from all)."""
        inner = self.inner
        logits = linear(hidden, *head_tensors(inner), inner.head_ops)
        logits = gather_padded(self.comm, logits, self.vocab_width, self.full_config.vocab_size)
        return logits.float() if float32 else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """None: the argmax is taken of the gathered logits (``compute_logits``)."""
        return None

    def routes(self, kv_quantization: str | None = None) -> Routes:
        """The single rank's routes, under tensor parallelism."""
        inner = self.inner.routes(kv_quantization)
        ranks = f"tensor parallel over {self.comm.world_size} ranks, gathers over {self.comm.kind}"
        return dataclasses.replace(
            inner,
            decode_loop=f"{inner.decode_loop} ({ranks})",
            sampler="greedy: C++ argmax_rows over the gathered logits; " + sampled_route(),
        )


def _shard_rows(linear_module: Linear, ranges: list[tuple[int, int]]) -> None:
    """Keep only these output rows (of weight and bias, or of the weight kept quantized),
    in this order."""
    if linear_module.quant is not None:
        rows = torch.cat([torch.arange(a, b) for a, b in ranges])
        linear_module.quant = linear_module.quant.rows(rows)
        linear_module.out_features = len(rows)
    else:
        weight = torch.cat([linear_module.weight[a:b] for a, b in ranges]).clone()
        linear_module.weight = nn.Parameter(weight, requires_grad=False)
        linear_module.out_features = weight.shape[0]
    if linear_module.bias is not None:
        bias = torch.cat([linear_module.bias[a:b] for a, b in ranges]).clone()
        linear_module.bias = nn.Parameter(bias, requires_grad=False)


def _shard_attention(attn: nn.Module, comm: Collective) -> None:
    n, r = comm.world_size, comm.rank
    d = attn.head_dim
    heads, kv_heads = attn.num_heads // n, attn.num_kv_heads // n
    q0, kv0 = r * heads * d, r * kv_heads * d
    q_size, kv_size = attn.q_size, attn.kv_size
    _shard_rows(
        attn.qkv_proj,
        [
            (q0, q0 + heads * d),
            (q_size + kv0, q_size + kv0 + kv_heads * d),
            (q_size + kv_size + kv0, q_size + kv_size + kv0 + kv_heads * d),
        ],
    )
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * d, kv_heads * d
    hidden = attn.o_proj.out_features
    _shard_rows(attn.o_proj, [shard_range(hidden, n, r)])
    attn.o_proj = GatheredLinear(attn.o_proj, comm)


def _shard_mlp(mlp: nn.Module, comm: Collective) -> None:
    n, r = comm.world_size, comm.rank
    inter = mlp.intermediate_size
    a, b = shard_range(inter, n, r)
    _shard_rows(mlp.gate_up_proj, [(a, b), (inter + a, inter + b)])
    mlp.intermediate_size = b - a
    hidden = mlp.down_proj.out_features
    _shard_rows(mlp.down_proj, [shard_range(hidden, n, r)])
    mlp.down_proj = GatheredLinear(mlp.down_proj, comm)


def _shard_vocab(model: LlamaForCausalLM, vocab: tuple[int, int], comm: Collective) -> None:
    start, stop = vocab
    table = model.embed_tokens
    if table.quant is not None:  # each rank's vocabulary shard in float, as before
        weight = dequantize(table.quant.rows(slice(start, stop)), table.weight.dtype)
    else:
        weight = table.weight[start:stop].clone()
    model.embed_tokens = VocabEmbedding(weight, start, comm)
    if model.lm_head is not None:
        _shard_rows(model.lm_head, [vocab])
    model.tied_packs = (None, None)
