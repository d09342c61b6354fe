"""Each rank's own part of the training state, kept where its process's death cannot take it.

Data-parallel replicas share their model and optimizer state, so any of
them can save or serve it. What they do not share dies with a lost process:
its random streams (each rank draws its own dropout masks) and its data
position (each reads its own shard). A dying gasp or a restarted process
then continued that rank from its seed, and the job was no longer the one a
fault-free run trains.

So every rank writes its own part, a few KB, into ``own-r<rank>`` in the
node agent's snapshot directory as it starts each update (by then the step
drew every random number and batch it will draw). The directory is the
agent's: the record outlives the process, and a survivor on the node (a
dying gasp) or the rank's replacement (a restart in place) reads it.

The file holds two records written in turn, so the one being written never
replaces the only good one; each is ``step i64 | length u64 | XXH3-64 u64``
then the bytes, and its header is rewritten last. A reader takes the record
of the step it asks for whose checksum matches; a record torn by a kill
mid-write fails its checksum and is not used. The bytes are the adapter's
(:func:`trainguard.adapters.torch.state.pack`): no code runs on load.
Writing costs a copy of the bytes into a mapping kept open (no system call).
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import struct
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import xxhash

from ..api import CheckpointError

__all__ = ["OwnRecords", "carry", "install_own", "own_steps", "read_own", "read_own_file"]

log = logging.getLogger("trainguard.snapshot")
F = TypeVar("F")

_MAGIC = b"TGOWN001"
_FILE = struct.Struct("<8sQ")  # magic, capacity of each record
_HEAD = struct.Struct("<qQQ")  # step, length, checksum
_MIN_CAPACITY = 32 << 10


def _path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"own-r{rank}"


def _open(path: Path, flags: int) -> int:
    # Never through a link someone planted in a shared directory.
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


class OwnRecords:
    """The writer of one rank's records (its process only).

    Args:
        directory: the node agent's snapshot directory.
        rank: the rank whose records these are.
    """

    def __init__(self, directory: str | os.PathLike, rank: int) -> None:
        self.path = _path(directory, rank)
        self._map: mmap.mmap | None = None
        self._capacity = 0
        self._next = 0  # the record written next
        self.written: int | None = None  # step of the newest record

    def write(self, step: int, data: bytes) -> None:
        """Record ``data`` as this rank's own part at ``step``. A step
        recorded again replaces its own record, so the step before stays
        readable (a dump one step back needs it)."""
        if len(data) > self._capacity:
            self._grow(len(data))
        slot = self._next ^ 1 if step == self.written else self._next
        at = _FILE.size + slot * (_HEAD.size + self._capacity)
        m = self._map
        _HEAD.pack_into(m, at, -1, 0, 0)  # torn until the header is back
        m[at + _HEAD.size:at + _HEAD.size + len(data)] = data
        _HEAD.pack_into(m, at, step, len(data), xxhash.xxh3_64_intdigest(data))
        self._next = slot ^ 1
        self.written = step

    def _grow(self, need: int) -> None:
        """A new file, big enough, replaces the old one whole (its newest
        record copied over), so a reader never sees a half-resized file."""
        capacity = max(_MIN_CAPACITY, 1 << (need - 1).bit_length())
        old = self._records() if self._map is not None else []
        tmp = self.path.with_name(self.path.name + ".new")
        tmp.unlink(missing_ok=True)
        fd = _open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.ftruncate(fd, _FILE.size + 2 * (_HEAD.size + capacity))
            m = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        _FILE.pack_into(m, 0, _MAGIC, capacity)
        _HEAD.pack_into(m, _FILE.size, -1, 0, 0)
        _HEAD.pack_into(m, _FILE.size + _HEAD.size + capacity, -1, 0, 0)
        os.replace(tmp, self.path)
        if self._map is not None:
            self._map.close()
        self._map, self._capacity, self._next, self.written = m, capacity, 0, None
        for step, data in old[-1:]:
            self.write(step, data)

    def _records(self) -> list[tuple[int, bytes]]:
        return _valid(self._map, self._capacity)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def _valid(m: mmap.mmap | bytes, capacity: int) -> list[tuple[int, bytes]]:
    """The records whose checksum matches, oldest step first."""
    out = []
    for i in range(2):
        at = _FILE.size + i * (_HEAD.size + capacity)
        step, length, digest = _HEAD.unpack_from(m, at)
        if step < 0 or length > capacity:
            continue
        data = bytes(m[at + _HEAD.size:at + _HEAD.size + length])
        if xxhash.xxh3_64_intdigest(data) == digest:
            out.append((step, data))
    return sorted(out)


def read_own_file(path: str | os.PathLike) -> bytes | None:
    """The whole record file at ``path`` (``None``: none, not a file)."""
    try:
        fd = _open(Path(path), os.O_RDONLY | os.O_NONBLOCK)  # a planted FIFO must not block us
    except OSError:
        return None
    try:
        return os.read(fd, 64 << 20) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _records_of(raw: bytes | None) -> list[tuple[int, bytes]]:
    """The sound records of a whole file's bytes (none for a torn or foreign one)."""
    if raw is None or len(raw) < _FILE.size:
        return []
    magic, capacity = _FILE.unpack_from(raw, 0)
    if magic != _MAGIC or len(raw) != _FILE.size + 2 * (_HEAD.size + capacity):
        return []
    return _valid(raw, capacity)


def own_steps(raw: bytes | None) -> list[int]:
    """The steps a record file's bytes hold a sound record of."""
    return [step for step, _ in _records_of(raw)]


def install_own(directory: str | os.PathLike, rank: int, raw: bytes) -> None:
    """Put a record file (a copy from another host) in place as ``rank``'s
    on this node, whole: a reader sees the old file or the new one."""
    final = _path(directory, rank)
    tmp = final.with_name(final.name + ".copy")
    tmp.unlink(missing_ok=True)
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.write(fd, raw)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def read_own(directory: str | os.PathLike, rank: int, step: int) -> bytes | None:
    """The own part ``rank`` recorded at ``step`` on this node, or ``None``
    when there is none (no file, another step, a torn or foreign file)."""
    return next((data for s, data in _records_of(read_own_file(_path(directory, rank))) if s == step), None)


def carry(ranks: Iterable[int], step: int, *, by: int, recorded: Callable[[int, int], bytes | None],
          check: Callable[[int, bytes, str], None], write: Callable[[int, int, bytes], F]) -> list[F]:
    """A dying gasp's survivor ``by`` writes the records of ``step`` that
    the lost ``ranks`` left on its node (``recorded(rank, step)``) as files
    of that step's checkpoint (``write(step, rank, data)``), each first
    passing the adapter's ``check(rank, data, what)`` (which raises
    ``CheckpointError``). A rank whose record is
    missing or unreadable is skipped with a warning: the save goes on, and
    the relaunch names what it lacks."""
    files = []
    for rank in ranks:
        what = f"rank {rank}'s record of step {step} on this node"
        data = recorded(rank, step)
        try:
            if data is None:
                raise CheckpointError(f"there is no {what}")
            check(rank, data, what)
        except CheckpointError as e:
            log.warning("rank %d cannot carry rank %d's own part (random streams, data position): %s", by, rank, e)
            continue
        files.append(write(step, rank, data))
    return files
