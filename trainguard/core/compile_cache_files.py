"""The files of a compile cache entry, copied with their size and checksum.

A restore copies each file of an entry while hashing it and refuses the
entry (:class:`InvalidEntry`) unless every file has the size and SHA-256
its manifest gives; a publication copies the framework's files while
hashing them and writes them durably (synced files and directories), so
a renamed entry is complete on storage. What the manifest holds, and when
an entry is used, is :mod:`.compile_cache`'s.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Mapping

__all__ = ["InvalidEntry", "copy_checked", "copy_hashed", "empty_dir", "file_size", "fsync_dir", "identity",
           "write_synced"]

_CHUNK = 1 << 20


class InvalidEntry(Exception):
    """An entry that must not be used; the message says why."""


def identity(path: Path) -> tuple[int, int] | None:
    """Which directory is at ``path`` now (a new publication is a new one)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def file_size(path: Path) -> int:
    """The size of the file at ``path``; -1 when there is none."""
    try:
        return path.stat().st_size
    except OSError:
        return -1


def copy_checked(src: Path, dst: Path, meta: Mapping[str, Any], *, private: bool = False) -> int:
    """Copy one file of an entry, refusing it unless its size and checksum
    are the manifest's; ``private``: and unless it is a file of this user
    (or root) that no one else may write (an entry whose manifest carries
    no keyed checksum is trusted only so)."""
    size = file_size(src)
    if size < 0:
        raise InvalidEntry(f"{src} is missing")
    if size != meta["size"]:
        raise InvalidEntry(f"{src} has {size} bytes, its manifest says {meta['size']} (truncated or changed)")
    try:
        got = copy_hashed(src, dst, synced=False, private=private)
    except PermissionError as e:
        raise InvalidEntry(str(e)) from None
    except OSError as e:
        raise InvalidEntry(f"{src} could not be read ({e})") from None
    if got["sha256"] != meta["sha256"] or got["size"] != meta["size"]:
        raise InvalidEntry(f"{src} does not match its checksum (corrupt)")
    return got["size"]


def copy_hashed(src: Path, dst: Path, *, synced: bool = True, private: bool = False) -> dict:
    """Copy ``src`` (never through a link) to ``dst`` (made new, 0700 at
    most: its directory too), hashing it on the way; its ``size`` and
    ``sha256``. ``synced``: on storage before it returns; ``private``: see
    :func:`copy_checked`.

    Raises:
        OSError: ``PermissionError`` for a file ``private`` refuses, ``ELOOP`` for a link, ...
    """
    dst.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with os.fdopen(os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as fin:
        st = os.fstat(fin.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{src} is not a regular file")
        if private and (st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022):
            raise PermissionError(f"{src} may be written by another user (uid {st.st_uid}, mode "
                                  f"{stat.S_IMODE(st.st_mode):o})")
        with os.fdopen(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                               st.st_mode & 0o700 | 0o600), "wb") as fout:  # compiled libraries stay loadable
            while chunk := fin.read(_CHUNK):
                digest.update(chunk)
                fout.write(chunk)
                size += len(chunk)
            if synced:
                fout.flush()
                os.fsync(fout.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` as the new file ``path`` (0600, never through a link), on storage before it returns."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                   "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Put the names in directory ``path`` on storage, where the file system allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network file systems refuse fsync on a directory
    finally:
        os.close(fd)


def empty_dir(path: Path) -> None:
    """Remove what directory ``path`` holds, leaving it empty."""
    if path.is_dir():
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
