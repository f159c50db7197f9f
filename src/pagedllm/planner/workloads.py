"""Where the planner's sequence lengths come from: fixed lengths, a named distribution, a trace.

A trace is JSONL, one request a line: ``{"prompt_tokens": 812, "output_tokens": 204}``,
optionally with ``"prefix_id"`` (requests with the same id share a system prompt) and
``"prefix_tokens"`` (how long that prompt is; default ``--shared-prefix``).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedllm.planner.capacity import Workload


@dataclass(frozen=True, slots=True)
class TraceEntry:
    prompt_tokens: int
    output_tokens: int
    prefix_id: str | None = None
    prefix_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


# (mean prompt tokens, mean output tokens, lognormal sigma of each): the means the vLLM
# paper reports for ShareGPT (161 / 338) and Alpaca (19 / 58) after tokenisation.
DISTRIBUTIONS: dict[str, tuple[float, float, float, float]] = {
    "sharegpt": (161.0, 338.0, 1.0, 0.9),
    "alpaca": (19.3, 58.5, 0.6, 0.8),
}


def sample_distribution(
    name: str, num_requests: int, max_model_len: int, seed: int = 0, shared_prefix: int = 0
) -> list[TraceEntry]:
    """``num_requests`` lengths drawn from a lognormal fitted to a named dataset's means.

    A ``shared_prefix`` > 0 prepends that many system-prompt tokens (one shared group).
    Each request is clipped so that prompt + output fits ``max_model_len``.
    """
    key = name.lower()
    if key not in DISTRIBUTIONS:
        raise ValueError(f"--dist {name!r}: known distributions are {', '.join(DISTRIBUTIONS)}")
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    mean_in, mean_out, sigma_in, sigma_out = DISTRIBUTIONS[key]
    rng = random.Random(seed)
    entries = []
    for _ in range(num_requests):
        prompt = shared_prefix + _lognormal(rng, mean_in, sigma_in)
        output = _lognormal(rng, mean_out, sigma_out)
        prompt = min(prompt, max_model_len - 1)
        output = max(1, min(output, max_model_len - prompt))
        prefix = "system" if shared_prefix else None
        entries.append(TraceEntry(prompt, output, prefix, min(shared_prefix, prompt)))
    return entries


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma**2 / 2  # so that the distribution's mean is `mean`
    return max(1, round(rng.lognormvariate(mu, sigma)))


def read_trace(path: str | Path, shared_prefix: int = 0) -> list[TraceEntry]:
    """Read a JSONL trace; ``prefix_tokens`` defaults to ``shared_prefix`` for grouped lines."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--trace {path}:{number}: needs prompt_tokens and output_tokens ({exc})") from None
        if prompt < 1 or output < 0:
            raise ValueError(f"--trace {path}:{number}: prompt_tokens >= 1 and output_tokens >= 0")
        prefix_id = row.get("prefix_id")
        prefix_tokens = int(row.get("prefix_tokens", shared_prefix if prefix_id is not None else 0))
        prefix_id = None if prefix_id is None else str(prefix_id)
        entries.append(TraceEntry(prompt, output, prefix_id, min(prefix_tokens, prompt)))
    if not entries:
        raise ValueError(f"--trace {path}: no requests")
    return entries


def write_trace(path: str | Path, entries: Iterable[TraceEntry]) -> None:
    lines = []
    for e in entries:
        row: dict[str, object] = {"prompt_tokens": e.prompt_tokens, "output_tokens": e.output_tokens}
        if e.prefix_id is not None:
            row["prefix_id"] = e.prefix_id
            row["prefix_tokens"] = e.prefix_tokens
        lines.append(json.dumps(row))
    Path(path).write_text("\n".join(lines) + "\n")


def trace_workload(label: str, entries: Sequence[TraceEntry]) -> Workload:
    """The planner's view of a trace: total tokens and shared-prefix tokens per request."""
    return Workload(
        label=label,
        lengths=tuple(e.num_tokens for e in entries),
        prefix_lens=tuple(e.prefix_tokens if e.prefix_id is not None else 0 for e in entries),
        prefix_ids=tuple(e.prefix_id for e in entries),
    )


def describe(entries: Sequence[TraceEntry]) -> str:
    """``mean 512 tokens (p50 410, p99 2,301, max 4,000)``."""
    lengths = sorted(e.num_tokens for e in entries)

    def pct(p: float) -> int:
        return lengths[min(len(lengths) - 1, int(p * len(lengths)))]

    mean = sum(lengths) / len(lengths)
    return f"mean {mean:,.0f} tokens (p50 {pct(0.5):,}, p99 {pct(0.99):,}, max {lengths[-1]:,})"
