"""`pagedllm cache-report LOG.jsonl`: the planner's cache advisor (``planner/cache_report.py``)
with the model's tokenizer (``model/tokenizer.py``) for logs of text prompts and chats."""

from __future__ import annotations

import argparse

from pagedllm.model.tokenizer import ModelTokenizer, load_text_tokenizer
from pagedllm.planner import cache_report
from pagedllm.planner.cache_report import add_arguments

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    return cache_report.run(args, _tokenizer(args.model))


def _tokenizer(model: str) -> ModelTokenizer | None:
    try:
        return load_text_tokenizer(model)
    except ValueError:
        return None  # a planner preset without a tokenizer: token-id logs still work
