"""One in-memory snapshot slot: a file in shared memory holding a control
header and a safetensors payload.

A slot is written by one trainer and read by its persist worker, a restarted
trainer or a peer. Its first page is the control header::

    magic "TGSNAP02" | state u32 | reserved u32 | checksum u64 | step i64
    | payload bytes u64 | writes u64 | writer pid u64 | committed at f64

and the payload starts at :data:`PAGE`: a complete safetensors file (an
8-byte header length, a JSON header padded with spaces to the reserved
size, then the tensors' bytes back to back, largest element size first so
every tensor is aligned for a typed view). The trainer's skeleton (nesting
and scalars) rides in the safetensors ``__metadata__``. A persisted
checkpoint is the payload written out as is, so ``safetensors`` reads both.

States (:class:`State`): ``EMPTY`` → ``WRITING`` (the trainer copies; a
crash here leaves the slot unusable, never half-read) → ``COMPLETE`` →
``SEALED`` (the persist worker recorded the payload's checksum, XXH3-64:
about 12 GB/s on one core, where zlib's CRC32 does 2.5; only a sealed slot
whose checksum matches is ever loaded). Writers hold an exclusive ``flock``
on the file, readers a shared one; a killed process's locks go with it.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import json
import mmap
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import xxhash

from ..api import CheckpointError

__all__ = ["PAGE", "Entry", "Layout", "Mappings", "Slot", "State", "payload_header"]

MAGIC = b"TGSNAP02"
PAGE = 4096
_HEAD = struct.Struct("<8sIIQqQQQd")
META_KEY = "trainguard"
_CHUNK = 64 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # (O_NONBLOCK: a planted FIFO must not block an open)


class State(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    COMPLETE = 2
    SEALED = 3


@dataclass(frozen=True)
class Entry:
    """One tensor of a layout: safetensors dtype name, shape, byte size."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    itemsize: int


class Layout:
    """Where each tensor sits in a payload. Built once per state structure;
    the same layout is reused for every snapshot of that structure."""

    def __init__(self, entries: Sequence[Entry], *, meta_reserve: int) -> None:
        # Largest element size first: with an 8-aligned data start every
        # offset is then a multiple of its own element size.
        self.entries = sorted(entries, key=lambda e: -e.itemsize)
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for e in self.entries:
            self.offsets[e.name] = (pos, pos + e.nbytes)
            pos += e.nbytes
        self.data_bytes = pos
        self.key = tuple((e.name, e.dtype, e.shape) for e in self.entries)
        tensors = {e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": list(self.offsets[e.name])}
                   for e in self.entries}
        self._tensors_json = json.dumps(tensors, separators=(",", ":"))
        fixed = len(self._tensors_json) + 64
        self.header_bytes = (fixed + meta_reserve + 7) // 8 * 8
        self.data_start = 8 + self.header_bytes
        self.payload_bytes = self.data_start + self.data_bytes

    def header(self, meta: str) -> bytes:
        """The safetensors header (length + JSON padded with spaces) carrying ``meta``."""
        text = self._tensors_json[:-1] + ("," if self.entries else "") + \
            json.dumps("__metadata__") + ":" + json.dumps({META_KEY: meta}, separators=(",", ":")) + "}"
        raw = text.encode()
        if len(raw) > self.header_bytes:
            raise ValueError("metadata outgrew its reserve")
        return struct.pack("<Q", self.header_bytes) + raw + b" " * (self.header_bytes - len(raw))


def payload_header(payload: memoryview | bytes) -> tuple[dict, dict, int]:
    """Parse a safetensors payload: (tensor table, trainguard metadata, data start).

    Raises:
        CheckpointError: the header is malformed.
    """
    try:
        (n,) = struct.unpack_from("<Q", payload, 0)
        if not 0 < n <= len(payload) - 8:
            raise ValueError(f"header length {n}")
        table = json.loads(bytes(payload[8:8 + n]))
        meta = json.loads(table.pop("__metadata__")[META_KEY])
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"malformed snapshot payload header ({e})") from None
    return table, meta, 8 + n


@dataclass(frozen=True)
class Info:
    state: State
    checksum: int  # XXH3-64 of the payload, once sealed
    step: int
    payload_bytes: int
    writes: int
    pid: int
    committed: float


def _map(fd: int, size: int) -> mmap.mmap | None:
    # Every page mapped at once (one call instead of a fault per page), so
    # neither a snapshot copy nor a checksum pass waits on faults.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE) if size else None


def _unmap(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # views handed out are still alive; the mapping goes with them
        pass


class Mappings:
    """Slot mappings kept from one use to the next, one per file, for a
    process that opens the same slots again and again (the persist worker:
    a seal and a persist of every snapshot). Mapping a 1 GB slot costs
    0.1-0.15 s and unmapping it 0.05 s, beside a write of 0.7 s. A file
    replaced or resized since is mapped anew. Thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[Path, tuple[tuple[int, int, int], mmap.mmap | None]] = {}
        self._lock = threading.Lock()

    def get(self, path: Path, fd: int) -> mmap.mmap | None:
        """The mapping of the file open as ``fd`` (at ``path``), whole."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size)
        with self._lock:
            old = self._maps.get(path)
            if old is not None and old[0] == key:
                return old[1]
            if old is not None and old[1] is not None:
                _unmap(old[1])
            self._maps[path] = (key, _map(fd, st.st_size))
            return self._maps[path][1]

    def close(self) -> None:
        with self._lock:
            for _, m in self._maps.values():
                if m is not None:
                    _unmap(m)
            self._maps.clear()


class Slot:
    """One slot file, mapped. Not thread-safe; one user per process (the
    mapping may be shared, see :class:`Mappings`)."""

    def __init__(self, path: Path, mappings: Mappings | None = None) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._locked = 0
        self._shared = mappings

    # ---------------------------------------------------------------- mapping
    def _open(self, create: bool) -> bool:
        """Open the slot file (``create``: make it when missing), never
        through a link: the directory may be shared memory someone else
        planted names in. A file is only ever made anew (``O_EXCL``), and
        only a regular file is used.

        Raises:
            CheckpointError: the name is a link or not a regular file.
        """
        while self._fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | _NOFOLLOW)
            except FileNotFoundError:
                if not create:
                    return False
                try:
                    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
                except FileExistsError:  # made meanwhile: open that one
                    continue
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise CheckpointError(f"snapshot slot {self.path} is a symbolic link: not following it") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise CheckpointError(f"snapshot slot {self.path} is not a regular file")
            self._fd = fd
        return True

    def _mapped(self) -> mmap.mmap:
        if self._shared is not None:
            self._map = self._shared.get(self.path, self._fd)
            return self._map
        size = os.fstat(self._fd).st_size
        if self._map is None or len(self._map) != size:
            if self._map is not None:
                self._map.close()
            self._map = _map(self._fd, size)
        return self._map

    def reserve(self, payload_bytes: int) -> mmap.mmap:
        """Size the slot for ``payload_bytes`` (allocated now, so a full
        ``/dev/shm`` is an error here and never a SIGBUS during a copy) and
        map it (the slot must be locked)."""
        self._open(True)
        size = PAGE + payload_bytes
        if os.fstat(self._fd).st_size != size:
            if self._map is not None:
                self._map.close()
                self._map = None
            try:
                os.ftruncate(self._fd, size)
                os.posix_fallocate(self._fd, 0, size)
            except OSError as e:
                raise CheckpointError(f"cannot reserve {size} bytes for snapshot slot {self.path}: "
                                      f"{e.strerror} (is /dev/shm large enough?)") from None
        return self._mapped()

    def fileno(self) -> int:
        self._open(False)
        return self._fd

    def close(self) -> None:
        if self._map is not None:
            if self._shared is None:
                _unmap(self._map)
            self._map = None
        if self._fd is not None:
            self.unlock()  # a shared mapping holds a duplicate of the descriptor, and with it the lock
            os.close(self._fd)
            self._fd = None

    # ---------------------------------------------------------------- locks
    def lock(self, exclusive: bool, *, block: bool = False) -> bool:
        """Take the slot's lock; ``False`` when another process holds it and
        ``block`` is off, or the slot does not exist."""
        if not self._open(exclusive):
            return False
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if block else fcntl.LOCK_NB)
        try:
            fcntl.flock(self._fd, flags)
        except BlockingIOError:
            return False
        self._locked = 2 if exclusive else 1
        return True

    def unlock(self) -> None:
        if self._fd is not None and self._locked:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._locked = 0

    # ---------------------------------------------------------------- header
    def info(self) -> Info | None:
        """The control header, or ``None`` when the slot is not a snapshot
        slot. Read without mapping the slot: looking at a slot costs nothing
        until its payload is used."""
        if not self._open(False):
            return None
        size = os.fstat(self._fd).st_size
        if size < PAGE:
            return None
        head = os.pread(self._fd, _HEAD.size, 0)
        if len(head) < _HEAD.size:
            return None
        magic, state, _, checksum, step, payload, writes, pid, committed = _HEAD.unpack(head)
        if magic != MAGIC or state not in State._value2member_map_ or PAGE + payload > size:
            return None
        return Info(State(state), checksum, step, payload, writes, pid, committed)

    def _put(self, state: State, *, step: int = -1, payload: int = 0, writes: int = 0) -> None:
        _HEAD.pack_into(self._map, 0, MAGIC, state, 0, 0, step, payload, writes, os.getpid(), time.time())

    # ---------------------------------------------------------------- writer
    def begin(self, payload_bytes: int) -> memoryview:
        """Mark the slot as being written and return its payload area (the
        caller holds the exclusive lock)."""
        m = self.reserve(payload_bytes)
        old = self.info()
        self._writes = (old.writes + 1) if old else 1
        self._put(State.WRITING, writes=self._writes)
        return memoryview(m)[PAGE:PAGE + payload_bytes]

    def commit(self, step: int, payload_bytes: int) -> None:
        self._put(State.COMPLETE, step=step, payload=payload_bytes, writes=self._writes)

    def invalidate(self) -> None:
        """Mark the slot empty (a corrupt or abandoned snapshot)."""
        if self._open(False) and self._mapped() is not None:
            self._put(State.EMPTY)

    # ---------------------------------------------------------------- reader
    def payload(self) -> memoryview:
        info = self.info()
        if info is None:
            raise CheckpointError(f"{self.path} is not a snapshot slot")
        return memoryview(self._mapped())[PAGE:PAGE + info.payload_bytes]

    def seal(self) -> Info | None:
        """Record the payload's checksum (the caller holds a lock). Returns the
        sealed info, or ``None`` when the slot holds no complete snapshot."""
        info = self.info()
        if info is None or info.state not in (State.COMPLETE, State.SEALED):
            return None
        digest = checksum(self.payload())
        again = self.info()
        if again != info:  # rewritten meanwhile (the caller did not hold a lock)
            return None
        _HEAD.pack_into(self._map, 0, MAGIC, State.SEALED, 0, digest, info.step, info.payload_bytes, info.writes,
                        info.pid, info.committed)
        return self.info()

    def verified(self, read: Callable[[memoryview], Any] | None = None) -> Info | tuple[Info, Any]:
        """The slot's info if it holds a sealed snapshot whose checksum
        matches; with ``read``, ``(info, read(payload))``, the read running
        while the checksum pass does (its result is only returned once the
        checksum matched).

        Raises:
            CheckpointError: saying why it cannot be used (empty, being
                written, never sealed, corrupted), or what ``read`` raised.
        """
        info = self.info()
        if info is None:
            raise CheckpointError(f"{self.path.name}: not a snapshot slot")
        if info.state is not State.SEALED:
            raise CheckpointError(f"{self.path.name}: snapshot is {info.state.name.lower()}, not sealed")
        payload, got, failed = self.payload(), None, None
        if read is None:
            digest = checksum(payload)
        else:
            with ThreadPoolExecutor(1) as pool:  # XXH3 runs outside the GIL
                summing = pool.submit(checksum, payload)
                try:
                    got = read(payload)
                except CheckpointError as e:
                    failed = e
                digest = summing.result()
        if digest != info.checksum:
            raise CheckpointError(f"{self.path.name}: step {info.step} fails its checksum (corrupted in memory)")
        if failed is not None:
            raise failed
        return info if read is None else (info, got)


def checksum(data: memoryview | bytes) -> int:
    """XXH3-64 of ``data`` (in chunks: a slot may be gigabytes)."""
    h = xxhash.xxh3_64()
    view = memoryview(data)
    for pos in range(0, len(view), _CHUNK):
        h.update(view[pos:pos + _CHUNK])
    return h.intdigest()
