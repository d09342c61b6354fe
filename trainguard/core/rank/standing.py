"""A rank's standing as it tells the controller: its step, its run status
and its data status, each change checked against the legal transitions
(:mod:`..transitions`). The per-step calls only change a field; they never
touch the network (:class:`~.processor.Processor` sends the standing with
every message)."""

from __future__ import annotations

import logging

from ..api import DataStatus, RunStatus, TransitionError
from ..transitions import Locked, advance

__all__ = ["Standing"]

log = logging.getLogger("trainguard.processor")


class Standing:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.step = 0
        self.data = DataStatus.UPDATED
        self._run = Locked(RunStatus.STARTING, f"rank {rank}")

    # ----------------------------------------------------------- run status
    @property
    def run(self) -> RunStatus:
        """What this rank is doing; changed only by :meth:`set_run`."""
        return self._run.value

    def set_run(self, new: RunStatus, what: str) -> None:
        """Change the run status to ``new`` (``what``: the cause, for the error), checked and set under one
        lock: reports come from other threads (stop listeners, the watchdog, a background saver).

        Raises:
            TransitionError: ``run -> new`` is not in :data:`~.transitions.RUN`.
        """
        self._run.set(new, what)

    def _set_run_reporting(self, new: RunStatus, what: str) -> None:
        """:meth:`set_run` for a report that must go out whatever the state (raised on another thread, an error
        would lose it): an illegal change is logged at ERROR instead, the state stays, the report goes out."""
        try:
            self.set_run(new, what)
        except TransitionError as e:
            log.error("%s; the report is sent anyway (run status stays %s)", e, self.run.name)

    # ----------------------------------------------------------- hot path
    def start_update(self) -> None:
        self.data = advance(self.data, DataStatus.UPDATING, what=f"rank {self.rank} start_update")

    def end_update(self, step: int) -> None:
        self.data = advance(self.data, DataStatus.UPDATED, what=f"rank {self.rank} end_update")
        self.step = step

    def abandon_update(self) -> None:
        """The update window closes without an update: it failed before it
        changed the state, which is still that of :attr:`step`."""
        self.data = advance(self.data, DataStatus.UPDATED, what=f"rank {self.rank} abandon_update")

    def begin_copy(self) -> None:
        """This rank's state is being replaced from a replica."""
        self.data = advance(self.data, DataStatus.COPYING, what=f"rank {self.rank} repair")

    def end_copy(self, step: int) -> None:
        self.data = advance(self.data, DataStatus.UPDATED, what=f"rank {self.rank} repair")
        self.step = step
