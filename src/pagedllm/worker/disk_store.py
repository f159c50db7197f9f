"""The disk tier's store: one file per full KV block, named by the block's hash chain.

The scheduler plans (``core.tiers.DiskTier``: which hashes are on disk, what to store,
load and drop); this module moves the bytes. Layout::

    DIR/                         0700
      store.json                 0600  format version + fingerprint of model and KV layout
      blocks/ab/<64 hex>.kv      0600  one block; the name is its hash (salt included)

A block file is ``header | token ids (int64 x block_size) | payload`` where the payload
is ``payload_nbytes`` long, or ``first_payload_nbytes`` for a block the cache keeps in
another layout (a quantized cache's unquantized first block: its rows say which), and the header
holds a magic, the format, the block size, the payload size, the store's fingerprint
digest, the block hash, and an xxh3-128 checksum over everything else in the file. A
missing, truncated or corrupt file, or one whose hash or tokens differ from what was
asked, is a miss: the block is recomputed, never read wrong.

Writes run on one background thread, in the order asked (a drop after a store of the
same hash deletes it); each goes to a temporary file renamed into place, so a reader
never sees half a block. A store still in flight is served from memory.

A cache must not keep the server from starting: a ``store.json`` that cannot be read
(a torn write, a flipped bit) in a directory that is recognisably a store (nothing but
``store.json`` and ``blocks/``, whose files carry our magic) sets the whole directory
aside as ``DIR.damaged-<UTC time>`` (logged, counted in ``stats().stores_set_aside``) and
an empty store starts in its place; any other directory is refused. ``store.json`` is
written durably (fsync'd, renamed into place, the directory fsync'd), so a crash leaves
the old file or the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import xxhash

from pagedllm.worker.allocator import BlockArena

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MAGIC = b"PGLMKV\x00\x01"
# magic, format, block_size, payload bytes, fingerprint digest, block hash | checksum
_HEADER = struct.Struct("<8sIIQ32s32s")
_CHECKSUM = struct.Struct("<16s")
_PREFIX_NBYTES = _HEADER.size + _CHECKSUM.size
_STORE_FILE = "store.json"
_HASH_HEX = 64
# Stores queued for the writer before ``save`` waits (bounds the memory they hold).
_MAX_QUEUED = 1024
_SNAPSHOT_BLOCKS = 64  # blocks per snapshot allocation

DiskBlock = tuple[int, bytes, tuple[int, ...]]  # (device block, block hash, token ids)


class BlockBytes(Protocol):
    """A KV cache whose blocks can be read and written as flat bytes (one row a block)."""

    def read_blocks(self, block_ids: Sequence[int]) -> np.ndarray | list[np.ndarray]:
        """A snapshot ``[len(block_ids), block_nbytes]`` uint8 (a copy, not a view); or a
        list of uint8 rows where some blocks take the other payload size."""
        ...

    def write_blocks(self, block_ids: Sequence[int], data: np.ndarray | list[np.ndarray]) -> None:
        """Overwrite the blocks with the rows of ``data`` (``read_blocks``' layouts)."""
        ...


@dataclass(frozen=True, slots=True)
class DiskStoreStats:
    """Totals since the store was opened (``load_seconds``: time spent loading)."""

    path: str
    file_nbytes: int
    blocks_written: int
    bytes_written: int
    blocks_read: int
    bytes_read: int
    loads: int
    load_seconds: float
    misses_corrupt: int
    write_errors: int
    writes_queued: int
    stores_set_aside: int = 0  # 1 when a damaged store was renamed at opening


def disk_file_nbytes(block_size: int, payload_nbytes: int) -> int:
    """Bytes of one block's file: header and checksum, its token ids, its payload."""
    return _PREFIX_NBYTES + 8 * block_size + payload_nbytes


class DiskKVStore:
    """A content-addressed store of KV blocks in ``path``, bound to one ``fingerprint``
    (model, dtype, block size, KV layout, format). ``ValueError`` when ``path`` holds
    another fingerprint's store or other files. ``set_aside``: where a damaged store
    found at ``path`` was moved (None: none was)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        fingerprint: Mapping[str, object],
        *,
        block_size: int,
        payload_nbytes: int,
        first_payload_nbytes: int | None = None,
    ) -> None:
        if block_size <= 0 or payload_nbytes <= 0:
            raise ValueError("block_size and payload_nbytes must be positive")
        if first_payload_nbytes is not None and first_payload_nbytes <= 0:
            raise ValueError("first_payload_nbytes must be positive")
        self.path = Path(path).expanduser().resolve()
        self.block_size = block_size
        self.payload_nbytes = payload_nbytes
        self._payload_sizes = {payload_nbytes, first_payload_nbytes or payload_nbytes}
        self.fingerprint = {"format": FORMAT_VERSION, **dict(fingerprint)}
        canonical = json.dumps(self.fingerprint, sort_keys=True, default=str).encode()
        self.digest = hashlib.sha256(canonical).digest()
        self.set_aside: Path | None = None
        self._open_directory()
        self._blocks_dir = str(self.path / "blocks")
        self.file_nbytes = disk_file_nbytes(block_size, payload_nbytes)
        self._pending: dict[bytes, tuple[bytes, np.ndarray]] = {}  # hash -> (tokens, payload)
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(_MAX_QUEUED)
        self._counts = dict.fromkeys(("written", "read", "loads", "corrupt", "write_errors"), 0)
        self._load_seconds = 0.0
        self._made_dirs: set[str] = set()
        self._staging = np.empty((0, max(self._payload_sizes)), np.uint8)
        self._writer = threading.Thread(target=self._write_loop, name="pagedllm-kv-disk")
        self._writer.daemon = True
        self._writer.start()

    # ---- the worker's side of DiskOps ----------------------------------------------

    def scan(self) -> list[bytes]:
        """The block hashes on disk, least recently used first (by modification time;
        a load touches its file). Leftover temporary files are removed."""
        found = []
        blocks = self.path / "blocks"
        for entry in _walk_files(blocks):
            name = entry.name
            if name.startswith(".tmp"):
                _unlink(entry.path)
            elif name.endswith(".kv") and len(name) == _HASH_HEX + 3:
                try:
                    found.append((entry.stat().st_mtime_ns, bytes.fromhex(name[:_HASH_HEX])))
                except (OSError, ValueError):
                    continue
        found.sort()
        return [block_hash for _, block_hash in found]

    def save_blocks(self, stores: Sequence[DiskBlock], blocks: BlockBytes) -> None:
        """Snapshot the stores' device blocks now, write them in the background. The
        snapshot is taken in chunks small enough for malloc's heap (see
        ``allocator.keep_step_buffers``), whose pages are reused, not faulted in anew."""
        for start in range(0, len(stores), _SNAPSHOT_BLOCKS):
            chunk = stores[start : start + _SNAPSHOT_BLOCKS]
            data = blocks.read_blocks([block_id for block_id, _, _ in chunk])
            for row, (_, block_hash, token_ids) in zip(data, chunk, strict=True):
                tokens = _token_bytes(token_ids, self.block_size)
                with self._lock:
                    self._pending[block_hash] = (tokens, row)
                self._queue.put(("store", block_hash))

    def load_blocks(self, loads: Sequence[DiskBlock], blocks: BlockBytes) -> tuple[int, ...]:
        """Read the loads into their device blocks; the device blocks that could not be
        loaded (their files are gone, or are deleted as corrupt)."""
        if not loads:
            return ()
        start = time.perf_counter()
        data = self._staging_rows(len(loads))
        good, failed, sizes = [], [], []
        for i, (block_id, block_hash, token_ids) in enumerate(loads):
            nbytes = self._read(block_hash, _token_bytes(token_ids, self.block_size), data[i])
            if nbytes:
                good.append(i)
                sizes.append(nbytes)
            else:
                failed.append(block_id)
        if good:
            block_ids = [loads[i][0] for i in good]
            if set(sizes) == {self.payload_nbytes}:
                rows = data[:, : self.payload_nbytes]
                blocks.write_blocks(block_ids, rows if len(good) == len(loads) else rows[good])
            else:
                blocks.write_blocks(block_ids, [data[i, :n] for i, n in zip(good, sizes)])
        self._counts["loads"] += 1
        self._load_seconds += time.perf_counter() - start
        return tuple(failed)

    def _staging_rows(self, n: int) -> np.ndarray:
        """``n`` rows of the load buffer, kept from load to load and on transparent huge
        pages: fresh memory would pay a page fault every 4 KiB of every load."""
        if self._staging.shape[0] < n:
            rows = max(n, 2 * self._staging.shape[0])
            width = max(self._payload_sizes)
            self._staging_arena = BlockArena([((width,), torch.uint8)], rows, rows)
            self._staging = self._staging_arena.tensors[0].numpy()
        return self._staging[:n]

    def drop(self, hashes: Sequence[bytes]) -> None:
        """Delete these blocks (after any store of them queued before)."""
        for block_hash in hashes:
            self._queue.put(("drop", block_hash))

    def flush(self) -> None:
        """Wait until every queued write and drop is done."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes and stop the writer (idempotent)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def stats(self) -> DiskStoreStats:
        c = self._counts
        return DiskStoreStats(
            path=str(self.path),
            file_nbytes=self.file_nbytes,
            blocks_written=c["written"],
            bytes_written=c["written"] * self.file_nbytes,
            blocks_read=c["read"],
            bytes_read=c["read"] * self.file_nbytes,
            loads=c["loads"],
            load_seconds=self._load_seconds,
            misses_corrupt=c["corrupt"],
            write_errors=c["write_errors"],
            writes_queued=self._queue.qsize(),
            stores_set_aside=int(self.set_aside is not None),
        )

    def block_path(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return f"{self._blocks_dir}/{name[:2]}/{name}.kv"

    # ---- internal -------------------------------------------------------------------

    def _open_directory(self) -> None:
        path = self.path
        meta = path / _STORE_FILE
        if path.exists() and not path.is_dir():
            raise ValueError(f"kv_offload_dir {str(path)!r} is not a directory")
        if meta.exists():
            self._check_store_file(meta)
        if not meta.exists():  # a new directory, or the damaged store just set aside
            self._create(meta)
        os.chmod(path, 0o700)  # our store, whoever made the directory
        (path / "blocks").mkdir(mode=0o700, exist_ok=True)

    def _create(self, meta: Path) -> None:
        path = self.path
        if path.exists() and any(path.iterdir()):
            raise ValueError(
                f"kv_offload_dir {str(path)!r} is not empty and holds no pagedllm KV store "
                f"({_STORE_FILE}); give an empty or new directory"
            )
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        text = json.dumps(self.fingerprint, sort_keys=True, indent=1, default=str)
        write_durably(meta, text.encode())

    def _check_store_file(self, meta: Path) -> None:
        try:
            theirs = json.loads(meta.read_bytes())
        except (OSError, ValueError) as exc:
            self._move_aside(f"cannot read {str(meta)!r}: {exc}")
            return
        if not isinstance(theirs, dict):
            self._move_aside(f"cannot read {str(meta)!r}: not a JSON object")
            return
        self._check_fingerprint(theirs)

    def _move_aside(self, problem: str) -> None:
        """Rename the damaged store beside itself, or refuse a directory not ours."""
        if not _looks_like_a_store(self.path):
            raise ValueError(
                f"kv_offload_dir: {problem}; the directory holds no pagedllm KV blocks"
            )
        aside = _free_name(self.path, time.strftime("damaged-%Y%m%dT%H%M%SZ", time.gmtime()))
        try:
            os.rename(self.path, aside)
        except OSError as exc:
            raise ValueError(f"kv_offload_dir: {problem}; cannot set it aside: {exc}") from None
        self.set_aside = aside
        logger.warning(
            "kv_offload_dir: %s; the damaged store was set aside as %s (delete it when not "
            "needed) and an empty store starts in its place",
            problem,
            aside,
        )

    def _check_fingerprint(self, theirs: dict[str, object]) -> None:
        ours = json.loads(json.dumps(self.fingerprint, sort_keys=True, default=str))
        if theirs == ours:
            return
        keys = sorted(set(theirs) | set(ours))
        diffs = [
            f"{k}: store has {theirs.get(k)!r}, this engine {ours.get(k)!r}"
            for k in keys
            if theirs.get(k) != ours.get(k)
        ]
        raise ValueError(
            f"kv_offload_dir {str(self.path)!r} holds KV blocks of another model or KV layout "
            f"({'; '.join(diffs)}); give another directory, or "
            f"empty this one to start over"
        )

    def _read(self, block_hash: bytes, tokens: bytes, row: np.ndarray) -> int:
        """The block's payload into the start of ``row``: its length, 0 for a miss."""
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:
            if pending[0] != tokens:
                return 0
            payload = pending[1]
            row[: len(payload)] = payload
            self._counts["read"] += 1
            return len(payload)
        path = self.block_path(block_hash)
        try:
            with open(path, "rb", buffering=0) as handle:
                nbytes = os.fstat(handle.fileno()).st_size - _PREFIX_NBYTES - len(tokens)
                if nbytes not in self._payload_sizes:
                    raise _Corrupt
                head = bytearray(_PREFIX_NBYTES + len(tokens))
                payload = row[:nbytes]
                if handle.readinto(head) != len(head) or handle.readinto(payload) != nbytes:
                    raise _Corrupt
            self._check(head, block_hash, tokens, payload)
            os.utime(path)  # least recently used order survives a restart
        except FileNotFoundError:
            return 0
        except (_Corrupt, OSError):
            self._counts["corrupt"] += 1
            self._queue.put(("drop", block_hash))
            return 0
        self._counts["read"] += 1
        return nbytes

    def _check(self, head: bytearray, block_hash: bytes, tokens: bytes, row: np.ndarray) -> None:
        magic, version, block_size, nbytes, digest, file_hash = _HEADER.unpack_from(head)
        (checksum,) = _CHECKSUM.unpack_from(head, _HEADER.size)
        if (
            magic != _MAGIC
            or version != FORMAT_VERSION
            or block_size != self.block_size
            or nbytes != len(row)
            or digest != self.digest
            or file_hash != block_hash
            or head[_PREFIX_NBYTES:] != tokens
        ):
            raise _Corrupt
        if _checksum(head[: _HEADER.size], tokens, row) != checksum:
            raise _Corrupt

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                kind, block_hash = item
                if kind == "store":
                    self._write(block_hash)
                else:
                    _unlink(self.block_path(block_hash))
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes) -> None:
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is None:
            return
        tokens, payload = pending
        header = _HEADER.pack(
            _MAGIC, FORMAT_VERSION, self.block_size, len(payload), self.digest, block_hash
        )
        checksum = _CHECKSUM.pack(_checksum(header, tokens, payload))
        path = self.block_path(block_hash)
        try:
            parent = os.path.dirname(path)
            if parent not in self._made_dirs:
                os.makedirs(parent, mode=0o700, exist_ok=True)
                self._made_dirs.add(parent)
            _write_atomically(path, header, checksum, tokens, payload)
            self._counts["written"] += 1
        except OSError:
            self._counts["write_errors"] += 1  # a later load of it is a miss
        finally:
            with self._lock:
                if self._pending.get(block_hash) is pending:
                    del self._pending[block_hash]


class _Corrupt(Exception):
    """A block file that is not what its name says."""


def _checksum(header: bytes | bytearray, tokens: bytes, payload: np.ndarray) -> bytes:
    h = xxhash.xxh3_128()
    h.update(header)
    h.update(tokens)
    h.update(payload)
    return h.digest()


def _token_bytes(token_ids: Sequence[int], block_size: int) -> bytes:
    if len(token_ids) != block_size:
        raise ValueError(f"a disk block holds {block_size} tokens, got {len(token_ids)}")
    return struct.pack(f"<{block_size}q", *token_ids)


def _looks_like_a_store(path: Path) -> bool:
    """Our layout in ``path`` and nothing else (a crash may leave temporary files), and
    its block files (if any) carry our magic."""
    names = {e.name for e in path.iterdir() if not e.name.startswith(".tmp-")}
    if names != {_STORE_FILE, "blocks"} or not (path / "blocks").is_dir():
        return False
    files = [e for e in _walk_files(path / "blocks") if e.name.endswith(".kv")]
    return not files or any(_has_magic(e.path) for e in files)


def _has_magic(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(len(_MAGIC)) == _MAGIC
    except OSError:
        return False


def _free_name(path: Path, suffix: str) -> Path:
    """``path.suffix``, or ``path.suffix-N`` when that is taken."""
    candidate = path.with_name(f"{path.name}.{suffix}")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.{suffix}-{n}")
        n += 1
    return candidate


def write_durably(path: str | Path, data: bytes) -> None:
    """``data`` as ``path``, surviving a crash whole: the old file or the new one."""
    _write_atomically(path, data, durable=True)


def _write_atomically(path: str | Path, *parts: bytes | np.ndarray, durable: bool = False) -> None:
    """Write to a temporary file beside ``path`` (0600), then rename it into place;
    ``durable``: fsync the file before the rename and the directory after. Block files
    skip the fsyncs: a block lost or torn by a crash is a checksum miss, recomputed."""
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".tmp-{name}-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=0) as handle:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    view = view[handle.write(view) :]
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    if durable:
        _fsync_directory(head or ".")


def _fsync_directory(path: str) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _walk_files(root: Path) -> list[os.DirEntry[str]]:
    entries: list[os.DirEntry[str]] = []
    try:
        with os.scandir(root) as top:
            subdirs = [e.path for e in top if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return entries
    for sub in subdirs:
        with os.scandir(sub) as files:
            entries.extend(e for e in files if e.is_file(follow_symlinks=False))
    return entries


def _unlink(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
