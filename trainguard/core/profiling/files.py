"""Where one rank's profiling records go on disk, and how old ones age out.

Layout (TaskD's)::

    <dir>/<job id>/<rank>/<unix timestamp>     newline-delimited JSON, appended
    <dir>/<job id>/<rank>/parallel_group.json  communication groups -> global ranks

A rank appends to its newest numbered file and starts a new one past
``file_bytes`` (10 MiB). When everything under ``<dir>`` passes the cap, each
rank deletes the oldest 20% of *its own* numbered files, keeping at least
three; any other file (``parallel_group.json``, a note someone left, another
rank's files) is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

__all__ = ["GROUPS_FILE", "RankFiles", "numbered_files", "tree_bytes"]

log = logging.getLogger("trainguard.profiling")

GROUPS_FILE = "parallel_group.json"
KEEP_AT_LEAST = 3
AGE_FRACTION = 0.2


def numbered_files(rank_dir: Path) -> list[Path]:
    """The rank's record files (names made of digits only), oldest first."""
    try:
        entries = [e for e in os.scandir(rank_dir) if e.name.isdigit() and e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    return [Path(e.path) for e in sorted(entries, key=lambda e: int(e.name))]


def tree_bytes(root: Path) -> int:
    """Bytes in regular files under ``root`` (files vanishing meanwhile are skipped)."""
    total = 0
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return total


class RankFiles:
    """Appends one rank's records and enforces the size rules.

    Args:
        root: the profiling directory (``<dir>``), which the cap covers.
        job_id, rank: name the rank's directory.
        file_bytes: start a new file past this size.
        cap_bytes: age files out when ``root`` holds more than this.
        clock: wall time, for new file names.
    """

    def __init__(self, root: str | os.PathLike, job_id: str, rank: int, *, file_bytes: int = 10 << 20,
                 cap_bytes: int = 5000 << 20, clock=time.time) -> None:
        self.root = Path(root)
        self.dir = self.root / job_id / str(rank)
        self.file_bytes, self.cap_bytes = file_bytes, cap_bytes
        self._clock = clock
        self._path: Path | None = None
        self._size = 0
        self.deleted = 0

    @property
    def path(self) -> Path | None:
        """The file being appended to (``None`` before the first write)."""
        return self._path

    def _new_file(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        existing = numbered_files(self.dir)
        stamp = int(self._clock())
        if existing:  # names stay in creation order even within one second or after a clock step
            stamp = max(stamp, int(existing[-1].name) + 1)
        path = self.dir / str(stamp)
        path.touch(exist_ok=False)
        return path

    def append(self, data: bytes) -> None:
        """Append whole lines to the newest file, starting a new one when it is full.

        Raises:
            OSError: the write failed (disk full, directory gone).
        """
        if self._path is None or self._size >= self.file_bytes or not self._path.exists():
            self._path, self._size = self._new_file(), 0
        with open(self._path, "ab") as f:
            f.write(data)
        self._size += len(data)

    def write_groups(self, groups: dict) -> None:
        """Replace ``parallel_group.json`` (atomically: readers never see half)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{GROUPS_FILE}.tmp"
        tmp.write_text(json.dumps(groups, indent=1, sort_keys=True))
        os.replace(tmp, self.dir / GROUPS_FILE)

    def age(self) -> int:
        """If ``root`` is past the cap, delete this rank's oldest 20% of
        numbered files (at least one, keeping three). Returns how many went."""
        if tree_bytes(self.root) <= self.cap_bytes:
            return 0
        files = [p for p in numbered_files(self.dir) if p != self._path]
        total = len(files) + (self._path is not None)
        count = min(max(1, int(total * AGE_FRACTION)), total - KEEP_AT_LEAST)
        gone = 0
        for path in files[:max(0, count)]:
            try:
                path.unlink()
                gone += 1
            except FileNotFoundError:
                continue
        if gone:
            self.deleted += gone
            log.info("profiling directory %s is past its cap of %.3g MiB: deleted this rank's %d oldest record "
                     "files from %s", self.root, self.cap_bytes / (1 << 20), gone, self.dir)
        return gone
