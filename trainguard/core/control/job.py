"""Where the controller stands: the one state its parts share.

:class:`~trainguard.core.control.controller.ControllerCore`,
:class:`~trainguard.core.control.phases.Phases` and
:class:`~trainguard.core.control.restarts.Restarts` are separate objects; a
fault, a phase and a restart all move the same state machine and the same
episode, so that state lives here, in one :class:`Job` each of them is
given, instead of in attributes of a shared ``self``.
"""

from __future__ import annotations

from ..api import ControllerState, RecoveryRecord
from ..commands import Action, Command
from .episode import Episode, Phase, Rank, Starts
from .roster import Roster
from .status import Journal
from ..transitions import advance

__all__ = ["Job"]


class Job:
    """The controller's state, its current episode and its counters.

    Args:
        roster: the ranks (their sets of leaving, finished, dropped ranks too).
        journal: the event log and the episodes' records.
    """

    def __init__(self, roster: Roster, journal: Journal) -> None:
        self.roster, self.journal = roster, journal
        self.state = ControllerState.INIT
        self.episode: Episode | None = None
        self.generation = 0  # of the ranks' process groups: each rebuild makes a new one
        self.epoch = 0  # of episodes: a rank drops commands of an episode that ended
        self.grow: Starts | None = None  # new processes for dropped ranks, starting while the others train
        self.unwanted: set[int] = set()  # start orders given up before their agent answered
        self._next_id = 1

    def command(self, action: Action) -> Command:
        """A command with a fresh id; one object may go to many ranks."""
        cmd = Command(self._next_id, self.episode.epoch if self.episode else 0, action)
        self._next_id += 1
        return cmd

    def to(self, state: ControllerState) -> None:
        self.state = advance(self.state, state, what="controller")
        self.journal.note("state", state=state.name)
        self.journal.sample_steps(self.roster.ranks, self.roster.finished)

    def current_phase(self) -> Phase | None:
        """The phase of the plan being carried out, if one is."""
        ep = self.episode
        if ep is None or not ep.phases or self.state not in (ControllerState.RECOVERING, ControllerState.DUMPING):
            return None
        return ep.phases[0]

    def record(self) -> RecoveryRecord:
        """The record of this episode (created once, when the plan succeeds)."""
        return self.journal.record(self.episode)

    def lose(self, r: Rank) -> None:
        """The rank's process is gone: the prelock no longer waits for it."""
        r.alive = False
        if self.episode is not None:
            self.episode.unstopped.discard(r.rank)
