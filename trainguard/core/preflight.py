"""Start-up checks of what can be proven wrong before step 0.

Each rank runs them before its first collective. Every rank sees the same
settings and storage, so every rank fails the same way at the same point:
the job ends at once with one clear message, instead of a rank that refused
alone leaving its peers waiting in a collective, or a setting found wrong
only when a dying-gasp checkpoint needs it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from pathlib import Path

from .api import ConfigError

__all__ = ["check_checkpoint_dir"]

_PROBE = b"trainguard: can checkpoints be written here?\n"


def check_checkpoint_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and prove that this process can write there.

    A probe file named for this process is created, written, fsynced and
    removed. Permission bits cannot tell (root ignores them), nor can
    ``os.access`` on a read-only mount or a full disk, where only the write
    fails -- on some filesystems only its fsync.

    Returns:
        The directory.

    Raises:
        ConfigError: naming the directory and the system's reason.
    """
    root = Path(path).expanduser()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"checkpoint_dir {root} is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"checkpoint_dir {root} cannot be created ({e.strerror or e}): {e}") from None
    probe = root / f".trainguard-probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_and_remove(probe)
    except OSError as e:
        raise ConfigError(f"checkpoint_dir {root} is not writable ({e.strerror or e}): {e}") from None
    return root


def _write_and_remove(probe: Path) -> None:
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, _PROBE)
            os.fsync(fd)
        finally:
            os.close(fd)  # network filesystems may report a failed write only here
    except OSError:
        with contextlib.suppress(OSError):  # the write's error is the one to report
            probe.unlink()
        raise
    probe.unlink()
