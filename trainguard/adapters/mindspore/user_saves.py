"""Each rank's random streams beside the dying gasp a user's ``ckpt_save_fn`` writes.

``TrainFaultTolerance(ckpt_save_fn=fn)`` has one replica write the
parameters with the user's own function, and trainguard renames nothing
after it. The random streams (:func:`.state.streams`: Python's, NumPy's,
MindSpore's generator and its op seeds) are each rank's own, and the user's
file holds none of them; so every survivor of a dump writes its own streams
(and carries those a lost rank recorded on its node) as::

    <ckpt_save_path>/.trainguard/streams/step_<n>/own_r<rank>.json

where ``n`` is the data position the user's files hold
(``cb_params.cur_step_num``). A relaunch resuming there (``ckpt_load_fn``'s
``step_num``, or ``initial_step``) sets each rank's streams back from them.
Each file is written under a temporary name and renamed; it holds the JSON
of :func:`.own.pack`, checked before use (loading runs no code). Without
``ckpt_save_path`` there is nowhere to write them, and the callback says so
before step 0.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .own import own_file

__all__ = ["StreamFiles"]


class StreamFiles:
    """Stream records beside a user's saves, under ``root`` (``ckpt_save_path``)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.directory = Path(root) / ".trainguard" / "streams"

    def path(self, position: int, rank: int) -> Path:
        return self.directory / f"step_{position}" / own_file(rank)

    def write(self, position: int, rank: int, data: bytes) -> Path:
        """Write ``rank``'s packed streams of data position ``position``."""
        path = self.path(position, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def read(self, position: int, rank: int) -> bytes | None:
        """``rank``'s packed streams of ``position``, or ``None`` when none were written."""
        try:
            fd = os.open(self.path(position, rank), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(16 << 20) if stat.S_ISREG(os.fstat(fd).st_mode) else None  # not a planted FIFO
