"""Notice a rank that stopped making progress, in seconds, without crying wolf.

A dead process is noticed elsewhere (its agent sees it exit, its control
session breaks). This module watches a live process from the inside: the
processor's thread asks :meth:`ProgressWatchdog.check` a few times a second
how long the training loop has gone without completing a step, and compares
that with a limit learned from the steps it has seen::

    limit = max(steps_factor x median recent step time, min_limit_s)

(defaults 3 and 2 s). Time that is not the loop's fault does not count:

* **garbage collection** (``gc.callbacks``): a collection in progress, and
  the time collections took, are left out;
* **sections** the loop declares (``with watchdog.section("checkpoint")``):
  while one is open the limit is that section's own -- three times the
  longest it took before, and never below ``first_section_s`` (default
  600 s), since storage and evaluation vary far more than steps do;
  trainguard's own saves open one, users wrap evaluation in one;
* **the first step** has no learned time yet and gets ``first_step_s``
  (default 600 s); after a recovery the clock restarts with what was learned;
* **a pause the adapter recognises** (:attr:`ProgressWatchdog.in_pause`: the
  training thread waits for a ``DataLoader`` whose worker processes are
  starting -- spawned workers import torch and the script, seconds at each
  epoch) is held to ``first_section_s``, as a section seen for the first
  time; the step's own time resumes from the last check that saw it.

What the alarm says matters as much as when it rings. A rank waiting in a
collective is usually the victim of a peer: one stuck elsewhere (which names
itself at its own limit), one frozen (its node agent finds it), or one in a
benign pause such as a long garbage collection (which holds every thread of
that process, so it cannot say so). The adapter sets
:attr:`ProgressWatchdog.in_collective` (a callable: is the training thread
blocked on communication now?), and a rank blocked in a collective raises
only after ``benign_pause_steps + 2`` (7) median steps plus one poll (the
peer's step holds its pause and then the step up to the collective; this
rank's step goes on after it), and says ``in_collective``. The allowance
lasts until the step completes: once the peer is back, the collective
completes and this rank finishes its step with most of the limit spent, and
a check between the two must not take it for a loop hung in Python (CI saw
exactly that). So a collective that never completes on any rank is reported
after ``max(7 x median step, 2 s)`` plus one poll of margin plus up to one
more poll before the check runs (0.5 s with the default poll).

No timers, no threads: the caller owns the clock and the polling.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from ..config import WatchdogConfig  # the watchdog's settings, read with the others

__all__ = ["Alarm", "ProgressWatchdog", "WatchdogConfig"]


@dataclass(frozen=True)
class Alarm:
    idle_s: float  # time without progress, GC and sections left out
    limit_s: float
    why: str  # how the limit was set
    in_collective: bool
    where: str = ""  # where the training thread was, when the adapter can tell

    def describe(self) -> str:
        where = "waiting in a collective" if self.in_collective else "not in a collective"
        at = f"; at {self.where}" if self.where else ""
        return f"no progress for {self.idle_s:.2f} s (limit {self.limit_s:.2f} s: {self.why}; {where}{at})"


class ProgressWatchdog:
    def __init__(self, config: WatchdogConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 track_gc: bool = True) -> None:
        self.config = config or WatchdogConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=self.config.window)
        self._longest: dict[str, float] = {}
        self._sections: list[tuple[str, float]] = []
        #: Set by the adapter: is the training thread blocked on communication?
        self.in_collective: Callable[[], bool] = lambda: False
        #: Set by the adapter: what benign pause the training thread is in now ("" when none).
        self.in_pause: Callable[[], str] = lambda: ""
        #: Set by the adapter: where the training thread is now, in words (for the alarm).
        self.where: Callable[[], str] = lambda: ""
        #: Set by the processor: called as a section opens (it tells the controller).
        self.on_section: Callable[[], None] = lambda: None
        self._armed = False
        self._first = True
        self._since = clock()
        self._excluded = 0.0  # GC time since _since
        self._gc_started: float | None = None
        self._alarmed = False
        self._waited = False  # this step waited on peers in a collective past its own limit
        self._pause_since: float | None = None  # when the benign pause in_pause reports began
        self._track_gc = track_gc
        if track_gc:
            gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._track_gc and self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    # ------------------------------------------------------------ progress
    def arm(self, *, first: bool = False) -> None:
        """Start watching (training began, or resumed after a recovery). The
        next step is timed afresh; until a step time has been learned, or
        with ``first`` (the recovery started new processes: the peers wait in
        the first collective while those import, load and compile), it gets
        the first-step limit and is not learned."""
        with self._lock:
            self._armed, self._first = True, first or not self._steps
            self._restart()

    def disarm(self) -> None:
        """Stop watching (a recovery is under way, or training ended)."""
        with self._lock:
            self._armed = False

    def step_done(self) -> None:
        """A step completed: learn its duration and restart the clock."""
        with self._lock:
            now = self._clock()
            if not self._first:
                self._steps.append(now - self._since - self._excluded)
            self._first = False
            self._restart(now)

    def _restart(self, now: float | None = None) -> None:
        self._since = self._clock() if now is None else now
        self._excluded = 0.0
        self._alarmed = False
        self._waited = False
        self._pause_since = None

    @property
    def median_step_s(self) -> float:
        with self._lock:
            return statistics.median(self._steps) if self._steps else 0.0

    # ------------------------------------------------------------ sections
    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """A stretch that may legitimately take long (a checkpoint save, an
        evaluation). Its time does not count against the step."""
        with self._lock:
            start = self._clock()
            self._sections.append((name, start))
        self.on_section()
        try:
            yield
        finally:
            with self._lock:
                now = self._clock()
                self._sections.remove((name, start))
                took = now - start
                self._longest[name] = max(self._longest.get(name, 0.0), took)
                self._excluded += took

    def section_limit_s(self) -> float:
        """The limit of the innermost open section; 0 when none is open."""
        with self._lock:
            return self._section_limit()[0] if self._sections else 0.0

    def _section_limit(self) -> tuple[float, str]:
        name, _ = self._sections[-1]
        seen = self._longest.get(name)
        limit = max(self.config.section_factor * (seen or 0.0), self.config.first_section_s)
        return limit, (f"section {name!r}, {self.config.section_factor:g} x its longest {seen or 0:.1f} s, "
                       f"at least {self.config.first_section_s:g} s")

    def _on_gc(self, phase: str, info: dict) -> None:
        # No lock: a collection can start while this thread holds it.
        if phase == "start":
            self._gc_started = self._clock()
        elif self._gc_started is not None:
            if not self._sections:  # a section's whole time is left out already
                self._excluded += self._clock() - self._gc_started
            self._gc_started = None

    # --------------------------------------------------------------- check
    def check(self) -> Alarm | None:
        """An :class:`Alarm` the first time the loop has gone too long
        without progress (once per stall), else ``None``."""
        with self._lock:
            if not self._armed or self._alarmed or self._gc_started is not None:
                return None
            now = self._clock()
            if self._sections:
                limit, why = self._section_limit()
                idle = now - self._sections[-1][1]
            else:
                idle = now - self._since - self._excluded
                if self._first or not self._steps:
                    limit, why = self.config.first_step_s, "first step"
                else:
                    median = statistics.median(self._steps)
                    limit = max(self.config.steps_factor * median, self.config.min_limit_s)
                    why = f"{self.config.steps_factor:g} x median step {median:.2f} s, at least " \
                          f"{self.config.min_limit_s:g} s"
            if idle <= limit and self._pause_since is None:
                return None  # the common case: no need to probe the training thread
            try:
                in_collective = bool(self.in_collective())
                pause = "" if in_collective or self._sections else str(self.in_pause() or "")
            except Exception:  # a probe must never break the watchdog
                in_collective, pause = False, ""
            if pause:
                if self._pause_since is None:
                    self._pause_since = now - idle  # from the step's start: what came before is not known
                paused = now - self._pause_since
                if paused <= self.config.first_section_s:
                    self._excluded = now - self._since  # excused up to this sighting; the step goes on from here
                    return None
                idle, limit = paused, self.config.first_section_s
                why = f"{pause}, at least {limit:g} s"
            else:
                self._pause_since = None  # probed at every check while it lasted: its end is known to a poll
                if idle <= limit:
                    return None
            self._waited = self._waited or (in_collective and not self._sections)
            if in_collective or self._waited:
                if self._steps and not self._sections:
                    # The peer's pause, its step up to the collective, the rest of ours.
                    steps = self.config.benign_pause_steps + 2
                    limit = max(limit, steps * statistics.median(self._steps))
                    why += f"; {'in' if in_collective else 'after waiting in'} a collective: " \
                           f"{steps:g} x median step"
                limit += self.config.poll_s
            if idle <= limit:
                return None
            self._alarmed = True
            try:
                where = str(self.where() or "")
            except Exception:  # a probe must never break the watchdog
                where = ""
            return Alarm(idle_s=idle, limit_s=limit, why=why, in_collective=in_collective, where=where)
