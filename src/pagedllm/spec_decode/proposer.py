"""The ``DraftProposer`` Protocol: what the engine asks of any source of drafts.

A proposer reads a running request's tokens (``Request.all_token_ids``: prompt and
verified output, never an unverified draft) and guesses how it goes on. It is told when
a request ends, so that it can drop what it kept for it, or learn from its text (suffix
decoding). A draft model fits the same Protocol: it takes the whole batch at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedllm.core.request import Request


class DraftProposer(Protocol):
    """Drafts for running requests."""

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        """For each request, up to ``max_tokens[i]`` tokens it may continue with (empty:
        no guess). Changes no request."""
        ...

    def request_finished(self, request: Request) -> None:
        """``request`` ended (finished, aborted or failed): drop its state, or learn from
        its tokens."""
        ...
