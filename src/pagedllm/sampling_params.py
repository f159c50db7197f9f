"""Sampling and beam-search parameters, named as in vLLM. Pure Python.

Every invalid value raises ``ValueError`` naming the field, so the server can turn
it into an HTTP 400 with a useful message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

_GREEDY_EPS = 1e-5
# The kinds of StructuredOutputsParams, in vLLM's names; exactly one is set.
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    stops = tuple(stop)
    for s in stops:
        if not isinstance(s, str):
            raise ValueError(f"stop must be a string or a list of strings, got {s!r}")
        if not s:
            raise ValueError("stop must not contain empty strings")
    return stops


def _normalize_ids(name: str, ids: Sequence[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    out = tuple(ids)
    for i in out:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"{name} must hold non-negative integers, got {i!r}")
    return out


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's names); exactly one kind is set.

    ``json``: a JSON Schema (a dict, or its text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``choice``: one of these
    strings exactly; ``grammar``: a Lark grammar (GBNF/EBNF is converted), its rule
    ``start`` (``root`` in GBNF) the whole output. ``disable_any_whitespace``: JSON
    without free whitespace between tokens (vLLM's name; the default allows it).

    The engine compiles it once per (kind, spec, tokenizer) off the step loop and masks
    each draw to the tokens it allows; a sequence whose grammar is complete ends with
    ``finish_reason="stop"``.
    """

    json: str | dict[str, Any] | bool | None = field(default=None, hash=False)
    json_object: bool | None = None
    regex: str | None = None
    # Any sequence of strings is taken; a tuple is kept (the wire decodes by this type).
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _check_schema(self.json))
        if self.json_object not in (None, True, False):
            raise ValueError(
                f"structured_outputs.json_object must be a boolean, got {self.json_object!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            object.__setattr__(self, "choice", _check_choice(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            found = " and ".join(set_kinds) if set_kinds else "none"
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, "
                f"choice, grammar (got {found})"
            )

    @property
    def kind(self) -> str:
        """Which of ``STRUCTURED_KINDS`` is set."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def spec_text(self) -> str:
        """The kind's spec as one canonical string (what the compile cache hashes): a
        schema as sorted compact JSON, choices as a JSON list, the rest as given."""
        kind = self.kind
        if kind == "json":
            return _canonical_json(self.json)
        if kind == "json_object":
            return '{"type":"object"}'
        if kind == "choice":
            return _canonical_json(list(self.choice or ()))
        return str(getattr(self, kind))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructuredOutputsParams:
        """From a plain mapping (a request body's ``structured_outputs``, or the wire);
        ``ValueError`` naming an unknown key."""
        if not isinstance(data, Mapping):
            raise ValueError(f"structured_outputs must be an object, got {data!r}")
        known = {*STRUCTURED_KINDS, "disable_any_whitespace"}
        for key in data:
            if key not in known:
                raise ValueError(f"structured_outputs.{key} is not a known field")
        return cls(**{k: v for k, v in data.items() if v is not None})


def _check_schema(schema: object) -> str | dict[str, Any]:
    """A JSON Schema as a dict or its text; ``ValueError`` naming the field otherwise."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    else:
        parsed = schema
    if not isinstance(parsed, dict | bool):
        raise ValueError(
            f"structured_outputs.json must be a JSON Schema object, got {type(parsed).__name__}"
        )
    if not isinstance(schema, str):
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"structured_outputs.json is not JSON data: {exc}") from None
    return schema  # type: ignore[return-value]


def _check_choice(choice: object) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, Sequence):
        raise ValueError("structured_outputs.choice must be a list of strings")
    out = tuple(choice)
    if not out:
        raise ValueError("structured_outputs.choice must not be empty")
    for item in out:
        if not isinstance(item, str) or not item:
            raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {item!r}")
    return out


def _canonical_json(value: object) -> str:
    if isinstance(value, str):
        value = json.loads(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's completions (vLLM names and defaults).

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k.
    ``max_tokens=None`` lets the engine fill it: all the room the prompt leaves
    (``Scheduler.default_max_tokens``).
    ``stop`` strings are matched across token boundaries by the detokenizer and
    left out of the text unless ``include_stop_str_in_output``.
    ``logprobs=k`` returns, per generated token, its log-probability and the top k.
    ``prompt_logprobs=k`` returns the same for every prompt token after the first
    (``RequestOutput.prompt_logprobs``); such a request computes its whole prompt (no
    prefix-cache hit), as in vLLM.
    ``structured_outputs``: the output must match a JSON Schema, regex, choice or grammar
    (``StructuredOutputsParams``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] | str | None = ()
    stop_token_ids: tuple[int, ...] | None = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    structured_outputs: StructuredOutputsParams | None = None
    # Set by the engine: stop_token_ids plus the tokenizer's EOS (unless ignore_eos);
    # the sampler masks them while fewer than min_tokens have been generated.
    all_stop_token_ids: frozenset[int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(
            self, "stop_token_ids", _normalize_ids("stop_token_ids", self.stop_token_ids)
        )
        if self.all_stop_token_ids is None:
            object.__setattr__(self, "all_stop_token_ids", frozenset(self.stop_token_ids))
        _check_int("n", self.n, minimum=1)
        object.__setattr__(self, "temperature", _check_float("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        object.__setattr__(self, "top_p", _check_float("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        object.__setattr__(self, "min_p", _check_float("min_p", self.min_p))
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        self._check_penalties()
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        self._check_logit_bias()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            object.__setattr__(self, name, value)
        rep = _check_float("repetition_penalty", self.repetition_penalty)
        if rep <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {rep}")
        object.__setattr__(self, "repetition_penalty", rep)

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        bias = {}
        for key, value in dict(self.logit_bias).items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            bias[token_id] = max(-100.0, min(100.0, _check_float("logit_bias", value)))
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < _GREEDY_EPS

    def min_tokens_pending(self, num_output: int) -> bool:
        """True when the next token, after ``num_output`` output tokens, may not be a stop
        token yet (``min_tokens``)."""
        return num_output < self.min_tokens

    def plain_greedy(self, num_output: int) -> bool:
        """True when the next token, after ``num_output`` output tokens, is the argmax of
        the raw logits: no bias, penalties, logprobs or ``min_tokens`` mask to apply."""
        return self.greedy and self._raw_logits(num_output)

    def plain_random(self, num_output: int) -> bool:
        """True when the next token, after ``num_output`` output tokens, is a draw from
        softmax(raw logits / temperature): sampled, no top_k / top_p / min_p filter, and no
        bias, penalties, logprobs or ``min_tokens`` mask to apply."""
        return not self.greedy and not self.filters and self._raw_logits(num_output)

    @property
    def filters(self) -> bool:
        """True when top_k, top_p or min_p removes tokens before a draw."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def _raw_logits(self, num_output: int) -> bool:
        """True when the next token's logits need no bias, penalties, ``min_tokens`` mask
        or logprobs: the raw logits as they come."""
        return (
            not self.logit_bias
            and not self.needs_penalties
            and self.logprobs is None
            and not self.min_tokens_pending(num_output)
        )

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def check_vocabulary(self, vocab_size: int) -> None:
        """``ValueError`` naming the field when a token id it holds is not in the model's
        vocabulary ``[0, vocab_size)`` (a stop id that can never be drawn, a bias on a
        logit that does not exist)."""
        fields = (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ()))
        for name, ids in fields:
            for token_id in ids:
                if not 0 <= token_id < vocab_size:
                    raise ValueError(
                        f"{name} holds token id {token_id}, outside the vocabulary "
                        f"[0, {vocab_size})"
                    )

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy with ``max_tokens`` set (used to fill in ``None``)."""
        return replace(self, max_tokens=max_tokens)

    def with_eos(self, eos_token_id: int | None) -> SamplingParams:
        """A copy whose ``all_stop_token_ids`` include the EOS token (unless ignored)."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return replace(self, all_stop_token_ids=frozenset(ids))


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """Beam search (vLLM's ``LLM.beam_search``): keep the ``beam_width`` best
    sequences by cumulative log-probability, scored at the end with
    ``cum_logprob / len ** length_penalty``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # Every beam's draws masked by its own matcher; a beam whose grammar is complete ends.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        _check_int("beam_width", self.beam_width, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {temperature}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(
            self, "length_penalty", _check_float("length_penalty", self.length_penalty)
        )
