"""A fake runner that writes given replies: the text a model with tools would write,
token by token, so that reading calls is tested on it without a model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.worker.fake_runner import FakeModelRunner


class ScriptedRunner(FakeModelRunner):
    """Writes ``replies[k]`` in the k-th assistant turn of the context (each starts after
    ``turn``, the template's generation prompt), then EOS. Blocks of 16 tokens."""

    def __init__(
        self, tokenizer: Any, replies: Sequence[str], turn: str = "<|im_start|>assistant\n"
    ) -> None:
        super().__init__(512, 16, vocab_size=len(tokenizer))
        self.turn = tokenizer.encode(turn, add_special_tokens=False)
        self.replies = [
            [*tokenizer.encode(r, add_special_tokens=False), tokenizer.eos_token_id]
            for r in replies
        ]

    def next_token(self, context: Sequence[int], sample_index: int = 0) -> int:
        size = len(self.turn)
        starts = [i for i in range(len(context)) if list(context[i : i + size]) == self.turn]
        reply = self.replies[len(starts) - 1]
        return reply[min(len(context) - starts[-1] - size, len(reply) - 1)]
