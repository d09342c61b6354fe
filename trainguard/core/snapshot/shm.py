"""A job's snapshot directory in shared memory, and who owns it.

One directory per job and node, ``<root>/trainguard-<job>`` (root:
``/dev/shm``), holding each local rank's slots (``r{rank}.s{i}``) and the
copies peers pushed here (``peer/r{rank}``). Its owner -- the node agent
under ``trainguard run``, else the training process itself -- is written in
``owner.json`` (pid and the process's start time, so a reused pid is not
mistaken for the owner). The owner removes the directory when it exits;
whatever a killed owner left is *stale* and removed by the next owner
created on the node (:func:`sweep`). Trainers never remove it: the snapshot
must outlive them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

from ..api import ConfigError
from .segment import Slot

__all__ = ["SnapshotDir", "sweep"]

log = logging.getLogger("trainguard.snapshot")

DEFAULT_ROOT = "/dev/shm"
PREFIX = "trainguard-"
OWNER = "owner.json"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc``), or
    ``None`` when there is no such process -- or only its zombie: a killed
    owner whose parent has not reaped it yet is gone all the same."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def _alive(owner: dict) -> bool:
    pid = owner.get("pid")
    return isinstance(pid, int) and owner.get("host") == socket.gethostname() and \
        _start_time(pid) == owner.get("start")


def sweep(root: str | os.PathLike = DEFAULT_ROOT) -> list[Path]:
    """Remove the snapshot directories of dead owners under ``root``.

    A directory without a readable owner file counts as dead only once it
    is a minute old (an owner may be writing it right now)."""
    removed = []
    for path in Path(root).glob(PREFIX + "*"):
        if not path.is_dir():
            continue
        try:
            owner = json.loads((path / OWNER).read_text())
            stale = not _alive(owner)
        except (OSError, ValueError):
            try:
                stale = time.time() - path.stat().st_mtime > 60
            except OSError:
                continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed stale snapshot directory %s (its owner is gone)", path)
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
        """Make (or take over from a dead owner) the job's directory and own it.

        Raises:
            ConfigError: a live process already owns this job's directory on
                this node (the same job id started twice), or shared memory
                is not usable.
        """
        root = Path(root or DEFAULT_ROOT)
        if not root.is_dir():
            raise ConfigError(f"snapshot memory root {root} does not exist")
        sweep(root)
        name = PREFIX + (re.sub(r"[^A-Za-z0-9_.-]", "_", job) or "job")
        path = root / name
        try:
            owner = json.loads((path / OWNER).read_text())
        except (OSError, ValueError):
            owner = {}
        if isinstance(owner, dict) and _alive(owner) and owner["pid"] != os.getpid():
            raise ConfigError(f"{path} belongs to process {owner['pid']} (job {job!r} runs twice on this node?)")
        (path / "peer").mkdir(parents=True, exist_ok=True)
        tmp = path / (OWNER + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid()),
                                   "host": socket.gethostname(), "job": job, "created": time.time()}))
        tmp.replace(path / OWNER)
        return cls(path, owned=True)

    @classmethod
    def attach(cls, path: str | os.PathLike) -> "SnapshotDir":
        """A directory someone else owns (the node agent's, from the environment).

        Raises:
            ConfigError: it does not exist.
        """
        path = Path(path)
        if not (path / OWNER).is_file():
            raise ConfigError(f"snapshot directory {path} does not exist or has no owner")
        (path / "peer").mkdir(exist_ok=True)
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
