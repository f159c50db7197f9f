"""Where the planner's sequence lengths come from: fixed lengths, a named distribution, a trace.

A trace is JSONL, one request a line: ``{"prompt_tokens": 812, "output_tokens": 204}``,
optionally with ``"prefix_id"`` (requests with the same id share a system prompt) and
``"prefix_tokens"`` (how long that prompt is; default ``--shared-prefix``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedllm.core.traces import make_trace
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


def sample_distribution(
    name: str, num_requests: int, max_model_len: int, seed: int = 0, shared_prefix: int = 0
) -> list[TraceEntry]:
    """``num_requests`` lengths from a named distribution (``core.traces.make_trace``:
    log-normal with the ShareGPT or Alpaca means the vLLM paper reports).

    A ``shared_prefix`` > 0 starts every prompt with that many system-prompt tokens
    (one shared group), counted in the prompt. Each request fits ``max_model_len``.
    """
    if name.lower() not in ("sharegpt", "alpaca"):
        raise ValueError(f"--dist {name!r}: known distributions are sharegpt, alpaca")
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    if not 0 <= shared_prefix < max_model_len - 1:
        raise ValueError(f"--shared-prefix must be in [0, max_model_len - 1), got {shared_prefix}")
    trace = make_trace(
        name.lower(),
        num_requests,
        seed,
        max_model_len=max_model_len,
        shared_prefix_len=shared_prefix,
        shared_prefix_fraction=1.0 if shared_prefix else 0.0,
    )
    prefix_id = "system" if shared_prefix else None
    return [TraceEntry(r.num_prompt_tokens, r.output_len, prefix_id, shared_prefix) for r in trace]


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
            raise ValueError(
                f"--trace {path}:{number}: needs prompt_tokens and output_tokens ({exc})"
            ) from None
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
        row: dict[str, object] = {
            "prompt_tokens": e.prompt_tokens,
            "output_tokens": e.output_tokens,
        }
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
