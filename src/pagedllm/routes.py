"""Which implementation runs each capability of a model step: the start-up log,
``pagedllm env`` and ``/v1/cache`` report it, so that a slower route is never silent.
Plain data (no torch), so that it crosses process boundaries with the engine's stats."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Routes:
    """One line per capability: attention (the kernel's ISA), the layers with a sliding
    window or soft-capping where the model has them (their attention route), linears (own
    kernel or oneDNN), the LM head's path among them (and why it is off the own kernel),
    the decode loop (one fused C++ call or per layer), the sampler, the dtype the model
    runs in with the reason for it, and speculative decoding (its proposer and how drafts
    are verified; "off" without it)."""

    attention: str
    linears: str
    decode_loop: str
    sampler: str
    windowed_attention: str = ""
    lm_head: str = ""
    dtype: str = ""
    dtype_reason: str = ""
    speculative: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def lines(self) -> list[str]:
        """``name: route`` lines for logs and reports."""
        return [
            f"{name.replace('_', ' ')}: {value}" for name, value in asdict(self).items() if value
        ]
