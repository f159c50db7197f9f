"""A shared-memory all-gather for tensor-parallel ranks on one machine.

Gloo's all-gather over loopback has a large fixed cost a call, whatever the size, and a
decode step makes 4 per layer. Ranks that share a machine can instead exchange
pieces through memory: each rank owns one file under ``/dev/shm`` (two slots of
``capacity`` bytes), and one control file holds a line per rank (call counters, pid,
buffer generation and capacity).

A call, on every rank: write my piece into slot ``call % 2`` of my buffer, publish
``call`` in my counter, wait until every counter reached ``call``, copy the peers' pieces
out, publish ``call`` as done. The two slots keep a fast rank from overwriting a piece a
slow rank still reads: a rank can only reach call ``k + 2`` (slot ``k % 2`` again) after
every rank published ``k + 1``, which each does only after it finished copying call
``k``'s pieces. (x86 keeps stores in order, so a counter is never seen before the piece
written ahead of it; ``shm_available`` says no elsewhere.)

A piece larger than the buffer grows it: every rank sees the same shapes, so every rank
grows at the same call. The owner waits until every peer is done with the previous call
(its done line), maps a new, larger file (generation + 1) and publishes its generation
before its counter; peers open it when they read that call. The owner unlinks the file's
name one call later, once every peer has passed (and so opened it).

Names are unlinked as soon as every rank has opened them (Linux keeps an unlinked file's
pages while it is mapped), so a crash leaves nothing in ``/dev/shm``; ``close`` removes
whatever is still named. A wait longer than ``timeout_s`` raises, and so does a peer whose
process is gone.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "pagedllm-tp-"
LINE_BYTES = 64  # a cache line per rank: ranks' counters do not share one
# int64 fields of a rank's line: the last call whose piece it published, the last call
# whose pieces it finished copying, its pid, its buffer's generation and slot size.
COUNTER, DONE, PID, GENERATION, CAPACITY = range(5)
INITIAL_CAPACITY = 1 << 20  # bytes per slot; grows on demand
SPIN_S = 50e-6  # busy-wait this long before yielding the core
YIELD_S = 2e-3  # then sched_yield this long before sleeping between checks
SLEEP_S = 50e-6
LIVENESS_S = 0.5  # how often a waiting rank checks that its peers' processes live


def new_base_name() -> str:
    """A name no other group on this machine uses (rank 0 picks it)."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def shm_available() -> bool:
    """Whether the collective can run here: x86-64 (whose stores stay in order, which the
    counters rely on) with a writable /dev/shm."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def leftover_names() -> list[str]:
    """Files of this module under /dev/shm (tests check that none stay behind)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX))


@dataclass
class Mapping:
    """One mapped file: its name (None once unlinked), mmap and a byte view of it."""

    name: str | None
    mm: mmap.mmap
    bytes: torch.Tensor
    generation: int
    capacity: int

    def close(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)  # drop the export before closing
        with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it
            self.mm.close()


def _create_file(name: str, size: int) -> mmap.mmap:
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # Reserve the pages now: a full /dev/shm fails here with ENOSPC, not later with
        # SIGBUS in the middle of a step.
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _open_file(name: str, size: int) -> mmap.mmap:
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _unlink(name: str | None) -> None:
    if name is None:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


def _buffer_name(base: str, rank: int, generation: int) -> str:
    return f"{base}-r{rank}-g{generation}"


def _process_alive(pid: int) -> bool:
    """False once ``pid`` has exited (a zombie not yet reaped counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class ShmCollective:
    """The ``model.tensor_parallel.Collective`` of ranks on one machine, over /dev/shm.

    Build it with ``ShmCollective.setup`` (collective over the ranks' gloo group), or with
    the constructor when the ranks agree on ``base`` otherwise, then ``attach`` once every
    rank has constructed its own."""

    kind = "shared memory"

    def __init__(
        self, base: str, rank: int, world_size: int, timeout_s: float, *, create_control: bool
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.base = base
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        # What the gathers cost this rank (waiting for the slowest rank included):
        # benchmarks/tensor_parallel.py reads and resets them.
        self.num_calls = 0
        self.num_bytes = 0
        self.seconds = 0.0
        self._call = 0
        self._closed = False
        # My grown buffers' names and the call that grew them: unlinked the call after.
        self._retired: list[tuple[str, int]] = []
        control_bytes = world_size * LINE_BYTES
        self._control_name: str | None = f"{base}-ctl"
        if create_control:
            self._control_mm = _create_file(self._control_name, control_bytes)
        else:
            self._control_mm = _open_file(self._control_name, control_bytes)
        self._lines = memoryview(self._control_mm).cast("q")
        self._mine = self._new_buffer(0, INITIAL_CAPACITY)
        self._peers: dict[int, Mapping] = {}
        self._write(PID, os.getpid())

    @classmethod
    def setup(cls, group: object, timeout_s: float) -> ShmCollective:
        """Every rank of ``group`` (a gloo group of ranks on this machine) calls this:
        rank 0 names the files and tells the others; all map them, then unlink them."""
        import torch.distributed as dist

        if not shm_available():
            raise RuntimeError(
                f"the shared-memory collective needs x86-64 and a writable {SHM_DIR} "
                f"(this is {platform.machine()}); use tp_collective 'gloo'"
            )
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        box = [new_base_name() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        comm = None
        try:
            if rank == 0:
                comm = cls(box[0], rank, world_size, timeout_s, create_control=True)
            dist.barrier(group=group)  # the control file exists
            if rank != 0:
                comm = cls(box[0], rank, world_size, timeout_s, create_control=False)
            dist.barrier(group=group)  # every buffer exists
            comm.attach()
            dist.barrier(group=group)  # everyone has mapped everything
            comm.unlink_names()
        except BaseException:
            if comm is not None:
                comm.close()
            raise
        return comm

    def attach(self) -> None:
        """Map every peer's buffer (after each peer constructed its own)."""
        for peer in range(self.world_size):
            if peer != self.rank and peer not in self._peers:
                self._peers[peer] = self._open_peer(peer, 0, INITIAL_CAPACITY)

    def unlink_names(self) -> None:
        """Remove my files' names (every rank has them mapped): nothing to leak."""
        _unlink(self._mine.name)
        self._mine.name = None
        if self.rank == 0:
            _unlink(self._control_name)
            self._control_name = None

    # ------------------------------------------------------------------ the gather

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype on all ranks), in rank order; my own
        entry is ``x`` itself, the others are copies of the peers' bytes."""
        if self._closed:
            raise RuntimeError("the shared-memory collective is closed")
        start = time.perf_counter()
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        self._call += 1
        call = self._call
        slot = call % 2
        if nbytes > self._mine.capacity:
            self._grow(nbytes, call)
        if nbytes:
            offset = slot * self._mine.capacity
            self._mine.bytes[offset : offset + nbytes].copy_(x.reshape(-1).view(torch.uint8))
        self._write(COUNTER, call)
        self._wait_all(COUNTER, call)
        self._unlink_retired(call)
        parts = [x if peer == self.rank else self._read(peer, x, nbytes, slot)
                 for peer in range(self.world_size)]  # fmt: skip
        self._write(DONE, call)
        self.seconds += time.perf_counter() - start
        self.num_calls += 1
        self.num_bytes += nbytes
        return parts

    def _read(self, peer: int, like: torch.Tensor, nbytes: int, slot: int) -> torch.Tensor:
        mapping = self._peer_mapping(peer)
        if nbytes > mapping.capacity:
            raise RuntimeError(
                f"rank {peer}'s buffer ({mapping.capacity} bytes) is smaller than this "
                f"gather ({nbytes} bytes): the ranks gathered different shapes"
            )
        if not nbytes:
            return torch.empty_like(like)
        offset = slot * mapping.capacity
        raw = mapping.bytes[offset : offset + nbytes].clone()
        return raw.view(like.dtype).reshape(like.shape)

    def _peer_mapping(self, peer: int) -> Mapping:
        """The peer's current buffer, opening its grown one if it published a new one."""
        mapping = self._peers[peer]
        generation = self._read_line(peer, GENERATION)
        if generation != mapping.generation:
            capacity = self._read_line(peer, CAPACITY)
            self._peers[peer] = self._open_peer(peer, generation, capacity)
            mapping.close()
            mapping = self._peers[peer]
        return mapping

    # ------------------------------------------------------------------ buffers

    def _new_buffer(self, generation: int, capacity: int) -> Mapping:
        name = _buffer_name(self.base, self.rank, generation)
        mm = _create_file(name, 2 * capacity)
        return Mapping(name, mm, torch.frombuffer(mm, dtype=torch.uint8), generation, capacity)

    def _open_peer(self, peer: int, generation: int, capacity: int) -> Mapping:
        mm = _open_file(_buffer_name(self.base, peer, generation), 2 * capacity)
        return Mapping(None, mm, torch.frombuffer(mm, dtype=torch.uint8), generation, capacity)

    def _grow(self, nbytes: int, call: int) -> None:
        """A new buffer of at least ``nbytes`` per slot, published before my counter.

        Peers find my buffer through my generation, so it may only change once every
        peer has finished copying the previous call's pieces (its ``DONE`` line)."""
        self._wait_all(DONE, call - 1)
        capacity = max(2 * self._mine.capacity, -(-nbytes // 4096) * 4096)
        old = self._mine
        self._mine = self._new_buffer(old.generation + 1, capacity)
        self._retired.append((self._mine.name, call))
        self._mine.name = None  # unlinked by _unlink_retired (or close)
        self._write(CAPACITY, capacity)
        self._write(GENERATION, self._mine.generation)
        old.close()  # no peer reads it any more (the wait above)

    def _unlink_retired(self, call: int) -> None:
        """Names of buffers grown at an earlier call: every peer has opened them, since
        it read that call before publishing this one."""
        for name in [n for n, grown in self._retired if grown < call]:
            _unlink(name)
        self._retired = [(n, grown) for n, grown in self._retired if grown >= call]

    # ------------------------------------------------------------------ waiting

    def _wait_all(self, field: int, call: int) -> None:
        """Until every peer's ``field`` line reached ``call``; RuntimeError on timeout or
        a dead peer."""
        pending = [peer for peer in range(self.world_size) if peer != self.rank]
        start = time.perf_counter()
        next_liveness = start + LIVENESS_S
        pause: Callable[[], None] | None = None
        while True:
            pending = [p for p in pending if self._read_line(p, field) < call]
            if not pending:
                return
            now = time.perf_counter()
            waited = now - start
            if waited > self.timeout_s:
                raise RuntimeError(self._stuck_message(pending, call, waited, "timed out"))
            if now >= next_liveness:
                next_liveness = now + LIVENESS_S
                dead = [p for p in pending if not _process_alive(self._read_line(p, PID))]
                if dead:
                    raise RuntimeError(self._stuck_message(dead, call, waited, "process exited"))
            pause = _pause_for(waited)
            if pause is not None:
                pause()

    def _stuck_message(self, peers: list[int], call: int, waited: float, why: str) -> str:
        return (
            f"shared-memory all-gather: rank {self.rank} waited {waited:.1f} s at call {call} "
            f"for rank(s) {peers} ({why}; distributed_timeout_s={self.timeout_s:g})"
        )

    # ------------------------------------------------------------------ control lines

    def _write(self, field: int, value: int) -> None:
        self._lines[self.rank * (LINE_BYTES // 8) + field] = value

    def _read_line(self, rank: int, field: int) -> int:
        return self._lines[rank * (LINE_BYTES // 8) + field]

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Unmap everything and remove any name still there (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for name, _ in self._retired:
            _unlink(name)
        self._retired = []
        _unlink(self._mine.name)
        if self.rank == 0:
            _unlink(self._control_name)
        self._mine.close()
        for mapping in self._peers.values():
            mapping.close()
        self._peers = {}
        self._lines.release()
        with contextlib.suppress(BufferError):
            self._control_mm.close()


def _pause_for(waited: float) -> Callable[[], None] | None:
    """Spin first (the peer is usually a few microseconds behind), then yield the core,
    then sleep: two ranks on two cores must not starve each other."""
    if waited < SPIN_S:
        return None
    if waited < YIELD_S:
        return _yield
    return _sleep


def _yield() -> None:
    time.sleep(0)


def _sleep() -> None:
    time.sleep(SLEEP_S)
