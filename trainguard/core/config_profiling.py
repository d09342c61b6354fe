"""Profiling's settings, read from the environment once: where each rank
records its markers and under which rules (:class:`ProfilingConfig`, the
recorder's, :mod:`.profiling.recorder`), and where the controller's live
detection finds them (:meth:`ProfilingConfig.job_dir_from_env`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .api import ConfigError

__all__ = ["ProfilingConfig", "job_id_from_env"]


def job_id_from_env(environ: Mapping[str, str], started_at: float) -> str:
    """TaskD's rule: ``MINDX_TASK_ID``, else trainguard's job id, else
    ``default_task_id_<unix seconds>`` (``started_at`` must be the same on
    every rank)."""
    return (environ.get("MINDX_TASK_ID") or environ.get("TRAINGUARD_JOB_ID")
            or f"default_task_id_{int(started_at)}")


@dataclass(frozen=True, kw_only=True)
class ProfilingConfig:
    """Where one rank records and under which rules.

    ``directory`` is TaskD's ``/user/cluster-info/profiling``; the cap covers
    everything under it (TaskD's ``upper_limit_of_disk_in_mb``).
    """

    directory: Path
    switch_path: Path
    job_id: str
    rank: int
    cap_mb: float = 5000.0
    file_mb: float = 10.0
    poll_s: float = 0.5
    disk_check_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.job_id or "/" in self.job_id or self.job_id in (".", ".."):
            raise ConfigError(f"profiling job id {self.job_id!r} cannot name a directory")
        if not self.cap_mb > 0 or not self.file_mb > 0:
            raise ConfigError(f"profiling cap and file size must be > 0 MB, got {self.cap_mb} and {self.file_mb}")
        if not 0 < self.poll_s <= 1.0:
            raise ConfigError(f"poll_s must be in (0, 1] (switch changes must apply within 2 s), got {self.poll_s}")

    @classmethod
    def from_env(cls, *, rank: int, started_at: float, environ: Mapping[str, str] | None = None,
                 directory: str | os.PathLike | None = None, **overrides: Any) -> "ProfilingConfig | None":
        """Settings from ``TRAINGUARD_PROFILING_*`` (``directory`` wins over
        the variable); ``None`` when no directory is set: profiling is off.

        Raises:
            ConfigError: a cap that is not a positive number, a bad job id.
        """
        environ = os.environ if environ is None else environ
        root = directory if directory is not None else environ.get("TRAINGUARD_PROFILING_DIR")
        if not root:
            return None
        root = Path(root)
        switch = environ.get("TRAINGUARD_PROFILING_SWITCH") or root / "profilingSwitch"
        cap = environ.get("TRAINGUARD_PROFILING_CAP_MB")
        if cap is not None:
            try:
                overrides.setdefault("cap_mb", float(cap))
            except ValueError:
                raise ConfigError(f"TRAINGUARD_PROFILING_CAP_MB={cap!r} is not a number") from None
        return cls(directory=root, switch_path=Path(switch), job_id=job_id_from_env(environ, started_at),
                   rank=rank, **overrides)

    @staticmethod
    def job_dir_from_env(job_id: str, environ: Mapping[str, str] | None = None) -> Path | None:
        """``<profiling dir>/<job id>`` of the ranks of the job ``job_id``
        (by the ranks' rule, :func:`job_id_from_env`, with ``job_id`` last),
        or ``None`` when ``TRAINGUARD_PROFILING_DIR`` is not set."""
        environ = os.environ if environ is None else environ
        root = environ.get("TRAINGUARD_PROFILING_DIR")
        if not root:
            return None
        return Path(root) / job_id_from_env({"TRAINGUARD_JOB_ID": job_id, **environ}, time.time())
