"""What the controller knows about ranks and about a fault episode.

Plain records, kept by :class:`~trainguard.core.control.controller.ControllerCore`:
one :class:`Rank` per registered rank, one :class:`Episode` per fault (or
planned pause), the :class:`Phase` of its plan being carried out, and the
:class:`Starts` of new processes being started for lost or dropped ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..api import DataStatus, Fault, Plan, RankStatus, RecoveryRecord, RunStatus, Strategy
from ..checkpoint_parts import FileInfo, SavedShard
from ..commands import Command
from ..replicas import ReplicaGroup

__all__ = ["Episode", "Phase", "Rank", "Starts"]


@dataclass
class Rank:
    rank: int
    pid: int
    host: str
    repairable: bool
    groups: tuple[ReplicaGroup, ...]
    step: int
    run: RunStatus
    data: DataStatus
    last_seen: float
    alive: bool = True
    stopped: bool = False
    reached: int = 0  # highest step this rank ever reported
    step_time_s: float = 0.0  # median of its recent steps, as it reported
    silence_s: float = 0.0  # the limit of a section open on it (0: none)
    join_refused: str = ""  # why no new process can join its job (empty: one can)

    def update(self, status: RankStatus) -> None:
        self.step, self.run, self.data = status.step, status.run, status.data
        self.reached = max(self.reached, self.step)
        self.silence_s = status.silence_s
        if status.step_time_s > 0:
            self.step_time_s = status.step_time_s


@dataclass
class Phase:
    name: str
    timeout_s: float  # 0: nobody answers
    build: Callable[[], dict[int, Command]]
    commands: dict[int, Command] = field(default_factory=dict)
    deadline: float = 0.0
    waiting: set[int] = field(default_factory=set)
    also_wait: tuple[int, ...] = ()  # join: replacements, done when they register


@dataclass
class Episode:
    epoch: int
    faults: list[Fault]
    detected_at: float  # wall clock
    reached: int
    stop_deadline: float = 0.0  # monotonic
    unstopped: set[int] = field(default_factory=set)
    tried: set[Strategy] = field(default_factory=set)
    plan: Plan | None = None
    reason: str = ""
    phases: list[Phase] = field(default_factory=list)
    record: RecoveryRecord | None = None
    shards: list[SavedShard] = field(default_factory=list)  # of a dump, their files filled in as savers answer
    own: list[FileInfo] = field(default_factory=list)  # every rank's own part in a dump
    join_store: str = ""  # where replacement processes rendezvous with the survivors
    started: set[int] = field(default_factory=set)  # ranks a replacement was started for
    starts: Starts | None = None
    grow: bool = False  # a planned pause to scale back up (elastic-training), no fault
    escalate_at: float = 0.0  # grow: ranks not stopped at a boundary by then are stopped mid-step


@dataclass
class Starts:
    """New processes being started for ranks: the first one's agent serves
    the store they all meet the survivors on; the others are ordered once
    its address is known."""

    placement: dict[int, str]  # rank -> node agent that starts it
    generation: int
    step: int
    orders: dict[int, int] = field(default_factory=dict)  # rank -> id of its start order
    started: dict[int, int] = field(default_factory=dict)  # rank -> pid
    store: str = ""

    @property
    def done(self) -> bool:
        return len(self.started) == len(self.placement)
