"""Block identity: a full block's hash chains over its parent's hash.

    block 0: sha256(ROOT,    tokens[0:B],  extra_keys)
    block 1: sha256(hash_0,  tokens[B:2B], extra_keys)
    ...

Two blocks share a hash only when every token before them and in them agrees, and
so do the extra keys (a tenant's ``cache_salt``). Partial blocks have no hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Marks "no parent" so that a first block can never collide with a block whose
# parent hash happens to be empty.
_ROOT = b"pagedllm-root-block"


def _encode_extra_keys(extra_keys: tuple) -> bytes:
    # Length-prefixed reprs: ("ab",) and ("a", "b") must hash differently.
    parts = []
    for key in extra_keys:
        data = repr(key).encode()
        parts.append(struct.pack("<I", len(data)) + data)
    return b"".join(parts)


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> bytes:
    """The sha256 identity of one full block, chained over its parent's hash."""
    n = len(token_ids)
    h = hashlib.sha256(_ROOT if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<I{n}qI", n, *token_ids, len(extra_keys)))
    if extra_keys:
        h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()
) -> list[bytes]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
