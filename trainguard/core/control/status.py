"""What the controller tells people: its event log, its records, its status view.

:class:`~trainguard.core.control.controller.ControllerCore` decides; this module only
reports. The core owns one :class:`Journal`: the run directory's event log
(see :mod:`trainguard.core.events`) with its sampled step series, the
episodes' :class:`~trainguard.core.api.RecoveryRecord` (built by
:func:`recovery_record`), the link surveys' verdicts and the live slow-node
detection they are passed on to. :func:`status_view` is ``trainguard
status``'s view of the core. Nothing here sends commands or changes the
core's state.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

from ..api import FaultKind, RecoveryRecord
from .episode import Episode, Rank
from ..events import EventLog

__all__ = ["Journal", "persist_view", "recovery_record", "status_view"]

# The controller's logger: the link verdicts are the controller's lines.
log = logging.getLogger("trainguard.controller")


class Journal:
    """The controller's events for the run directory's log, its recovery
    records, and the live slow-node detection's view of the link surveys.

    Args:
        world_size: number of ranks in the job.
        wall: unix seconds, for the events' times.
        ranks_of: the ranks a node agent's host runs (to name a slow host's ranks).
    """

    def __init__(self, world_size: int, wall: Callable[[], float], ranks_of: Callable[[str], list[int]]) -> None:
        self.world_size = world_size
        self._wall = wall
        self._ranks_of = ranks_of
        #: The run directory's event log (``TRAINGUARD_RUN_DIR``; ``trainguard report`` draws it), or None.
        self.events = EventLog.from_env()
        #: Live slow-node detection (a :class:`~trainguard.core.profiling.live.LiveDetector`), when profiling is on.
        self.slow_nodes: Any = None
        self.records: list[RecoveryRecord] = []  # every episode's record, oldest first
        self._sampled: tuple = ()
        self._next_sample = 0.0

    def note(self, ev: str, **fields: Any) -> None:
        """One event for the run directory's log (see :mod:`trainguard.core.events`)."""
        if self.events is not None:
            self.events.write(ev, t=self._wall(), **fields)

    def tick(self, now: float, heartbeat_interval_s: float, ranks: Mapping[int, Rank], finished: set[int]) -> None:
        """Sample the steps at most twice a heartbeat interval (less often above 256 ranks)."""
        if self.events is not None and now >= self._next_sample:
            self._next_sample = now + max(heartbeat_interval_s / 2, self.world_size / 256)
            self.sample_steps(ranks, finished)

    def sample_steps(self, ranks: Mapping[int, Rank], finished: set[int]) -> None:
        """Every rank's step (-1: not registered) and the ranks lost (not alive, not finished), when they changed."""
        if self.events is None or not ranks:
            return
        steps = [ranks[r].step if r in ranks else -1 for r in range(self.world_size)]
        down = sorted(r.rank for r in ranks.values() if not r.alive and r.rank not in finished)
        if (steps, down) != self._sampled:
            self._sampled = (steps, down)
            self.note("steps", steps=steps, down=down)

    def record(self, ep: Episode) -> RecoveryRecord:
        """The record of an episode (created once, when its plan succeeds), kept and logged."""
        if ep.record is not None:
            return ep.record
        ep.record = recovery_record(ep, self._wall())
        self.records.append(ep.record)
        self.note("recovery", **ep.record.to_dict())
        return ep.record

    def link_verdict(self, verdict: dict) -> None:
        """A link survey ended: name the slow host and its ranks (a WARNING), or say none stood out."""
        ranks = self._ranks_of(verdict["slow_node"]) if verdict["slow_node"] else []
        verdict["ranks"] = ranks
        if ranks:
            log.warning("slow node: ranks %s: %s", ranks[:16], verdict["reason"])
        else:
            log.info("link survey: %s", verdict["reason"])
        if self.slow_nodes is not None:
            self.slow_nodes.note_links(verdict)
        self.note("links", **{k: v for k, v in verdict.items() if k != "at"})


def recovery_record(ep: Episode, now: float) -> RecoveryRecord:
    """The record of an episode whose plan succeeded; ``now``: unix seconds."""
    # A peer's broken collective is the symptom; the record names the
    # cause (a lost, hung or failing rank) whichever was detected first.
    first = next((f for f in ep.faults if f.kind is not FaultKind.COMM), ep.faults[0])
    return RecoveryRecord(
        fault=first.kind.name.lower(), rank=first.rank, step=ep.plan.step,
        strategy=ep.plan.strategy.value, reason=ep.reason, cause=first.cause,
        detect_s=(round(first.detected_at - first.occurred_at, 3) if first.occurred_at else None),
        recover_s=round(now - ep.detected_at, 3),
        lost_steps=max(0, ep.reached - ep.plan.step) if ep.plan.step >= 0 else -1,
        detected_at=first.detected_at, message=first.message[:300],
    )


def persist_view(failing: Mapping[int, dict]) -> dict | None:
    """The ranks whose saves fail, and one line for the job (the earliest streak's)."""
    if not failing:
        return None
    rank, first = min(failing.items(), key=lambda item: (item[1]["since_step"], item[0]))
    complete = "none" if first["last_complete"] is None else f"step {first['last_complete']}"
    return {"failing": f"persist failing since step {first['since_step']} on ranks "
                       f"{sorted(failing)[:16]}: {first['reason']}; last complete checkpoint: "
                       f"{complete}",
            "ranks": {str(r): v for r, v in sorted(failing.items())}}


def status_view(core: Any, pids: Mapping[int, Iterable[int]]) -> dict:
    """A JSON-able view of a :class:`~trainguard.core.control.controller.ControllerCore`
    for ``trainguard status`` and agents; ``pids``: every pid each rank registered with."""
    return {
        "state": core.state.name,
        "job_id": core.config.job_id,
        "world_size": core.world_size,
        "heartbeat_interval_s": core.heartbeat_interval_s,
        "ranks": {
            r.rank: {"pid": r.pid, "host": r.host, "step": r.step, "run": r.run.name,
                     "data": r.data.name, "alive": r.alive}
            for r in core.ranks.values()
        },
        "pids": {str(k): v for k, v in pids.items()},
        "recoveries": [rec.to_dict() for rec in core.journal.records],
        "agents_gone": list(core.agents.gone) + [a for a in core.agents.vacated if a not in core.agents.gone],
        "episode": None if core.episode is None else {
            "faults": [f.describe() for f in core.episode.faults],
            "plan": core.episode.plan.strategy.value if core.episode.plan else None,
            "reason": core.episode.reason,
        },
        "slow_nodes": None if core.journal.slow_nodes is None else core.journal.slow_nodes.status(),
        "links": core.links.last,
        "persist": persist_view(core.roster.persist_failing),
    }
