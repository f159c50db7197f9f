"""The server's recent requests, for ``GET /v1/cache/advice`` and ``--request-log FILE``.

Each finished request leaves one record: its prompt token ids, ``cache_salt``, arrival
time, the ``cached_tokens`` the server reported and the tokens it generated (the engine
caches those blocks too). The last ``max_records`` stay in memory; with a path, every record
is also appended to a JSONL file in the format ``pagedllm cache-report`` reads, so the
advisor can replay the server's own traffic and compare its prediction with what the
server reported.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pagedllm.planner.cachelog import CacheLog, LoggedRequest

DEFAULT_MAX_RECORDS = 10_000


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    timestamp: float
    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None
    cached_tokens: int
    output_token_ids: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {
            "request_id": self.request_id,
            "timestamp": self.timestamp,
            "prompt_token_ids": list(self.prompt_token_ids),
            "cached_tokens": self.cached_tokens,
            "output_token_ids": list(self.output_token_ids),
        }
        if self.cache_salt is not None:
            line["cache_salt"] = self.cache_salt
        return line


class RecentRequests:
    """A bounded record of finished requests (used from the event loop only).

    ``started`` notes a request's salt and arrival (strictly increasing wall-clock
    times, so the arrival order survives a sort); ``finished`` records it with what the
    server reported; ``discard`` forgets one that failed or was aborted.
    """

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS, path: str | Path | None = None):
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        self._records: deque[RequestRecord] = deque(maxlen=max_records)
        self._pending: dict[str, tuple[str | None, float]] = {}
        self._last_arrival = 0.0
        self._file: IO[str] | None = None
        if path is not None:
            self._file = Path(path).open("a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def started(self, request_id: str, cache_salt: str | None) -> None:
        self._last_arrival = max(time.time(), self._last_arrival + 1e-6)
        self._pending[request_id] = (cache_salt, self._last_arrival)

    def finished(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cached_tokens: int,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        salt, arrival = pending
        record = RequestRecord(
            request_id,
            arrival,
            tuple(prompt_token_ids),
            salt,
            int(cached_tokens),
            tuple(output_token_ids),
        )
        self._records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record.to_json()) + "\n")
            self._file.flush()

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def records(self, limit: int | None = None) -> list[RequestRecord]:
        """The most recent ``limit`` records (all by default), oldest first."""
        records = list(self._records)
        return records if limit is None else records[-limit:] if limit > 0 else []

    def to_log(self, limit: int | None = None) -> CacheLog:
        """The records as a ``CacheLog`` for the advisor, in arrival order."""
        records = sorted(self.records(limit), key=lambda r: r.timestamp)
        return CacheLog(
            requests=tuple(
                LoggedRequest(
                    i,
                    r.prompt_token_ids,
                    r.cache_salt,
                    r.timestamp,
                    r.cached_tokens,
                    r.output_token_ids,
                )
                for i, r in enumerate(records)
            )
        )

    def __len__(self) -> int:
        return len(self._records)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
