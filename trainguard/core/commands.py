"""The controller's commands to ranks, and their answers, as plain data.

The controller's core (:mod:`trainguard.core.control`) builds a
:class:`Command` and reads a :class:`CommandResult`; the protobuf messages
of the same names (``protocol/trainguard.proto``) are made and read only at
the edge, in :mod:`trainguard.core.control.wire`. Each action mirrors the
fields of its protobuf message (``Stop`` of ``Stop``...); the command's
:attr:`Command.name` is the ``action`` field it fills there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .api import RankStatus, Transfer
from .checkpoint_parts import FileInfo, SavedShard

__all__ = ["Action", "Clean", "Command", "CommandResult", "Exit", "Finalize", "Rebuild", "Repair", "Resume",
           "Rollback", "Save", "Stop", "Transfer"]


@dataclass(frozen=True)
class Stop:
    """Leave the step at the next safe point; ``at_boundary``: finish the
    step in hand and stop at its boundary, releasing no collective."""

    reason: str = ""
    at_boundary: bool = False


@dataclass(frozen=True)
class Clean:
    """Clear the failed step's state (``uce``: the device's too, after a memory error)."""

    uce: bool = False


@dataclass(frozen=True)
class Rebuild:
    """Build process-group ``generation`` without ``excluded``, or, with
    ``join_store``, with the replacement processes that meet there."""

    generation: int
    excluded: tuple[int, ...] = ()
    join_store: str = ""


@dataclass(frozen=True)
class Repair:
    """Copy state between replicas (``transfers``) to reach ``step``."""

    step: int
    transfers: tuple[Transfer, ...] = ()


@dataclass(frozen=True)
class Rollback:
    step: int


@dataclass(frozen=True)
class Save:
    """Save this rank's own part at ``step``, its shards of ``kinds``, and
    the own parts of the lost ranks in ``carry``."""

    step: int
    kinds: tuple[int, ...] = ()
    carry: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finalize:
    """Complete the checkpoint of ``step`` from what the savers wrote."""

    step: int
    shards: tuple[SavedShard, ...] = ()
    history_json: str = ""
    own: tuple[FileInfo, ...] = ()


@dataclass(frozen=True)
class Resume:
    """Train on from ``step``; ``replicas``: data-parallel replicas from now on."""

    step: int
    record_json: str = ""
    pids_json: str = ""
    replicas: int = 0


@dataclass(frozen=True)
class Exit:
    code: int
    reason: str = ""


Action = Union[Stop, Clean, Rebuild, Repair, Rollback, Save, Finalize, Resume, Exit]


@dataclass(frozen=True)
class Command:
    """One command of episode ``epoch``; one object may go to many ranks."""

    id: int
    epoch: int
    action: Action

    @property
    def name(self) -> str:
        """Which action it carries: ``"stop"``, ``"clean"``... ``"exit"``."""
        return type(self.action).__name__.lower()


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    """A rank's answer to command ``command_id``, with its status; a save's
    answer lists the files it wrote (``shards``: only kind and files set)."""

    command_id: int
    ok: bool
    status: RankStatus
    code: int = 0
    message: str = ""
    shards: tuple[SavedShard, ...] = ()
    own: tuple[FileInfo, ...] = ()
