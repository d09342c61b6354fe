"""A job's snapshot settings as the adapters take them: the intervals
checked together (:func:`check_settings`) and the directory a rank's
snapshots live in (:func:`directory_for`: the node agent's, so they
outlive the process, else one of the process's own).
"""

from __future__ import annotations

import atexit

from ..api import ConfigError
from .shm import SnapshotDir

__all__ = ["check_settings", "directory_for"]


def check_settings(every: int, count: int, save_every: int) -> None:
    """Raises:
        ConfigError: ``every`` < 0, ``count`` < 1, or a save interval that is
            not a multiple of ``every``."""
    if every < 0 or (every and (count < 1 or (save_every and save_every % every))):
        raise ConfigError(f"snapshot_every={every} must be >= 0 and divide save_every={save_every}; "
                          f"snapshots_in_memory={count} must be >= 1")


def directory_for(name: str, *, node_dir: str | None = None, root: str | None = None) -> SnapshotDir:
    """The node agent's snapshot directory ``node_dir`` (its
    ``TRAINGUARD_SNAPSHOT_DIR``, :attr:`~trainguard.core.config.RankConfig.node_dir`),
    so snapshots outlive this process; without an agent one this process
    owns, named ``name`` under ``root`` (``TRAINGUARD_SNAPSHOT_ROOT``; None:
    /dev/shm) and removed at exit (a crash that unwinds included; a kill -9
    leaves it to :func:`~.shm.sweep`)."""
    if node_dir:
        return SnapshotDir.attach(node_dir)
    directory = SnapshotDir.create(name, root)
    atexit.register(directory.remove)
    return directory
