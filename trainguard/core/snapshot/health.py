"""Whether a rank's periodic saves reach storage, told once per change.

A store that fails (full, over quota, read-only, an I/O error, a directory
gone) must not stop training whose state is still in memory: the save
fails, the previous checkpoint stays whole, training goes on and the next
periodic save tries again. :class:`PersistHealth` keeps the log to one
WARNING per streak of failed saves and one INFO when a save gets through
again, and tells the controller (``trainguard status``) of each change.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Callable

__all__ = ["Failing", "PersistHealth"]

log = logging.getLogger("trainguard.snapshot")


@dataclass(frozen=True, kw_only=True)
class Failing:
    """A streak of saves that did not reach storage."""

    since: int  # the step of its first failed save
    reason: str  # why that one failed
    last_complete: int | None  # the newest complete checkpoint (None: none known), untouched
    latest: int  # the step of its latest failed save
    failed: int = 1  # how many saves failed in it

    def describe(self) -> str:
        complete = "none" if self.last_complete is None else f"step {self.last_complete}"
        return f"persist failing since step {self.since}: {self.reason}; last complete checkpoint: {complete}"


class PersistHealth:
    """Whether one rank's periodic saves reach storage, told once per change
    rather than once per save: the first failed save of a streak logs one
    WARNING (its step, the reason, the newest complete checkpoint, which
    stays as it was), the next ones of the streak are only counted, and the
    first later save that succeeds logs one INFO. ``tell`` hears each change
    (the :class:`Failing`, ``None`` once saves work again): the Guard hands
    it to the controller, for ``trainguard status``.

    Training goes on through a streak (its state is in memory) and the next
    periodic save is the retry. The failed step itself is not written again,
    although its snapshot may still be in a slot: holding that slot until the
    store recovers leaves the snapshots one slot fewer (with the default two,
    a crash during a copy would leave none in memory), and only a write
    tells that the store recovered -- the next save's write, which costs as
    much and brings a newer state. Only the last save of a job has no next
    one: :meth:`closing` says so.

    Args:
        rank: this rank, for the log.
        tell: called with each change (may be set later).
    """

    def __init__(self, rank: int, tell: Callable[[Failing | None], None] | None = None) -> None:
        self.rank, self.tell = rank, tell
        self.failing: Failing | None = None
        self.streaks: list[Failing] = []  # ended ones
        self.newest_final: int | None = None  # the newest checkpoint this process saw finalised

    def failed(self, step: int, reason: str, last_complete: int | None = None) -> None:
        """The save of ``step`` failed; ``last_complete``: the step the
        store's tracker names (None: unknown)."""
        if self.failing is not None:
            if step > self.failing.latest:  # (a rank's own part and its shard of one step fail as one save)
                self.failing = replace(self.failing, latest=step, failed=self.failing.failed + 1)
            return
        if last_complete is None:
            last_complete = self.newest_final
        self.failing = Failing(since=step, reason=reason, last_complete=last_complete, latest=step)
        log.warning("rank %d: the checkpoint of step %d was not saved: %s. Training goes on from memory and the "
                    "next periodic save tries again; the newest complete checkpoint is %s. Until a save "
                    "succeeds, no further failure is logged", self.rank, step, reason,
                    "none" if last_complete is None else f"step {last_complete}")
        self._tell()

    def saved(self, step: int, *, final: bool = False) -> None:
        """This rank's part of the save of ``step`` reached storage (with
        ``final``: the checkpoint was finalised). A step no newer than the
        streak's latest failure does not end it (its other part failed)."""
        if final:
            self.newest_final = max(step, self.newest_final or 0)
        if self.failing is None or step <= self.failing.latest:
            return
        ended, self.failing = self.failing, None
        self.streaks.append(ended)
        log.info("rank %d: the save of step %d reached storage: the store works again (%d save%s failed, "
                 "steps %d-%d)", self.rank, step, ended.failed, "" if ended.failed == 1 else "s", ended.since,
                 ended.latest)
        self._tell()

    def closing(self) -> None:
        """Training ended: warn when its last saves failed (no later one will try)."""
        if self.failing is not None:
            failed = "save" if self.failing.failed == 1 else f"{self.failing.failed} saves"
            log.warning("rank %d: training ended with its last %s failed (%s): the newest complete checkpoint is "
                        "older than the final state", self.rank, failed, self.failing.describe())

    def report(self) -> dict:
        """The streak going on (``None``: saves work) and every one so far."""
        return {"persist_failing": None if self.failing is None else asdict(self.failing),
                "persist_streaks": [asdict(f) for f in self.streaks + ([self.failing] if self.failing else [])]}

    def _tell(self) -> None:
        if self.tell is not None:
            self.tell(self.failing)
