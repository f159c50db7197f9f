"""Each request's full-block hashes: the keys of the prefix index (``core/hashing.py``).

Hashes grow lazily as tokens arrive and are kept for requests holding blocks; a request
still waiting keeps its hashes in a one-entry slot between ``get_computed_blocks`` and
``allocate_slots``, so a waiting request that is dropped without ``free`` leaves nothing
behind.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.hashing import hash_block_tokens
from pagedllm.core.request import Request


class RequestHashes:
    """Full-block hashes by request id. ``holds_blocks(request_id)``: the manager holds
    blocks for the request (device or host), so its hashes are kept; ``salt``: what tells
    one KV cache group's hashes from another's (``core/hybrid_kv.py``)."""

    def __init__(
        self, block_size: int, holds_blocks: Callable[[str], bool], salt: tuple = ()
    ) -> None:
        self.block_size = block_size
        self._holds_blocks = holds_blocks
        self._salt = tuple(salt)
        self.by_request: dict[str, list[bytes]] = {}
        self._pending: tuple[Request, list[bytes]] | None = None

    def ensure(self, request: Request) -> list[bytes]:
        """The request's full-block hashes, extended incrementally as tokens arrive."""
        request_id = request.request_id
        hashes = self.by_request.get(request_id)
        if hashes is None:
            pending = self._pending
            hashes = pending[1] if pending is not None and pending[0] is request else []
            if self._holds_blocks(request_id):
                self.by_request[request_id] = hashes
                if pending is not None and pending[0] is request:
                    self._pending = None
            else:
                self._pending = (request, hashes)
        bs = self.block_size
        num_full = request.num_tokens // bs
        if len(hashes) < num_full:
            tokens, extra_keys = request.all_token_ids, self.extra_keys(request)
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_full):
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra_keys)
                hashes.append(parent)
        return hashes

    def extra_keys(self, request: Request) -> tuple:
        salt = self._salt
        return request.extra_keys + salt if salt else request.extra_keys

    def adopt_pending(self, request: Request) -> None:
        """The request now holds blocks: keep the hashes computed while it waited."""
        pending = self._pending
        if pending is not None and pending[0] is request:
            self.by_request[request.request_id] = pending[1]
            self._pending = None

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's hashes where its tokens agree."""
        parent_hashes = self.by_request.get(parent.request_id)
        if parent_hashes:
            bs = self.block_size
            n = min(len(parent_hashes), child.num_tokens // bs)
            p_tokens, c_tokens = parent.all_token_ids, child.all_token_ids
            while n and p_tokens[: n * bs] != c_tokens[: n * bs]:
                n -= 1
            self.by_request[child.request_id] = parent_hashes[:n]

    def forget(self, request: Request) -> None:
        self.by_request.pop(request.request_id, None)
        if self._pending is not None and self._pending[0] is request:
            self._pending = None
