"""Checkpoint directories that a reader never sees half-written.

A checkpoint is a directory named by its step in the framework's habit
(:data:`TORCH`: ``step_00000123``; :data:`MEGATRON`: ``iter_0000123``;
:data:`MINDSPORE`: ``ttp_saved_checkpoints-step_123``, files under
``rank_{r}/``). It
is written as ``<name>_tmp``; every file's size and SHA-256 are recorded as
it is written; one rank then verifies every file, writes ``manifest.json``,
renames the directory to its final name and, last, rewrites the tracker file
(``latest_step.txt`` / ``latest_checkpointed_iteration.txt``). A checkpoint
whose shards do not cover the world its layout names is never finalised
(:mod:`.manifest` holds the rule). What the files, shards and directory
names are is :mod:`.checkpoint_parts`'s.

:meth:`CheckpointStore.latest` walks the complete checkpoints newest first,
verifies each against its manifest and returns the first one that passes,
logging why each newer one was skipped. A manifest is checked whole before
any of it is used, and a file is read only where it lies in the checkpoint
directory: no symbolic link is followed. Formats that could run code on load
are never used: the manifest is JSON and tensors are loaded by the adapters
with ``weights_only=True``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Callable, Collection, Iterator, Mapping, Sequence

from .events import note
from . import integrity, manifest as manifests
from .api import CheckpointError, ConfigError
from .checkpoint_parts import MEGATRON, MINDSPORE, TORCH, FileInfo, Naming, SavedShard, shard_file
from .manifest import FORMAT, MANIFEST
from .private import directory_problem, shared_allowed, write_replace
from .verified import Verified, identity, trust_problem

__all__ = [
    "FORMAT",
    "MEGATRON",
    "MINDSPORE",
    "TORCH",
    "CheckpointStore",
    "FileInfo",
    "Naming",
    "SavedShard",
    "Verified",
    "io_error",
    "shard_file",
]

log = logging.getLogger("trainguard.checkpoint")

TMP_SUFFIX = "_tmp"
_CHUNK = 8 << 20
_FROM_ENV = object()
#: Files of a checkpoint: made new, never through a link, readable by this user only (its directory is 0700).
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.bytes += len(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def io_error(what: str, e: OSError) -> CheckpointError:
    """The store's failure to do ``what``, in words a user acts on (a full disk says so)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(f"{what}: the disk is full ({e.strerror}); the previous checkpoint is untouched")
    return CheckpointError(f"{what}: {e.strerror or e}")


class CheckpointStore:
    """One directory of checkpoints for one job.

    Args:
        root: the checkpoint directory (created 0700 on first save).
        naming: the framework's directory and tracker names.
        keep: how many complete checkpoints to keep (0: all).
        key: the key of the manifests' HMAC (:mod:`.integrity`; default:
            this process's, from the environment; ``None``: none).
        writer: this store saves (a directory of another user, or one
            others may rename in, is refused: unless
            ``TRAINGUARD_ALLOW_SHARED_DIRS=1``); ``False`` only reads.

    Raises:
        ConfigError: a writer's directory of another user; a key file that cannot be used.
    """

    def __init__(self, root: str | os.PathLike, naming: Naming = TORCH, *, keep: int = 0, key=_FROM_ENV,
                 writer: bool = True) -> None:
        self.root = Path(root)
        self.naming = naming
        self.keep = keep
        self.key: bytes | None = integrity.key_from_env() if key is _FROM_ENV else key
        self.shared = shared_allowed()
        why = directory_problem(self.root, allow_shared=self.shared) if writer and self.root.exists() else None
        if why is not None:
            raise ConfigError(f"checkpoint directory {self.root} {why}")

    # ---------------------------------------------------------------- write
    def tmp_path(self, step: int) -> Path:
        return self.root / (self.naming.dirname(step) + TMP_SUFFIX)

    def final_path(self, step: int) -> Path:
        return self.root / self.naming.dirname(step)

    def write(self, step: int, name: str, write: Callable[[BinaryIO], None]) -> FileInfo:
        """Write one file of ``step``'s checkpoint under the temporary name.

        ``write`` receives a binary file object and must write sequentially.

        Raises:
            CheckpointError: the file could not be written (disk full, ...).
        """
        path = self._file(step, name)
        try:
            with os.fdopen(os.open(path, _CREATE, 0o600), "wb") as raw:
                writer = _HashingWriter(raw)
                write(writer)
                raw.flush()
                os.fsync(raw.fileno())
        except OSError as e:
            raise io_error(f"writing {path}", e) from None
        return FileInfo(name, writer.bytes, writer.hash.hexdigest())

    def write_buffer(self, step: int, name: str, data: memoryview | bytes) -> FileInfo:
        """Write ``data`` as one file of ``step``'s checkpoint (temporary
        name), hashing each chunk on a second thread while it is being
        written (hashlib and ``os.write`` both release the GIL). A file left
        half-written by an error is removed.

        Raises:
            CheckpointError: the file could not be written (disk full, ...).
        """
        path = self._file(step, name)
        view, digest = memoryview(data).cast("B"), hashlib.sha256()
        try:
            with ThreadPoolExecutor(1) as pool, os.fdopen(os.open(path, _CREATE, 0o600), "wb", buffering=0) as out:
                for pos in range(0, len(view), _CHUNK):
                    chunk = view[pos:pos + _CHUNK]
                    hashing = pool.submit(digest.update, chunk)
                    while chunk:
                        chunk = chunk[out.write(chunk):]
                    hashing.result()
                os.fsync(out.fileno())
        except OSError as e:
            path.unlink(missing_ok=True)
            raise io_error(f"writing {path}", e) from None
        return FileInfo(name, len(view), digest.hexdigest())

    def copy_file(self, step: int, name: str, data: memoryview, xxh3: int | None) -> FileInfo:
        """Write ``data`` (a sealed snapshot slot's payload, mapped) as one
        file of ``step``'s checkpoint, recording the checksum the slot was
        sealed with: nothing is hashed again. Every load checks the file
        against it. A half-written file is removed. (``write`` from the
        mapping in 8 MiB chunks: ``sendfile`` from tmpfs measured 15% slower
        on ext4.)

        Raises:
            CheckpointError: the file could not be written (disk full, ...).
        """
        path = self._file(step, name)
        view = memoryview(data).cast("B")
        try:
            with os.fdopen(os.open(path, _CREATE, 0o600), "wb", buffering=0) as out:
                for pos in range(0, len(view), _CHUNK):
                    chunk = view[pos:pos + _CHUNK]
                    while chunk:
                        chunk = chunk[out.write(chunk):]
                os.fsync(out.fileno())
        except OSError as e:
            path.unlink(missing_ok=True)
            raise io_error(f"writing {path}", e) from None
        finally:
            view.release()
        return FileInfo(name, len(data), "", xxh3)

    def write_path(self, step: int, name: str, write: Callable[[Path], None]) -> FileInfo:
        """Like :meth:`write`, for writers that take a path (a framework's own
        save function); the file is synced and hashed afterwards."""
        path = self._file(step, name)
        try:
            write(path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            return FileInfo(name, path.stat().st_size, sha256_of(path))
        except OSError as e:
            raise io_error(f"writing {path}", e) from None

    def _file(self, step: int, name: str) -> Path:
        """The path of ``name`` (``file`` or ``subdir/file``) in ``step``'s
        temporary directory, with its directory created."""
        why = manifests.name_problem(name)  # what verify() accepts
        if why is not None:
            raise CheckpointError(f"invalid checkpoint file name {name!r}: it {why}")
        path = self.tmp_path(step) / name
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.tmp_path(step).mkdir(mode=0o700, exist_ok=True)
            path.parent.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            raise io_error(f"creating {path.parent}", e) from None
        return path

    def finalize(self, step: int, files: Sequence[FileInfo], *, layout: Mapping | None = None,
                 meta: Mapping | None = None, rehash: bool = True) -> Path:
        """Verify ``step``'s temporary directory, write its manifest, rename it
        to the final name and update the tracker. Called by one rank.

        ``layout`` names ``world_size`` and the ``shards`` saved (each
        :meth:`SavedShard.describe`); they must cover every rank of that
        world for each kind of state (see :mod:`.manifest`). With
        ``rehash`` off only sizes are checked here (for files whose digest
        was taken from the bytes as they were written); every load still
        verifies the checksums.

        Raises:
            CheckpointError: the manifest would not pass :meth:`verify` (a
                partial layout, a malformed record), or a file is missing or
                does not match its record; the temporary directory is left
                for inspection and the tracker is untouched.
        """
        tmp, final = self.tmp_path(step), self.final_path(step)
        manifest = {
            "format": FORMAT,
            "step": step,
            "created": time.time(),
            "layout": dict(layout or {}),
            "files": {f.name: f.record() for f in files},
            "meta": dict(meta or {}),
        }
        try:
            if self.key is not None:  # over the manifest as a reader parses it back
                manifest["mac"] = integrity.seal(self.key, json.loads(json.dumps(manifest)), "checkpoint")
            data = json.dumps(manifest, indent=1, sort_keys=True).encode()
            why = manifests.problem(manifests.parse(data), step)  # exactly what verify() will read
        except (TypeError, ValueError) as e:  # meta that JSON cannot hold
            why = f"its manifest cannot be written as JSON ({e})"
        except CheckpointError as e:
            why = str(e)
        for name, record in manifest["files"].items() if why is None else ():
            why = manifests.file_problem(tmp, name, record, checksum=rehash)
            if why is not None:
                break
        if why is not None:
            raise CheckpointError(f"cannot finalise {tmp}: {why}")
        try:
            with os.fdopen(os.open(tmp / MANIFEST, _CREATE, 0o600), "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            _fsync_dir(tmp)
            if final.exists():  # a same-step checkpoint: keep it until the new one is in place
                old = final.with_name(final.name + ".old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            _fsync_dir(self.root)
            self._write_tracker(step)
        except OSError as e:
            raise io_error(f"finalising {final}", e) from None
        log.info("checkpoint %s finalised (%d files)", final, len(files))
        note("checkpoint", step=step, path=str(final), by=manifest["meta"].get("finalised_by"))  # TRAINGUARD_RUN_DIR
        self._prune(step)
        return final

    def _write_tracker(self, step: int) -> None:
        write_replace(self.root / self.naming.tracker, f"{step}\n".encode())  # a link at its name is replaced
        _fsync_dir(self.root)

    def _prune(self, newest: int) -> None:
        """Drop leftover temporary directories older than ``newest`` and,
        with ``keep``, the oldest complete checkpoints."""
        for path in self.root.iterdir():
            if path.name.endswith(TMP_SUFFIX):
                step = self.naming.step_of(path.name[: -len(TMP_SUFFIX)])
                if step is not None and step < newest:
                    shutil.rmtree(path, ignore_errors=True)
        if self.keep:
            for step, path in list(self._complete())[self.keep:]:
                shutil.rmtree(path, ignore_errors=True)

    # ----------------------------------------------------------------- read
    def _complete(self) -> Iterator[tuple[int, Path]]:
        """Final-named checkpoint directories, newest first."""
        if not self.root.is_dir():
            return iter(())
        found = []
        for path in self.root.iterdir():
            step = self.naming.step_of(path.name)
            if step is not None and path.is_dir():
                found.append((step, path))
        return iter(sorted(found, reverse=True))

    def steps(self) -> list[int]:
        return [s for s, _ in self._complete()]

    def tracked_step(self) -> int | None:
        """The step the tracker names, if it names one."""
        try:
            return int((self.root / self.naming.tracker).read_text().strip())
        except (OSError, ValueError):
            return None

    def verify(self, path: Path) -> Verified:
        """Check a checkpoint directory against its manifest: the manifest
        whole first (:func:`.manifest.problem`: records, file names, a
        layout covering its world), then each file's size and checksum, read
        where it lies in ``path`` without following a symbolic link.

        Raises:
            CheckpointError: naming the directory and what is wrong.
        """
        step, seen = self.naming.step_of(path.name), {}
        manifest, why = manifests.check(path, step, seen)
        why = why or trust_problem(self.key, self.shared, self.root, path, manifest, seen)
        if why is not None:
            raise CheckpointError(f"{path.name}: {why}")
        return Verified(step, path, manifest, {name: identity(st) for name, st in seen.items()})

    def latest(self, exclude: Collection[int] = ()) -> Verified | None:
        """The newest checkpoint that verifies, or ``None`` when there is none.

        Each newer checkpoint that fails verification is logged with the
        reason, and so is a tracker that names a missing or broken one.
        ``exclude``: steps found unusable otherwise (a file that passed its
        checksum but did not load).
        """
        tracked = self.tracked_step()
        for step, path in self._complete():
            if step in exclude:
                continue
            try:
                found = self.verify(path)
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s; falling back to an older one", path, e)
                continue
            if tracked is not None and tracked != step:
                log.warning("tracker %s names step %d but the newest complete checkpoint is step %d",
                            self.naming.tracker, tracked, step)
            log.info("using checkpoint %s", path)
            return found
        if tracked is not None:
            log.warning("tracker names step %d but no complete checkpoint was found in %s", tracked, self.root)
        return None
