"""What a rank tells the controller besides its faults and statuses
(:class:`~trainguard.core.api.Fault`, :class:`~trainguard.core.api.RankStatus`),
as plain data: its registration and its periodic saves' health. The
protobuf messages of the same meaning are read at the edge only
(:mod:`trainguard.core.control.wire`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .api import RankStatus
from .replicas import ReplicaGroup

__all__ = ["Hello", "PersistReport"]


@dataclass(frozen=True, kw_only=True)
class Hello:
    """A rank's registration, the first message of its session.

    ``replicas``: its replica groups, one per kind of state (none: it alone
    holds its state); ranks that send the same group share one object.
    ``joining``: a replacement process joining a recovery.
    """

    rank: int
    pid: int
    status: RankStatus
    host: str = ""
    replicas: tuple[ReplicaGroup, ...] = ()
    joining: bool = False
    device_repairable: bool = False  # in-process repair after a device memory error
    resumed_after_dump: str = ""  # the cause of the dying gasp it resumed from ("": none)
    join_refused: str = ""  # why no new process can join this rank's job (recover-in-place, recover)


@dataclass(frozen=True, kw_only=True)
class PersistReport:
    """Whether a rank's periodic saves reach storage: ``failing``, a streak
    began at ``since_step`` for ``reason``, the newest complete checkpoint
    then being ``last_complete`` (None: none known); not failing, they
    reach it again."""

    failing: bool
    since_step: int = 0
    reason: str = ""
    last_complete: int | None = None
