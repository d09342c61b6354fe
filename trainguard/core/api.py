"""The contract of trainguard's core: states, faults, plans and errors.

Everything else in :mod:`trainguard.core` is built on these types. They are
plain enums and frozen dataclasses so that decisions can be computed and
tested without processes, sockets or a framework.

Steps are counted as *completed optimizer updates*: a rank at step ``n`` has
applied ``n`` updates, and the loop iteration it runs next is the one that
produces step ``n + 1``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Mapping

__all__ = [
    "ControllerState",
    "DataStatus",
    "EXIT_AFTER_DUMP",
    "EXIT_UNRECOVERABLE",
    "EXIT_HUNG",
    "Fault",
    "FaultKind",
    "Plan",
    "RankState",
    "RankStatus",
    "RecoveryRecord",
    "RunStatus",
    "Severity",
    "Strategy",
    "Transfer",
    "TrainguardError",
    "ConfigError",
    "ProtocolError",
    "TransitionError",
    "RecoveryError",
    "ResumeError",
    "ForceStop",
    "ControllerLostError",
    "CheckpointError",
]

#: Exit code of every rank after a successful dying-gasp save (EX_TEMPFAIL):
#: the job stopped on purpose and relaunching it resumes from the checkpoint.
EXIT_AFTER_DUMP = 75
#: Exit code when the controller decided that nothing could be recovered.
EXIT_UNRECOVERABLE = 76
#: A rank whose training loop hung is ended with this code.
EXIT_HUNG = 77


class DataStatus(enum.Enum):
    """Whether a rank's model + optimizer state may be copied or saved.

    ``UPDATED`` -> ``UPDATING`` when an optimizer update starts, back to
    ``UPDATED`` when it ends (and the step count advances). A rank whose state
    is being replaced from a replica is ``COPYING`` until the copy is
    verified; it may enter ``COPYING`` from either of the other two states.
    """

    UPDATED = 1
    UPDATING = 2
    COPYING = 3


class RunStatus(enum.Enum):
    """What a rank is doing, as the controller sees it.

    ``STARTING`` -> ``TRAINING`` after registration; ``TRAINING`` ->
    ``STOPPED`` when the rank left its step (stop command or own fault), and
    ``STOPPED`` -> ``STOPPED`` for a further stop command;
    ``STOPPED`` <-> ``RECOVERING`` around each recovery command;
    ``STOPPED`` -> ``TRAINING`` on resume; any live state -> ``EXITING``;
    ``TRAINING`` -> ``FINISHED`` at the end of training. A replacement
    process stays ``STARTING`` until its recovery's first command
    (``STARTING`` -> ``RECOVERING``); an offline rank (no controller) goes
    ``STARTING`` -> ``STOPPED`` on a fault. The table is
    :data:`trainguard.core.transitions.RUN`.
    """

    STARTING = 1
    TRAINING = 2
    STOPPED = 3
    RECOVERING = 4
    EXITING = 5
    FINISHED = 6


class ControllerState(enum.Enum):
    """The controller's state machine (MindIO's, with explicit phases).

    ``INIT`` -> ``NORMAL`` once every rank registered. ``NORMAL`` ->
    ``ABNORMAL`` on a fault: every healthy rank is stopped and the step is
    locked (prelock). ``ABNORMAL`` -> ``RECOVERING`` when a plan was chosen,
    ``RECOVERING`` -> ``NORMAL`` when training resumed, ``RECOVERING`` ->
    ``ABNORMAL`` when the plan failed and the next strategy is tried.
    ``DUMPING`` is the dying-gasp save; it and ``EXIT`` end in ``EXITED``.
    ``NORMAL`` -> ``FINISHED`` when every rank finished training.
    """

    INIT = 1
    NORMAL = 2
    ABNORMAL = 3
    RECOVERING = 4
    DUMPING = 5
    EXITED = 6
    FINISHED = 7


class FaultKind(enum.Enum):
    UCE = 1
    COMM = 2
    PROCESS_LOST = 3
    HANG = 4
    UNKNOWN = 5

    @property
    def in_process(self) -> bool:
        """True for faults the process survives and can be repaired in."""
        return self in (FaultKind.UCE, FaultKind.COMM)


class Severity(enum.Enum):
    LOW = 1
    HIGH = 2
    CORRUPTED = 3


class Strategy(enum.Enum):
    """TaskD's recover strategies, in the words users write in configs."""

    RETRY = "retry"
    RECOVER_IN_PLACE = "recover-in-place"
    RECOVER = "recover"
    ELASTIC_TRAINING = "elastic-training"
    DUMP = "dump"
    EXIT = "exit"


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One fault on one rank, as detected or reported."""

    kind: FaultKind
    rank: int
    severity: Severity = Severity.HIGH
    message: str = ""
    phase: str = ""
    occurred_at: float | None = None  # unix time, when known
    detected_at: float = 0.0  # unix time on the controller

    @property
    def corrupts_state(self) -> bool:
        """True when this rank's own state can no longer be trusted."""
        if self.kind is FaultKind.COMM:
            return False
        return not (self.kind is FaultKind.UCE and self.severity is Severity.LOW)

    @property
    def cause(self) -> str:
        """The fault's class, the same whichever rank it struck: its kind and, for a raised error,
        the error's type (``unknown ValueError``, ``process_lost``). A relaunch that fails with the
        cause of the dying gasp it resumed from, at that step, stops instead of looping."""
        head = self.message.split(":", 1)[0].strip()
        error = head if re.fullmatch(r"[A-Za-z_][\w.]*", head) else ""
        return f"{self.kind.name.lower()} {error}".strip()

    def describe(self) -> str:
        what = self.kind.name.lower().replace("_", " ")
        if self.kind is FaultKind.UCE:
            what = f"device memory error ({self.severity.name.lower()})"
        detail = f": {' '.join(self.message.split())}" if self.message else ""  # one line (gloo's span several)
        return f"rank {self.rank}: {what}{detail}"


@dataclass(frozen=True, kw_only=True)
class RankState:
    """The controller's view of one rank at decision time."""

    rank: int
    step: int
    data: DataStatus
    run: RunStatus
    alive: bool = True
    stopped: bool = False  # left its step and is waiting for commands
    device_repairable: bool = True
    join_refused: str = ""  # why no new process can join its job (empty: one can)


@dataclass(frozen=True, kw_only=True)
class RankStatus:
    """What a rank says of itself in each of its messages (its ``Status``)."""

    step: int
    run: RunStatus
    data: DataStatus
    step_time_s: float = 0.0  # median of its recent steps (0: none yet)
    silence_s: float = 0.0  # the limit of a section open on it (0: none)


@dataclass(frozen=True)
class Transfer:
    """Copy the ``kind`` part of the state (0 dense, 1 experts) from ``src``
    to ``dst``."""

    src: int
    dst: int
    kind: int = 0


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the controller will do about a fault episode.

    ``transfers`` are the state copies a retry makes (source replica to bad
    or stale rank). ``savers`` maps each shard to the rank that saves it and
    ``finaliser`` is the one rank that renames the checkpoint (dump).
    ``participants`` are the live ranks the plan's commands go to.
    ``replacements`` maps each lost rank a new process is started for to the
    node agent that starts it (recover-in-place: its own; recover: another).
    """

    strategy: Strategy
    step: int
    participants: tuple[int, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    savers: Mapping[int, int] = field(default_factory=dict)
    finaliser: int | None = None
    exit_code: int = 0
    replacements: Mapping[int, str] = field(default_factory=dict)
    #: An exit no relaunch can help (the fault repeats the one the job resumed from): launchers
    #: do not restart the job (``--max-restarts`` is not spent on it).
    final: bool = False


@dataclass(frozen=True, kw_only=True)
class RecoveryRecord:
    """One handled fault, as reported to users (and written into reports)."""

    fault: str
    rank: int
    step: int
    strategy: str
    reason: str
    detect_s: float | None  # fault -> detected, when the fault's time is known
    recover_s: float | None
    lost_steps: int
    detected_at: float | None = None  # unix time; compare with a fault log's strike time
    message: str = ""  # the first fault, as detected
    cause: str = ""  # the first fault's class, the same on every rank (Fault.cause)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class TrainguardError(Exception):
    """Root of every error trainguard raises on purpose."""


class ConfigError(TrainguardError, ValueError):
    """A setting, environment variable or argument is wrong."""


class ProtocolError(TrainguardError):
    """A control-plane message was malformed, unauthenticated or unexpected."""


class TransitionError(TrainguardError, RuntimeError):
    """A state machine was asked for a transition its table does not allow."""


class RecoveryError(TrainguardError, RuntimeError):
    """A recovery could not be carried out; the caller should give up."""


class ControllerLostError(RecoveryError):
    """The controller stopped answering; no recovery can be coordinated."""


class CheckpointError(TrainguardError, RuntimeError):
    """A checkpoint could not be written, verified or found."""


class ResumeError(CheckpointError):
    """A rank could not load the state the job resumes from: no rank trains
    on (every rank raises it, naming the rank that failed) and nothing
    newer is written; the checkpoint it tried stays as it was."""


class ForceStop(TrainguardError, RuntimeError):
    """Raised in the training thread to leave a step the controller stopped.

    The message starts with ``FORCE STOP`` like MindIO's, so code that
    classifies errors by text sees a normal stop, not a fault.
    """

    def __init__(self, reason: str = "stopped by the controller") -> None:
        super().__init__(f"FORCE STOP: {reason}")
