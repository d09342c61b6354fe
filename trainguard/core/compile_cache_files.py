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


def copy_checked(src: Path, dst: Path, meta: Mapping[str, Any]) -> int:
    """Copy one file of an entry, refusing it unless its size and checksum
    are the manifest's."""
    size = file_size(src)
    if size < 0:
        raise InvalidEntry(f"{src} is missing")
    if size != meta["size"]:
        raise InvalidEntry(f"{src} has {size} bytes, its manifest says {meta['size']} (truncated or changed)")
    try:
        got = copy_hashed(src, dst, synced=False)
    except OSError as e:
        raise InvalidEntry(f"{src} could not be read ({e})") from None
    if got["sha256"] != meta["sha256"] or got["size"] != meta["size"]:
        raise InvalidEntry(f"{src} does not match its checksum (corrupt)")
    return got["size"]


def copy_hashed(src: Path, dst: Path, *, synced: bool = True) -> dict:
    """Copy ``src`` to ``dst`` (its directory created), hashing it on the
    way; its ``size`` and ``sha256``. ``synced``: on storage before it returns."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        if synced:
            fout.flush()
            os.fsync(fout.fileno())
    shutil.copymode(src, dst)  # compiled libraries stay loadable
    return {"size": size, "sha256": digest.hexdigest()}


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` as the file ``path``, on storage before it returns."""
    with open(path, "wb") as f:
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
