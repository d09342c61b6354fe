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
from typing import Iterable, Mapping

from .api import ConfigError, Strategy
from .config import check_env
from .faults import FaultSpec, faults_from_env

__all__ = ["LaunchConfig", "unrunnable"]

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


def unrunnable(strategies: Iterable[Strategy], *, max_restarts: int, spare_slots: int) -> str | None:
    """Why a strategy in ``strategies`` can never act under these launch flags, or ``None``.

    A pure function of the flags, asked before any worker starts (``trainguard run`` refuses the job
    with exit 2): ``recover-in-place`` and ``recover`` start new processes, which draw on the
    restart budget (``--max-restarts``); ``recover`` starts them on another node's spare slots
    (``--spare-slots``, which every node is given alike; a single node has no other node, so its
    launcher passes 0). Listing such a strategy would otherwise pass it over at the first fault
    ("the job's limit is spent") and fall back without saying so before.
    """
    strategies = tuple(strategies)
    why = []
    restarting = [s.value for s in strategies if s in (Strategy.RECOVER_IN_PLACE, Strategy.RECOVER)]
    if restarting and max_restarts < 1:
        why.append(f"{' and '.join(restarting)} start{'s' if len(restarting) == 1 else ''} new processes, which "
                   f"draw on the restart budget, and it is 0: add --max-restarts N (N >= 1)")
    if Strategy.RECOVER in strategies and spare_slots < 1:
        why.append("recover starts a lost rank's new process on another node's spare slot, and there is none: "
                   "give every node --spare-slots N (N >= 1) in a job of several nodes, or use recover-in-place")
    return "; ".join(why) or None
