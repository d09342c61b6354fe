"""A job's snapshot directory in shared memory, and who owns it.

One directory per job and node, ``<root>/trainguard-<job>-<random>`` (root:
``/dev/shm``), holding each local rank's slots (``r{rank}.s{i}``) and the
copies peers pushed here (``peer/r{rank}``). Its owner -- the node agent
under ``trainguard run``, else the training process itself -- is written in
``owner.json`` (pid and the process's start time, so a reused pid is not
mistaken for the owner). The owner removes the directory when it exits;
whatever a killed owner left is *stale* and removed by the next owner
created on the node (:func:`sweep`). Trainers never remove it: the snapshot
must outlive them. They learn its path from the owner
(``TRAINGUARD_SNAPSHOT_DIR``), never from the job id.

``/dev/shm`` is writable by every user, so nothing found there is trusted:
the directory is made 0700 under a name no one can guess in advance (a
name that is taken anyway is stepped around, never used), every file in it
is opened without following a link, a directory is only attached, reused
or swept when it is a real directory of our uid (:func:`_refusal`), and a
root anyone may rename entries in (world-writable, not sticky), or whose
owner is another user (the owner of a sticky directory may rename in it),
is refused.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time
from pathlib import Path

from ..api import ConfigError
from ..private import ALLOW_ENV, shared_allowed
from .segment import Slot

__all__ = ["SnapshotDir", "sweep"]

log = logging.getLogger("trainguard.snapshot")

DEFAULT_ROOT = "/dev/shm"
PREFIX = "trainguard-"
OWNER = "owner.json"
_MISSING = ("does not exist", "has no owner")
#: Flags every file in a snapshot directory is opened with: a link planted
#: at its name is refused (``ELOOP``), never followed.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc``), or
    ``None`` when there is no such process -- or only its zombie: a killed
    owner whose parent has not reaped it yet is gone all the same."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat_line.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def _alive(owner: dict) -> bool:
    pid = owner.get("pid")
    return isinstance(pid, int) and owner.get("host") == socket.gethostname() and \
        _start_time(pid) == owner.get("start")


def _refusal(path: Path, closed: int = 0o022) -> str | None:
    """Why ``path`` is not a snapshot directory of ours (``None``: it is):
    it must be a real directory (not a link to one) owned by our uid, with
    none of the ``closed`` permission bits set (default: no one else may
    write in it; 0 skips the check)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    if not stat.S_ISDIR(st.st_mode):
        return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to this process's uid {os.getuid()}"
    if st.st_mode & closed:
        return f"has mode {stat.S_IMODE(st.st_mode):o}, open to other users"
    return None


def _read_owner(path: Path) -> dict | None:
    """The directory's ``owner.json`` (read without following a link), or
    ``None`` when it is missing, not a regular file, or not a JSON object."""
    try:
        fd = os.open(path / OWNER, os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        owner = json.loads(os.read(fd, 1 << 16))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return owner if isinstance(owner, dict) else None


def _write_owner(path: Path, owner: dict) -> None:
    """Write ``owner.json`` whole (0600, through a new file renamed in place)."""
    tmp = path / (OWNER + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(owner, f)
    os.replace(tmp, path / OWNER)


def _check_root(root: Path) -> None:
    """Refuse a root where another user may rename our entries: paths
    below it would then lead wherever they like (``/dev/shm`` is sticky)."""
    try:
        st = os.stat(root)
    except OSError:
        st = None
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"snapshot memory root {root} does not exist")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"snapshot memory root {root} is writable by other users and not sticky (they could "
                          "swap the snapshot directory for a link): use one like /dev/shm (mode 1777)")
    if st.st_uid not in (os.geteuid(), 0) and not shared_allowed():
        # The owner of a sticky directory may rename anything in it: the job's directory, for a link of theirs.
        raise ConfigError(f"snapshot memory root {root} belongs to uid {st.st_uid}, not to this process's uid "
                          f"{os.geteuid()} (nor root): its owner could swap the snapshot directory for a link of "
                          f"theirs; use one of yours or root's like /dev/shm (or set {ALLOW_ENV}=1 if intended)")


def _make_private(root: Path, base: str) -> Path:
    """A new directory ``<base>-<random>`` under ``root``, mode 0700 whatever
    the umask. A name that exists (planted, or a collision) is stepped
    around: ``mkdir`` never reuses anything."""
    for _ in range(16):
        path = root / f"{base}-{secrets.token_hex(8)}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            log.warning("snapshot directory name %s is taken; choosing another", path.name)
            continue
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)  # the umask may have narrowed it
            os.mkdir("peer", 0o700, dir_fd=fd)
        finally:
            os.close(fd)
        return path
    raise ConfigError(f"no free snapshot directory name under {root} (something is planting them?)")


def sweep(root: str | os.PathLike = DEFAULT_ROOT) -> list[Path]:
    """Remove the snapshot directories of dead owners under ``root``.

    Only real directories of our uid are looked at: a link is never
    followed, and another user's directory is never removed (nor trusted).
    A directory without a readable owner file counts as dead only once it
    is a minute old (an owner may be writing it right now)."""
    removed = []
    for path in Path(root).glob(PREFIX + "*"):
        if _refusal(path, 0) is not None:
            continue
        owner = _read_owner(path)
        if owner is not None:
            stale = not _alive(owner)
        else:
            try:
                stale = time.time() - os.lstat(path).st_mtime > 60
            except OSError:
                continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)  # (refuses a link, and follows none inside)
            removed.append(path)
            log.info("removed stale snapshot directory %s (its owner is gone)", path)  # a past job's: housekeeping
    return removed


class SnapshotDir:
    """A job's snapshot directory on this node.

    Use :meth:`create` in the owner and :meth:`attach` elsewhere.
    """

    def __init__(self, path: str | os.PathLike, *, owned: bool = False) -> None:
        self.path = Path(path)
        self.owned = owned

    @classmethod
    def create(cls, job: str, root: str | os.PathLike | None = None) -> "SnapshotDir":
        """Make a new directory for the job (``trainguard-<job>-<random>``,
        0700) and own it; this process's own live directory of the job is
        taken again instead.

        Raises:
            ConfigError: a live process of ours already owns a directory of
                this job on this node (the same job id started twice), or
                shared memory is not usable (or safe: see :func:`_check_root`).
        """
        root = Path(root or DEFAULT_ROOT)
        _check_root(root)
        sweep(root)
        base = PREFIX + (re.sub(r"[^A-Za-z0-9_.-]", "_", job) or "job")
        for path in sorted(root.glob(base + "-*")):
            owner = _read_owner(path) if _refusal(path, 0o077) is None else None
            if owner is None or owner.get("job") != job or not _alive(owner):
                continue
            if owner["pid"] != os.getpid():
                raise ConfigError(f"{path} belongs to process {owner['pid']} (job {job!r} runs twice on this node?)")
            return cls(path, owned=True)
        path = _make_private(root, base)
        _write_owner(path, {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname(),
                            "job": job, "created": time.time()})
        return cls(path, owned=True)

    @classmethod
    def attach(cls, path: str | os.PathLike) -> "SnapshotDir":
        """A directory someone else owns (the node agent's, from the environment).

        Raises:
            ConfigError: it does not exist, has no owner file, or is not
                safe to use: not a real directory of our uid, or writable by
                another user (who could plant links or slots in it).
        """
        path = Path(path)
        why = _refusal(path)
        if why is None and _read_owner(path) is None:
            why = "has no owner"
        if why is not None:
            raise ConfigError(f"snapshot directory {path} {why}" + ("" if why in _MISSING else "; not using it"))
        try:
            os.mkdir(path / "peer", 0o700)
        except FileExistsError:
            pass
        return cls(path)

    def slot(self, rank: int, index: int) -> Slot:
        return Slot(self.path / f"r{rank}.s{index}")

    def peer_copy(self, rank: int) -> Slot:
        return Slot(self.path / "peer" / f"r{rank}")

    def slots_of(self, rank: int) -> list[Slot]:
        """The slots ``rank`` wrote on this node (not a peer's copy)."""
        return [Slot(p) for p in sorted(self.path.glob(f"r{rank}.s*"))]

    def candidates(self, rank: int) -> list[Slot]:
        """Every slot that may hold a snapshot of ``rank``: its own and a peer's copy."""
        peer = self.path / "peer" / f"r{rank}"
        return self.slots_of(rank) + ([Slot(peer)] if peer.is_file() else [])

    def remove(self) -> None:
        """Delete the directory (owner only, at exit)."""
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
            self.owned = False
