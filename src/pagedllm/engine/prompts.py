"""A prompt as ``LLMEngine.add_request`` takes it: text (tokenized) or token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Why a text prompt (or a stop string) is refused by an engine without a tokenizer.
NO_TOKENIZER = (
    "this engine has no tokenizer (skip_tokenizer_init / --skip-tokenizer-init): "
    "give prompts as token ids"
)


def tokenize_prompt(
    prompt: str | Sequence[int], tokenizer: Any, vocab_size: int
) -> tuple[str | None, list[int]]:
    """A prompt's text (None for token ids) and its token ids, checked against the
    vocabulary; ``TypeError`` / ``ValueError`` naming what is wrong."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        token_ids = list(tokenizer.encode(prompt))
        text: str | None = prompt
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        token_ids = list(prompt)
        text = None
    else:
        raise TypeError(f"prompt must be a string or a list of token ids, got {prompt!r}")
    if not token_ids:
        raise ValueError("prompt must contain at least one token")
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"prompt token ids must be integers, got {token!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"prompt token id {token} is outside the vocabulary [0, {vocab_size})")
    return text, token_ids
