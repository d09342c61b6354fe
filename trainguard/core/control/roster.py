"""The controller's table of ranks: who registered, and what each last said.

:class:`~trainguard.core.control.controller.ControllerCore` owns one :class:`Roster`.
It keeps the bookkeeping of ranks that needs no decision: registering a
rank (its replica groups checked against its peers', its pids kept), updating a
rank from its messages, the sets of ranks leaving, finished or dropped, the
ranks whose periodic saves fail, and the views :func:`~trainguard.core.control.decide.decide`
takes. The core decides what a change means (a fault, a phase done).
"""

from __future__ import annotations

from typing import Callable

from ..api import ConfigError, DataStatus, ProtocolError, RankState, RankStatus, RunStatus
from ..reports import Hello, PersistReport
from .episode import Rank
from ..replicas import Layout, Registry, ReplicaGroup

__all__ = ["Roster"]


class Roster:
    """Every rank the controller heard of.

    Args:
        world_size: number of ranks in the job.
        clock: monotonic seconds, for when a rank was last heard.
    """

    def __init__(self, world_size: int, clock: Callable[[], float]) -> None:
        self.world_size = world_size
        self._clock = clock
        self.ranks: dict[int, Rank] = {}
        self.registry = Registry(world_size)
        self.pids: dict[int, list[int]] = {}  # rank -> every pid that registered as it, oldest first
        self.exiting: set[int] = set()  # told to exit: their end is no fault
        self.finished: set[int] = set()  # said goodbye
        self.dropped: set[int] = set()  # ranks elastic-training went on without
        self.persist_failing: dict[int, dict] = {}  # rank -> its streak of saves that do not reach storage
        #: ``(step, cause)`` of the dying gasp the job resumed from (``None``: none), as its ranks said.
        self.resumed_after: tuple[int, str] | None = None

    def register(self, hello: Hello) -> Rank:
        """Add a rank from its first message (a new process replaces the lost one).

        Raises:
            ProtocolError: the rank is already connected, or its replica
                groups are malformed or disagree with its peers'.
        """
        rank = hello.rank
        old = self.ranks.get(rank)
        if old is not None and old.alive:
            raise ProtocolError(f"rank {rank} is already registered by pid {old.pid} on {old.host}")
        try:
            groups = self.registry.register(rank, hello.replicas or [ReplicaGroup.full([rank])])
        except ConfigError as e:
            raise ProtocolError(f"rank {rank}: {e}") from None
        self.pids.setdefault(rank, []).append(hello.pid)
        self.exiting.discard(rank)
        r = Rank(rank=rank, pid=hello.pid, host=hello.host, repairable=hello.device_repairable, groups=groups,
                  step=0, run=RunStatus.STARTING, data=DataStatus.UPDATED, last_seen=self._clock(),
                  join_refused=hello.join_refused)
        r.update(hello.status)
        self.ranks[rank] = r
        if hello.resumed_after_dump and not hello.joining and self.resumed_after is None:
            # Every rank resumed from the same checkpoint: the first to say so speaks for all.
            self.resumed_after = (r.step, hello.resumed_after_dump)
        return r

    def known(self, rank: int) -> Rank:
        """A registered rank.

        Raises:
            ProtocolError: it never registered.
        """
        r = self.ranks.get(rank)
        if r is None:
            raise ProtocolError(f"message from unregistered rank {rank}")
        return r

    def heard(self, rank: int, status: RankStatus) -> Rank:
        """A registered rank sent a message carrying its status: it is alive now."""
        r = self.known(rank)
        r.last_seen = self._clock()
        r.update(status)
        return r

    def persist(self, rank: int, health: PersistReport) -> None:
        """A rank's periodic saves stopped reaching storage (a streak begins), or reach it again."""
        self.known(rank)
        if health.failing:
            self.persist_failing[rank] = {"since_step": health.since_step, "reason": health.reason,
                                          "last_complete": health.last_complete}
        else:
            self.persist_failing.pop(rank, None)

    def all_done(self) -> bool:
        """Every rank finished, or was dropped."""
        return len(self.finished | self.dropped) == self.world_size

    def view(self) -> dict[int, RankState]:
        """What :func:`~trainguard.core.control.decide.decide` knows of each rank."""
        return {
            r.rank: RankState(rank=r.rank, step=r.step, data=r.data, run=r.run, alive=r.alive,
                              stopped=r.stopped, device_repairable=r.repairable, join_refused=r.join_refused)
            for r in self.ranks.values()
        }

    def layout(self) -> Layout:
        """Each rank's replica groups."""
        return {r.rank: r.groups for r in self.ranks.values()}

    def missing(self) -> set[int]:
        """The ranks that never registered and were not dropped."""
        return set(range(self.world_size)) - set(self.ranks) - self.dropped
