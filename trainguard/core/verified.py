"""A checkpoint that passed verification, and its files loaded as verified.

Verifying a file and then opening it again by name would load whatever is
at that name by then: a shard swapped after the check, or rewritten in
place by someone who may write it. :meth:`Verified.open` opens a file once,
from the step directory, no link followed anywhere in the step (the step
directory included), and hands the loader that descriptor:

* a regular file of this user that no one else may write, the same inode
  and change time as when it was verified: as it is;
* one of this user that changed since (swapped): checked again from the
  descriptor before it is handed over;
* one someone else may write (another user's, or open to others): copied
  into memory (``memfd``) while it is checked, and the loader reads the
  copy, which no one else can touch.

A loader that takes a path gets ``/proc/self/fd/N`` (the same open file,
not the name; :meth:`VerifiedFile.named` when it insists on the file's
suffix); one that takes bytes, :meth:`VerifiedFile.read_bytes`; one that
reads several files by a common prefix (TensorFlow's ``model.index`` and
``model.data-*``), :meth:`Verified.linked`'s private directory.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from . import integrity, manifest as manifests
from .api import CheckpointError
from .private import directory_problem

__all__ = ["Verified", "VerifiedFile", "identity", "trust_problem"]


def identity(st: os.stat_result) -> tuple:
    """What changes when a file is swapped or written (the change time cannot be set back)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def others_may_write(st: os.stat_result) -> bool:
    return st.st_uid not in (os.geteuid(), 0) or bool(st.st_mode & 0o022)


def trust_problem(key: bytes | None, shared: bool, root: Path, path: Path, manifest: dict, seen: dict) -> str | None:
    """Why a checkpoint whose checksums hold is still not to be trusted: with
    ``key``, a keyed checksum that does not hold; without one that can be
    checked, a file (``seen``: each one's ``fstat``) or directory another
    user may write -- an unkeyed checksum is anyone's to recompute --,
    unless ``shared`` (``TRAINGUARD_ALLOW_SHARED_DIRS``)."""
    if key is not None and "mac" in manifest:
        why = integrity.check(key, manifest, "checkpoint")
        return None if why is None else f"refused: {why}"
    if shared:
        return None
    open_to_others = [n for n, st in seen.items() if others_may_write(st)]
    dirs = [f"{p} {w}" for p in (path, root) if (w := directory_problem(p)) is not None]
    if not open_to_others and not dirs:
        return None
    kind = "no keyed checksum" if "mac" not in manifest else "a keyed checksum this job has no key to check"
    where = f"{open_to_others[0]} may be written by another user" if open_to_others else dirs[0]
    return (f"refused: it carries {kind}, and {where} (set TRAINGUARD_KEY_FILE, or a shared secret, on the jobs "
            f"that write and read it; or TRAINGUARD_ALLOW_SHARED_DIRS=1 if that is intended)")


class VerifiedFile(os.PathLike):
    """A checkpoint file as it was verified: ``os.fspath`` gives the open
    descriptor's ``/proc/self/fd/N``, ``str`` the file's path (for messages)."""

    def __init__(self, where: Path, fd: int) -> None:
        self.where, self.fd = where, fd
        self.name, self.suffix = where.name, where.suffix

    def __fspath__(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def __str__(self) -> str:
        return str(self.where)

    @contextmanager
    def named(self) -> Iterator[str]:
        """A path that ends in the file's own name, for a loader that reads its
        suffix (MindSpore's ``.ckpt``): a link to this descriptor, in a
        directory of this process's own (0700), removed afterwards."""
        directory = tempfile.mkdtemp(prefix="trainguard-verified-")
        link = os.path.join(directory, self.name)
        os.symlink(os.fspath(self), link)
        try:
            yield link
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def read_bytes(self) -> bytes:
        size, out = os.fstat(self.fd).st_size, bytearray()
        while len(out) < size:
            chunk = os.pread(self.fd, min(size - len(out), 8 << 20), len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)


class _Tee:
    """A reader that copies what it reads to ``fd``."""

    def __init__(self, raw: BinaryIO, fd: int) -> None:
        self.raw, self.fd = raw, fd

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        return data


@dataclass(frozen=True)
class Verified:
    """A checkpoint that passed verification (``seen``: each file's identity then)."""

    step: int
    path: Path
    manifest: dict
    seen: dict = field(default_factory=dict, compare=False, repr=False)

    def file(self, name: str) -> Path:
        """The path of ``name``, for messages and inspection; a loader reads it through :meth:`open`."""
        return self.path / name

    @contextmanager
    def open(self, name: str) -> Iterator[VerifiedFile]:
        """``name`` opened once and handed over as verified (see the module docstring).

        Raises:
            CheckpointError: it is not in the manifest, cannot be opened
                without following a link, or no longer matches its record.
        """
        record = self.manifest.get("files", {}).get(name)
        if not isinstance(record, dict):
            raise CheckpointError(f"{self.path.name}: {name} is not a file of this checkpoint")
        try:
            raw = manifests.open_inside(self.path, name)
        except OSError as e:
            raise CheckpointError(f"{self.path.name}: {manifests.unreadable(name, e)}") from None
        copy = None
        try:
            st = os.fstat(raw.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size != record["bytes"]:
                raise CheckpointError(f"{self.path.name}: {name} changed after it was verified (now {st.st_size} "
                                      f"bytes, not {record['bytes']})")
            if others_may_write(st):  # check a private copy, and load that
                copy = os.memfd_create(f"trainguard-{Path(name).name}", os.MFD_CLOEXEC)
                ok = manifests.matches(_Tee(raw, copy), record)
            elif identity(st) != self.seen.get(name):  # ours, swapped or rewritten since: check it again
                ok = manifests.matches(raw, record)
            else:
                ok = True
            if not ok:
                raise CheckpointError(f"{self.path.name}: {name} changed after it was verified (fails its "
                                      "checksum now): refused")
            fd = copy if copy is not None else raw.fileno()
            os.lseek(fd, 0, os.SEEK_SET)
            yield VerifiedFile(self.path / name, fd)
        finally:
            raw.close()
            if copy is not None:
                os.close(copy)

    @contextmanager
    def linked(self, names: Iterable[str]) -> Iterator[Path]:
        """A private directory (0700, this process's own, removed afterwards)
        in which each of ``names`` is a link to its file opened by :meth:`open`:
        for a loader that finds its files by name, the bytes verified whatever
        is at the checkpoint's names by then.

        Raises:
            CheckpointError: as :meth:`open`, for any of ``names``.
        """
        directory = Path(tempfile.mkdtemp(prefix="trainguard-verified-"))
        try:
            with ExitStack() as files:
                for name in names:
                    opened = files.enter_context(self.open(name))
                    link = directory / name
                    link.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    os.symlink(os.fspath(opened), link)
                yield directory
        finally:
            shutil.rmtree(directory, ignore_errors=True)
