"""The acceptance rule shared by every runner (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence


def num_kept(position_tokens: Sequence[int], drafts: Sequence[int]) -> int:
    """How many tokens a speculating sequence keeps: its accepted drafts (the longest
    prefix of ``drafts`` that agrees with the tokens sampled at their positions,
    ``position_tokens[j]`` scoring the token after draft j) and the one sampled after
    them."""
    kept = 0
    while kept < len(drafts) and position_tokens[kept] == drafts[kept]:
        kept += 1
    return kept + 1
