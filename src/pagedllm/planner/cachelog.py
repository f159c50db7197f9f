"""Request logs for the cache advisor: OpenAI-style JSONL, token-id traces, block-hash traces.

One JSON object a line, one of:

    {"messages": [...]}            rendered by the model's chat template, then tokenized
    {"prompt": "..."}              tokenized as the server does (special tokens added)
    {"prompt_token_ids": [...]}    (or "token_ids": a token-id trace)
    {"timestamp", "input_length", "output_length", "hash_ids"}   Mooncake block-hash trace

each with an optional ``cache_salt`` and ``timestamp`` (when every line has one, requests
are replayed in timestamp order, else in file order). A line may also carry what a
server reported (``cached_tokens``, or ``usage.prompt_tokens_details.cached_tokens``) and
the tokens it generated (``output_token_ids``), which the engine caches too.
Text is tokenized in batches by a ``Tokenizer`` (``model/tokenizer.py`` wraps Hugging
Face's, and the command line passes one in); this module imports no tokenizer library.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake trace format


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """One logged prompt as the engine would see it."""

    index: int
    token_ids: tuple[int, ...]
    cache_salt: str | None = None
    timestamp: float | None = None
    reported_cached_tokens: int | None = None
    output_token_ids: tuple[int, ...] = ()

    @property
    def extra_keys(self) -> tuple[str, ...]:
        """The engine's extra hash keys (``Request.extra_keys``)."""
        return () if self.cache_salt is None else (self.cache_salt,)


@dataclass(frozen=True, slots=True)
class HashTraceRequest:
    """One request of a block-hash trace: a chained id per ``MOONCAKE_BLOCK_SIZE`` tokens."""

    index: int
    timestamp: float | None
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class Tokenizer(Protocol):
    """What the advisor needs from a tokenizer."""

    def encode_prompts(self, texts: Sequence[str]) -> list[list[int]]: ...

    def encode_chats(
        self, conversations: Sequence[Sequence[Mapping[str, Any]]]
    ) -> list[list[int]]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class CacheLog:
    """A parsed log: token requests or hash-trace requests (never both)."""

    requests: tuple[LoggedRequest, ...] = ()
    hash_requests: tuple[HashTraceRequest, ...] = ()

    @property
    def is_hash_trace(self) -> bool:
        return bool(self.hash_requests)

    def __len__(self) -> int:
        return len(self.hash_requests) or len(self.requests)


def read_log(path: str | Path, tokenizer: Tokenizer | None = None) -> CacheLog:
    """Parse a JSONL log; ``ValueError`` naming the line for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    with path.open(encoding="utf-8") as f:
        records = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc.msg}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: each line must be a JSON object")
            records.append((number, record))
    return parse_records(records, tokenizer, source=str(path))


def parse_records(
    records: Iterable[tuple[int, Mapping[str, Any]]],
    tokenizer: Tokenizer | None = None,
    *,
    source: str = "log",
) -> CacheLog:
    """Records (line number, object) into a ``CacheLog``; text is tokenized in two batches."""
    records = list(records)
    if not records:
        raise ValueError(f"{source}: no requests")
    if all(isinstance(r.get("timestamp"), int | float) for _, r in records):
        # Replayed in time order (a server's log is written as requests finish).
        records.sort(key=lambda item: item[1]["timestamp"])
    if any("hash_ids" in r for _, r in records):
        return CacheLog(
            hash_requests=tuple(_hash_request(i, n, r, source) for i, (n, r) in enumerate(records))
        )
    kinds = [_kind(n, r, source) for n, r in records]
    token_ids = _token_ids(records, kinds, tokenizer, source)
    requests = tuple(
        LoggedRequest(
            index=i,
            token_ids=tuple(ids),
            cache_salt=_optional_str(r, "cache_salt", n, source),
            timestamp=_optional_number(r, "timestamp", n, source),
            reported_cached_tokens=_reported_cached(r, n, source),
            output_token_ids=tuple(
                _ids(r.get("output_token_ids", []), "output_token_ids", n, source, allow_empty=True)
            ),
        )
        for i, ((n, r), ids) in enumerate(zip(records, token_ids, strict=True))
    )
    return CacheLog(requests=requests)


def _kind(number: int, record: Mapping[str, Any], source: str) -> str:
    for kind in ("prompt_token_ids", "token_ids", "messages", "prompt"):
        if kind in record:
            return kind
    raise ValueError(
        f"{source}:{number}: needs one of messages, prompt, prompt_token_ids, token_ids or hash_ids"
    )


def _token_ids(
    records: list[tuple[int, Mapping[str, Any]]],
    kinds: list[str],
    tokenizer: Tokenizer | None,
    source: str,
) -> list[list[int]]:
    out: list[list[int] | None] = [None] * len(records)
    prompts, chats = [], []
    for i, ((number, record), kind) in enumerate(zip(records, kinds, strict=True)):
        value = record[kind]
        if kind in ("prompt_token_ids", "token_ids"):
            out[i] = _ids(value, kind, number, source)
        elif kind == "prompt":
            if not isinstance(value, str) or not value:
                raise ValueError(f"{source}:{number}: prompt must be a non-empty string")
            prompts.append((i, value))
        else:
            chats.append((i, _messages(value, number, source)))
    if (prompts or chats) and tokenizer is None:
        raise ValueError(f"{source}: text prompts need a tokenizer (--model)")
    if prompts:
        for (i, _), ids in zip(
            prompts, tokenizer.encode_prompts([p for _, p in prompts]), strict=True
        ):
            out[i] = ids
    if chats:
        for (i, _), ids in zip(chats, tokenizer.encode_chats([c for _, c in chats]), strict=True):
            out[i] = ids
    for i, ids in enumerate(out):
        if not ids:
            raise ValueError(f"{source}:{records[i][0]}: the prompt has no tokens")
    return out  # type: ignore[return-value]


def _ids(
    value: Any, field: str, number: int, source: str, *, allow_empty: bool = False
) -> list[int]:
    if not isinstance(value, list) or not (value or allow_empty):
        raise ValueError(f"{source}:{number}: {field} must be a non-empty list of integers")
    # Type checks in C (a 12,000-request trace holds millions of ids); bool is not int here.
    if value and (set(map(type, value)) != {int} or min(value) < 0):
        bad = next(t for t in value if type(t) is not int or t < 0)
        raise ValueError(f"{source}:{number}: {field}: {bad!r} is not a token id")
    return value


def _messages(value: Any, number: int, source: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{source}:{number}: messages must be a non-empty list")
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{source}:{number}: each message needs a string role")
        content = message.get("content", "")
        if not isinstance(content, str | None):
            raise ValueError(f"{source}:{number}: message content must be a string")
    return [dict(m, content=m.get("content") or "") for m in value]


def _optional_str(record: Mapping[str, Any], field: str, number: int, source: str) -> str | None:
    value = record.get(field)
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{source}:{number}: {field} must be a non-empty string")
    return value


def _optional_number(
    record: Mapping[str, Any], field: str, number: int, source: str
) -> float | None:
    value = record.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{source}:{number}: {field} must be a number (seconds)")
    return float(value)


def _reported_cached(record: Mapping[str, Any], number: int, source: str) -> int | None:
    value = record.get("cached_tokens")
    usage = record.get("usage")
    if value is None and isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            value = details.get("cached_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source}:{number}: cached_tokens must be an integer >= 0")
    return value


def _hash_request(
    index: int, number: int, record: Mapping[str, Any], source: str
) -> HashTraceRequest:
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or any(
        isinstance(h, bool) or not isinstance(h, int) for h in hash_ids
    ):
        raise ValueError(f"{source}:{number}: hash_ids must be a list of integers")
    lengths = {}
    for field in ("input_length", "output_length"):
        value = record.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{source}:{number}: {field} must be an integer >= 0")
        lengths[field] = value
    if lengths["input_length"] < 1:
        raise ValueError(f"{source}:{number}: input_length must be >= 1")
    return HashTraceRequest(
        index,
        _optional_number(record, "timestamp", number, source),
        lengths["input_length"],
        lengths["output_length"],
        tuple(hash_ids),
    )
