"""Which ranks went silent too long: the controller's heartbeat limits.

:class:`~trainguard.core.control.controller.ControllerCore` owns one
:class:`Liveness` and asks it, from its ``tick``, which live ranks have said
nothing for longer than their limit; the core itself ends those ranks and
reports them as hung. Nothing here sends commands or changes a rank beyond
forgiving the time the event loop itself stood still.
"""

from __future__ import annotations

from typing import Iterable

from ..config import ControllerConfig
from .episode import Rank

__all__ = ["Liveness"]


class Liveness:
    """The silence limits of one job's ranks.

    Args:
        config: the heartbeat misses and the first step's limit.
        heartbeat_interval_s: how often a rank sends a heartbeat.
        now: the core's clock (monotonic seconds) when it started.
    """

    def __init__(self, config: ControllerConfig, heartbeat_interval_s: float, now: float) -> None:
        self.config = config
        self.heartbeat_interval_s = heartbeat_interval_s
        self._last_tick = now
        self._next_scan = 0.0

    def forgive_stall(self, now: float, ranks: Iterable[Rank]) -> None:
        """Add to every rank's last message the time the event loop was held
        up since the last tick (beyond half a second)."""
        stalled = now - self._last_tick - 0.5
        self._last_tick = now
        if stalled > 0:
            # The event loop itself was held up: that is no rank's fault, so
            # nobody's silence during it counts.
            for r in ranks:
                r.last_seen += stalled

    def silent(self, now: float, ranks: Iterable[Rank]) -> list[Rank]:
        """The live ranks silent past their limit; looked for at most twice a
        heartbeat interval (none in between)."""
        if now < self._next_scan:
            return []
        self._next_scan = now + self.heartbeat_interval_s / 2
        return [r for r in ranks if r.alive and now - r.last_seen > self.limit(r)]

    def limit(self, r: Rank) -> float:
        """How long a rank may go without a message: the missed-heartbeat
        limit, stretched so that a pause of the whole process up to five of
        its steps (a long garbage collection holds every thread) is not
        taken for a loss; before the rank reported a step time, the first
        step's limit (a graph compile holds the GIL, and with it the
        heartbeat thread, for seconds); while a section is open on it (an
        evaluation may compile too), that section's limit. A dead process
        is found sooner by its ended session, a stopped or frozen one by its
        node agent."""
        beats = self.heartbeat_interval_s * self.config.heartbeat_misses
        if r.step_time_s <= 0:
            return max(beats, self.config.first_step_silence_s, r.silence_s)
        return max(beats, 5 * r.step_time_s + 2 * self.heartbeat_interval_s, r.silence_s)
