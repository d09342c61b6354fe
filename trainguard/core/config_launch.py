"""A node launcher's settings, read from the environment once where it
starts (``trainguard run``, msrun's plugin) and handed to what needs them,
so that a bad value is a ``ConfigError`` before any worker starts.

The controller's settings are :class:`~.config.ControllerConfig`; the
recover strategies are resolved from the flag, ``TRAINGUARD_STRATEGIES``
and the pod's annotation by :func:`~.annotations.resolve_strategies`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .api import ConfigError
from .config import check_env
from .faults import FaultSpec, faults_from_env

__all__ = ["LaunchConfig"]

_ON, _OFF = ("on", "1", "true"), ("off", "0", "false")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What the environment tells one node's launcher."""

    faults: tuple[FaultSpec, ...] = ()  # the job's injected faults, checked against its ranks before any starts
    job_id: str | None = None  # None: the launcher names the job (the rendezvous id, msrun's port)
    spare_slots: int = 0  # workers this node may start for other nodes' ranks (the `recover` strategy)
    standby: bool = True  # restarted workers start in a warm standby process (off: cold)
    snapshot_root: str | None = None  # where the node's snapshot directory goes (None: /dev/shm)

    def __post_init__(self) -> None:
        if self.spare_slots < 0:
            raise ConfigError(f"spare slots (--spare-slots, TRAINGUARD_SPARE_SLOTS) must be >= 0, "
                              f"got {self.spare_slots}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "LaunchConfig":
        """The launcher's settings from the environment.

        Raises:
            ConfigError: an unknown variable, or a value that does not parse
                (the message names the variable).
        """
        environ = os.environ if environ is None else environ
        check_env(environ)
        spare = environ.get("TRAINGUARD_SPARE_SLOTS", "0")
        if not spare.isdigit():
            raise ConfigError(f"TRAINGUARD_SPARE_SLOTS={spare!r} must be a whole number >= 0")
        standby = (environ.get("TRAINGUARD_STANDBY") or "on").strip().lower()
        if standby not in _ON + _OFF:
            raise ConfigError(f"TRAINGUARD_STANDBY={standby!r}: use on or off")
        return cls(faults=faults_from_env(environ), job_id=environ.get("TRAINGUARD_JOB_ID") or None,
                   spare_slots=int(spare), standby=standby in _ON,
                   snapshot_root=environ.get("TRAINGUARD_SNAPSHOT_ROOT") or None)
