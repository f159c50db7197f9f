"""Synthetic request traces for benchmarks and the planner (pure Python, seeded).

    make_trace("sharegpt", 1000, seed=0, max_model_len=2048) -> list[TraceRequest]

Length distributions (log-normal, clipped to ``max_model_len``) follow the means
the vLLM paper reports: ShareGPT input 161 / output 338 tokens, Alpaca 19 / 58;
``"uniform"`` draws from ``input_range`` / ``output_range``. Arrivals are Poisson
at ``request_rate`` requests per second (``inf``: all at time 0). A fraction of
requests start with one shared system prompt; ``n`` is the parallel samples per
request.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

TRACE_KINDS = ("sharegpt", "alpaca", "uniform")

# kind -> ((input mean, input sigma), (output mean, output sigma)) of a log-normal.
_LOGNORMAL = {
    "sharegpt": ((161.0, 1.0), (338.0, 0.9)),
    "alpaca": ((19.0, 0.6), (58.0, 0.7)),
}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``output_len`` is how many tokens it actually generates; ``max_tokens`` is the
    limit it asked for (``>= output_len``; the contiguous ``exact`` policy reserves
    prompt + ``max_tokens``). ``arrival_time`` is in seconds from the trace start.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    max_tokens: int
    n: int = 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def make_trace(
    kind: str,
    num_requests: int,
    seed: int = 0,
    *,
    request_rate: float = math.inf,
    max_model_len: int = 2048,
    shared_prefix_len: int = 0,
    shared_prefix_fraction: float = 0.0,
    n: int = 1,
    vocab_size: int = 32000,
    input_range: tuple[int, int] = (1, 1024),
    output_range: tuple[int, int] = (1, 1024),
    max_tokens_slack: float = 1.0,
) -> list[TraceRequest]:
    """A seeded synthetic trace; see the module docstring.

    ``shared_prefix_len`` tokens of one system prompt start a random
    ``shared_prefix_fraction`` of the requests (counted in their prompt length).
    ``max_tokens = ceil(output_len * max_tokens_slack)``, capped so that prompt +
    max_tokens fits ``max_model_len``.
    """
    _validate(
        kind,
        num_requests,
        request_rate,
        max_model_len,
        shared_prefix_len,
        shared_prefix_fraction,
        n,
        vocab_size,
        input_range,
        output_range,
        max_tokens_slack,
    )
    rng = random.Random(seed)
    system_prompt = [rng.randrange(vocab_size) for _ in range(shared_prefix_len)]
    trace = []
    now = 0.0
    for i in range(num_requests):
        if math.isfinite(request_rate):
            now += rng.expovariate(request_rate)
        input_len, output_len = _draw_lengths(rng, kind, input_range, output_range)
        prefix = system_prompt if rng.random() < shared_prefix_fraction else []
        input_len = max(1, min(input_len, max_model_len - 1 - len(prefix)))
        prompt = prefix + [rng.randrange(vocab_size) for _ in range(input_len)]
        output_len = max(1, min(output_len, max_model_len - len(prompt)))
        max_tokens = min(math.ceil(output_len * max_tokens_slack), max_model_len - len(prompt))
        trace.append(
            TraceRequest(
                f"req-{i}",
                now if math.isfinite(request_rate) else 0.0,
                tuple(prompt),
                output_len,
                max_tokens,
                n,
            )
        )
    return trace


def trace_summary(trace: list[TraceRequest]) -> dict[str, float]:
    """Mean / max prompt and output lengths, request count and duration."""
    if not trace:
        return {"num_requests": 0}
    prompts = [r.num_prompt_tokens for r in trace]
    outputs = [r.output_len for r in trace]
    return {
        "num_requests": len(trace),
        "mean_input_len": sum(prompts) / len(trace),
        "mean_output_len": sum(outputs) / len(trace),
        "max_input_len": max(prompts),
        "max_output_len": max(outputs),
        "duration_s": trace[-1].arrival_time,
    }


def _draw_lengths(
    rng: random.Random, kind: str, input_range: tuple[int, int], output_range: tuple[int, int]
) -> tuple[int, int]:
    if kind == "uniform":
        return rng.randint(*input_range), rng.randint(*output_range)
    (in_mean, in_sigma), (out_mean, out_sigma) = _LOGNORMAL[kind]
    return _lognormal(rng, in_mean, in_sigma), _lognormal(rng, out_mean, out_sigma)


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2): solve mu for the wanted mean.
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, round(rng.lognormvariate(mu, sigma)))


def _validate(
    kind,
    num_requests,
    request_rate,
    max_model_len,
    shared_prefix_len,
    shared_prefix_fraction,
    n,
    vocab_size,
    input_range,
    output_range,
    max_tokens_slack,
) -> None:
    if kind not in TRACE_KINDS:
        raise ValueError(f"kind must be one of {TRACE_KINDS}, got {kind!r}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if not 0 <= shared_prefix_len < max_model_len - 1:
        raise ValueError(
            f"shared_prefix_len must be in [0, max_model_len - 1), got {shared_prefix_len}"
        )
    if not 0.0 <= shared_prefix_fraction <= 1.0:
        raise ValueError(f"shared_prefix_fraction must be in [0, 1], got {shared_prefix_fraction}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    for name, (low, high) in (("input_range", input_range), ("output_range", output_range)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must satisfy 1 <= low <= high, got {(low, high)}")
    if max_tokens_slack < 1.0:
        raise ValueError(f"max_tokens_slack must be >= 1, got {max_tokens_slack}")
