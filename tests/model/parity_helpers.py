"""Helpers for model parity tests: tiny checkpoints, transformers references, a hand driver.

The driver stands in for the scheduler (which is not under test here): it hands out
block ids from a free list, builds ``SchedulerOutput``s by hand and feeds them to the
worker, so that every paging path (prefix sharing, chunked prefill, copies, swaps)
can be forced exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.core.outputs import ScheduledSequence, SchedulerOutput
from pagedllm.model import load_model
from pagedllm.testing import make_tiny_checkpoint
from pagedllm.worker.model_runner import TorchModelRunner

PROMPTS = [
    [5, 17, 42],
    [7, 3, 99, 200, 12, 8, 1, 64, 33, 250, 19],
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117],
    [42],
]


def randomise_biases(path: Path, seed: int = 0) -> None:
    """transformers initialises biases to zero; a dropped bias must change the output."""
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(seed)
    for file in path.glob("*.safetensors"):
        tensors = load_file(str(file))
        for name, tensor in tensors.items():
            if name.endswith(".bias"):
                noise = torch.randn(tensor.shape, generator=generator) * 0.5
                tensors[name] = noise.to(tensor.dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})


def build_checkpoint(path: Path, arch: str = "llama", **overrides) -> Path:
    make_tiny_checkpoint(path, arch, **overrides)
    randomise_biases(path)
    return path


VARIANTS = {
    "llama_gqa": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_mha_bias": (
        "llama",
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
    ),
    "llama3_rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "mistral": ("mistral", {}),
    "qwen2_bias": ("qwen2", {}),
    # Rows of 256 weights and more: the K-quants' super-blocks fit.
    "qwen2_wide": (
        "qwen2",
        {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_hidden_layers": 2},
    ),
    "qwen3_qk_norm": ("qwen3", {"tie_word_embeddings": True}),
    "mistral_window": ("mistral", {"sliding_window": 4}),
    "qwen2_window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    "gemma2": (
        "gemma2",
        {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},
    ),
    "gemma3": (
        "gemma3_text",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "mixtral": ("mixtral", {"sliding_window": None}),
    "qwen3_moe": (
        "qwen3_moe",
        {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True},
    ),
}
# Multi-head latent attention with mixtures of experts and YaRN.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
VARIANTS["deepseek_v2"] = ("deepseek_v2", {})
VARIANTS["deepseek_v2_groups"] = (
    "deepseek_v2",
    {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1, "rope_parameters": YARN},
)
VARIANTS["deepseek_v3"] = ("deepseek_v3", {"num_hidden_layers": 3, "rope_parameters": YARN})
MLA = ("deepseek_v2", "deepseek_v2_groups", "deepseek_v3")
# Variants whose tiny checkpoints have sliding-window layers (window 4 or 5).
WINDOWED = ("mistral_window", "qwen2_window", "gemma2", "gemma3")


class HFReference:
    """transformers' own model on the same checkpoint: logits of full sequences, no cache."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[len, vocab] float32 logits of every position."""
        ids = torch.tensor([list(token_ids)])
        return self.model(input_ids=ids).logits[0].float()

    def greedy(self, prompt: Sequence[int], num_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(num_tokens):
            tokens.append(int(self.logits(tokens)[-1].argmax()))
        return tokens[len(prompt) :]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    # A model with KV cache groups (local and global layers): the tables of groups 1..
    group_tables: list[list[int]] = field(default_factory=list)


class HandDriver:
    """A minimal stand-in for the scheduler: block ids from a free list, steps by hand."""

    def __init__(self, runner, num_blocks: int | None = None) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free = list(range(num_blocks if num_blocks is not None else runner.num_blocks))
        # Hand blocks out in a scrambled order so that adjacency can never hide a bug.
        self.free.reverse()
        self.seqs: dict[str, Seq] = {}
        self.num_groups = 1 + max(runner.spec.layer_groups, default=0)

    def add(self, request_id: str, token_ids: Sequence[int]) -> Seq:
        seq = Seq(request_id, list(token_ids))
        seq.group_tables = [[] for _ in range(self.num_groups - 1)]
        self.seqs[request_id] = seq
        return seq

    @staticmethod
    def tables(seq: Seq) -> list[list[int]]:
        """Every group's table (one for a model without groups)."""
        return [seq.block_table, *seq.group_tables]

    @staticmethod
    def set_tables(seq: Seq, tables: list[list[int]]) -> None:
        seq.block_table, *seq.group_tables = (list(t) for t in tables)

    def grow(self, seq: Seq, num_tokens: int) -> None:
        needed = -(-num_tokens // self.block_size)
        for table in self.tables(seq):
            while len(table) < needed:
                table.append(self.free.pop())

    def schedule(self, seq: Seq, num_new: int, num_samples: int = 1) -> ScheduledSequence:
        start = seq.num_computed
        self.grow(seq, start + num_new)
        return ScheduledSequence(
            request_id=seq.request_id,
            token_ids=tuple(seq.token_ids[start : start + num_new]),
            start_position=start,
            block_table=tuple(seq.block_table),
            num_samples=num_samples,
            group_block_tables=tuple(tuple(t) for t in seq.group_tables),
        )

    def step(self, scheduled: list[ScheduledSequence], **moves) -> dict[str, torch.Tensor]:
        """Run one step; returns the logits row of each sampled sequence, by request id."""
        output = SchedulerOutput(scheduled=tuple(scheduled), **moves)
        self.runner.apply_block_moves(output)
        logits = self.runner.compute_logits(output.scheduled)
        rows: dict[str, torch.Tensor] = {}
        row = 0
        for item in scheduled:
            self.seqs[item.request_id].num_computed += len(item.token_ids)
            if item.num_samples > 0:
                rows[item.request_id] = logits[row]
                row += 1
        return rows

    def append(self, request_id: str, token_id: int) -> None:
        self.seqs[request_id].token_ids.append(token_id)


TOLERANCE = 1e-4
NUM_DECODE = 5


def make_runner(path, block_size: int, num_blocks: int = 256, **kwargs) -> TorchModelRunner:
    loaded = load_model(path, dtype="float32", load_tokenizer=False)
    return TorchModelRunner(loaded.model, block_size=block_size, num_blocks=num_blocks, **kwargs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    error = relative_error(actual, expected)
    assert error <= TOLERANCE, f"{what}: relative error {error:.2e} > {TOLERANCE}"


def greedy_batch(runner: TorchModelRunner, hf: HFReference, prompts, num_decode: int) -> None:
    """Prefill all prompts in one step, then decode them together; check every step."""
    driver = HandDriver(runner)
    seqs = [driver.add(f"r{i}", p) for i, p in enumerate(prompts)]
    rows = driver.step([driver.schedule(s, len(s.token_ids)) for s in seqs])
    for _ in range(num_decode):
        for seq in seqs:
            expected = hf.logits(seq.token_ids)[-1]
            assert_close(rows[seq.request_id], expected, f"{seq.request_id} at {seq.num_computed}")
            token = int(rows[seq.request_id].argmax())
            assert token == int(expected.argmax())
            driver.append(seq.request_id, token)
        rows = driver.step([driver.schedule(s, 1) for s in seqs])
