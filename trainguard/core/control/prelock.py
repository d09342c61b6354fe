"""The prelock, an episode's first stage: every live rank told to stop.

:class:`~trainguard.core.control.controller.ControllerCore` owns one :class:`Prelock`.
It sends the STOP commands and says which ranks did not stop in time; the
core decides what follows (the plan once all stopped, the laggards ended as
hung). Its state is the episode's own (``unstopped``, ``stop_deadline``,
``escalate_at`` of :class:`~trainguard.core.control.episode.Episode`).
"""

from __future__ import annotations

from typing import Callable, Mapping

from ..commands import Action, Command, Stop
from .episode import Episode, Rank

__all__ = ["Prelock"]


class Prelock:
    """Stops the ranks of one job.

    Args:
        ranks: the controller's ranks (its roster's own table, read when used).
        send: delivers a command to a rank's session.
        command: makes a command with a fresh id (the controller's).
        clock: monotonic seconds, for the deadline.
        timeout_s: how long the ranks have to stop.
    """

    def __init__(self, ranks: Mapping[int, Rank], send: Callable[[int, Command], None],
                 command: Callable[[Action], Command], clock: Callable[[], float], timeout_s: float) -> None:
        self._ranks, self._send, self._command, self._clock = ranks, send, command, clock
        self.timeout_s = timeout_s

    def stop_all(self, ep: Episode, reason: str, at_boundary: bool = False) -> None:
        """Tell every live rank not yet stopped to stop, within the timeout from now."""
        ep.stop_deadline = self._clock() + self.timeout_s
        ep.unstopped = {r.rank for r in self._ranks.values() if r.alive and not r.stopped}
        stop = self._command(Stop(reason=reason, at_boundary=at_boundary))
        for rank in sorted(ep.unstopped):
            self._send(rank, stop)

    def release(self, ep: Episode, now: float) -> None:
        """When scaling back up, once its time came: stop the ranks still running at once."""
        if ep.grow and ep.unstopped and 0 < ep.escalate_at < now:
            # Ranks that began the next step wait in it for the ones that
            # stopped: release them (they stop mid-step, still consistent).
            ep.escalate_at = 0.0
            stop = self._command(Stop(reason="scaling back up"))
            for rank in sorted(ep.unstopped):
                self._send(rank, stop)

    def late(self, ep: Episode, now: float) -> list[int]:
        """The ranks that did not stop by the deadline, in order."""
        return sorted(ep.unstopped) if ep.unstopped and now > ep.stop_deadline else []
