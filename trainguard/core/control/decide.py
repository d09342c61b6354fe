"""Deciding what to do about a fault: a pure function with a reason.

:func:`decide` takes the controller's view of every rank after the prelock
(every live rank stopped), the faults of this episode, the job's config and
the clock, and returns the :class:`~trainguard.core.api.Plan` of the first
strategy in the job's list that can succeed, plus a sentence saying why each
earlier one could not. ``exit`` can always be carried out, so a plan always
comes back.

Strategies plug in through :data:`PLANNERS`; each planner is a small
function ``(view) -> Plan | str`` (a plan, or the reason it cannot work).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from ..api import (
    EXIT_AFTER_DUMP,
    EXIT_UNRECOVERABLE,
    DataStatus,
    Fault,
    FaultKind,
    Plan,
    RankState,
    Severity,
    Strategy,
    Transfer,
)
from ..config import ControllerConfig
from ..replicas import Layout, choose_savers, choose_sources

__all__ = ["Agents", "JobView", "PLANNERS", "decide", "lock_step", "repeats"]


@dataclass(frozen=True, kw_only=True)
class JobView:
    """Everything a planner may look at, computed once per decision."""

    ranks: Mapping[int, RankState]
    faults: Sequence[Fault]
    layout: Layout
    tried: frozenset[Strategy] = frozenset()
    lock: int | None = None
    usable: frozenset[int] = frozenset()
    bad: frozenset[int] = field(default_factory=frozenset)
    agents: "Agents" = field(default_factory=lambda: Agents())
    #: ``(step, cause)`` of the dying gasp this launch resumed from (``None``: it resumed from none).
    previous: tuple[int, str] | None = None

    @property
    def live(self) -> tuple[int, ...]:
        return tuple(sorted(r for r, s in self.ranks.items() if s.alive))


@dataclass(frozen=True, kw_only=True)
class Agents:
    """What the node agents can do for a recovery.

    ``home`` maps a rank to the node agent that runs it (only agents still
    connected); ``spare`` maps an agent to how many workers it may start for
    other nodes' ranks; ``restarts_left`` counts the process restarts the job
    still may make (``--max-restarts``) out of ``max_restarts``.
    """

    home: Mapping[int, str] = field(default_factory=dict)
    spare: Mapping[str, int] = field(default_factory=dict)
    restarts_left: int = 0
    max_restarts: int = 0


def _state_bad(faults: Iterable[Fault]) -> frozenset[int]:
    return frozenset(f.rank for f in faults if f.corrupts_state)


def lock_step(ranks: Mapping[int, RankState], bad: Iterable[int]) -> int | None:
    """The prelock step: the highest step at which a trusted rank is
    ``UPDATED`` and stopped, or ``None`` when no rank qualifies."""
    bad = set(bad)
    steps = [
        s.step
        for r, s in ranks.items()
        if s.alive and s.stopped and r not in bad and s.data is DataStatus.UPDATED
    ]
    return max(steps) if steps else None


def _usable(ranks: Mapping[int, RankState], bad: Iterable[int], lock: int | None) -> frozenset[int]:
    bad = set(bad)
    return frozenset(
        r
        for r, s in ranks.items()
        if lock is not None
        and s.alive
        and s.stopped
        and r not in bad
        and s.data is DataStatus.UPDATED
        and s.step == lock
    )


def _nothing_to_recover(view: JobView, what: str) -> str | None:
    if view.lock is None:
        return f"no healthy rank is consistent (UPDATED) at any step, so there is nothing to {what}"
    if view.lock == 0:
        return f"the fault came at step 0: no completed step to {what}"
    return None


def _corrupted(view: JobView) -> str | None:
    hit = [f for f in view.faults if f.kind is FaultKind.UCE and f.severity is Severity.CORRUPTED]
    if hit:
        return f"{hit[0].describe()}; corrupted data may have reached the replicas"
    return None


def _repairs(view: JobView, new: Sequence[int] = ()) -> tuple[Transfer, ...] | str:
    """The state copies that bring ``new`` ranks and every live rank not at
    the locked step up to it, or why none can: a live rank did not stop, or
    no consistent replica holds some state."""
    stuck = [r for r in view.live if not view.ranks[r].stopped]
    if stuck:
        return f"ranks {stuck} did not stop at a consistent step"
    targets = list(new) + [r for r in view.live if r not in view.usable]
    transfers, missing = choose_sources(view.layout, targets, view.usable)
    if missing:
        rank, kind = missing[0]
        return f"no consistent replica at step {view.lock} to repair rank {rank} (state kind {kind}) from"
    return tuple(transfers)


def plan_retry(view: JobView) -> Plan | str:
    for f in view.faults:
        if not f.kind.in_process:
            return f"{f.describe()}; retry only repairs in-process faults (device memory, communication)"
    why = _corrupted(view) or _nothing_to_recover(view, "return to")
    if why:
        return why
    for f in view.faults:
        state = view.ranks.get(f.rank)
        if f.kind is FaultKind.UCE and f.corrupts_state and state is not None and not state.device_repairable:
            return f"{f.describe()}; this rank's device cannot be repaired in-process"
    transfers = _repairs(view)
    if isinstance(transfers, str):
        return transfers
    return Plan(strategy=Strategy.RETRY, step=view.lock, participants=view.live, transfers=transfers)


def _dump_step(view: JobView) -> tuple[int, frozenset[int]]:
    """The step a dump saves, and the ranks that can save its shards.

    Every live rank writes its own part (random streams, data position) of
    that step. A rank stopped one step behind the locked one (a fault cut
    an all-reduce that finished on some ranks only) has no own part of the
    locked step, so the step before is saved instead: the ranks behind hold
    it committed, the ranks ahead as their node's record of it. (A rank
    ahead without that record fails its save, and the job falls back, as a
    dump at the locked step would have.)"""
    live = [view.ranks[r] for r in view.live]
    behind = [s for s in live if s.step < view.lock]
    if behind and all(s.stopped and s.data is DataStatus.UPDATED and s.step == view.lock - 1 for s in behind):
        return view.lock - 1, _usable(view.ranks, view.bad, view.lock - 1)
    return view.lock, view.usable


def repeats(view: JobView) -> str | None:
    """Why this episode repeats the one before the relaunch, or ``None``.

    The launch resumed from a dying gasp of step n caused by a fault of some class (its
    kind and error type, whichever rank it struck); the same class failing the job again
    with n as the step a dump would save means the relaunch made no progress and the
    next one would fail alike. A dump then only loops (a scheduler relaunching on 75,
    ``--max-restarts``): the job stops instead."""
    if view.previous is None or view.lock is None or not view.faults:
        return None
    step, cause = view.previous
    first = next((f for f in view.faults if f.kind is not FaultKind.COMM), view.faults[0])
    if first.cause != cause or _dump_step(view)[0] != step:
        return None
    return (f"the same fault ({cause}) failed the launch before at the same step: this launch resumed from "
            f"its dying gasp at step {step} and made no progress, so another dump and relaunch would fail "
            f"alike; the job stops (fix the cause, then relaunch: it resumes from step {step})")


def plan_dump(view: JobView) -> Plan | str:
    why = _corrupted(view) or _nothing_to_recover(view, "save") or repeats(view)
    if why:
        return why
    step, usable = _dump_step(view)
    savers, missing = choose_savers(view.layout, usable)
    if missing:
        return (f"no consistent copy of shard {list(missing[0].copies)} (state kind {missing[0].kind}) "
                f"at step {step}")
    return Plan(
        strategy=Strategy.DUMP,
        step=step,
        participants=view.live,
        savers=savers,
        finaliser=min(savers.values()),
        exit_code=EXIT_AFTER_DUMP,
    )


def plan_exit(view: JobView) -> Plan:
    return Plan(
        strategy=Strategy.EXIT,
        step=-1 if view.lock is None else view.lock,
        participants=view.live,
        exit_code=EXIT_UNRECOVERABLE,
        final=repeats(view) is not None,
    )


def _restart(view: JobView, strategy: Strategy) -> Plan | str:
    """Start a new process for every lost rank -- on its own node
    (recover-in-place) or on another node agent's spare slot (recover) --
    and repair it from a replica at the locked step."""
    lost = sorted(r for r, s in view.ranks.items() if not s.alive)
    if not lost:
        return "no process was lost (in-process faults are for retry)"
    refused = next((s for s in view.ranks.values() if s.join_refused), None)
    if refused is not None:
        return f"rank {refused.rank}: {refused.join_refused}"
    if view.lock is None:
        return "no healthy rank is consistent (UPDATED) at any step, so no replica can serve a new process"
    why = _corrupted(view)
    if why:
        return why
    agents = view.agents
    if agents.restarts_left < len(lost):
        return (f"{len(lost)} process restart(s) needed but the job's limit is spent "
                f"(--max-restarts {agents.max_restarts}, {agents.max_restarts - agents.restarts_left} used)")
    placement: dict[int, str] = {}
    if strategy is Strategy.RECOVER_IN_PLACE:
        for r in lost:
            if r not in agents.home:
                return f"rank {r}'s node agent is gone, so the rank cannot be restarted on its node"
            placement[r] = agents.home[r]
    else:
        spare = dict(agents.spare)
        for r in lost:
            node = next((n for n in sorted(spare) if spare[n] > 0 and n != agents.home.get(r)), None)
            if node is None:
                return f"no other node agent has a spare slot for rank {r} (trainguard run --spare-slots)"
            spare[node] -= 1
            placement[r] = node
    transfers = _repairs(view, new=lost)
    if isinstance(transfers, str):
        return transfers
    return Plan(strategy=strategy, step=view.lock, participants=view.live, transfers=transfers,
                replacements=placement)


def plan_recover_in_place(view: JobView) -> Plan | str:
    return _restart(view, Strategy.RECOVER_IN_PLACE)


def plan_recover(view: JobView) -> Plan | str:
    return _restart(view, Strategy.RECOVER)


def plan_elastic(view: JobView) -> Plan | str:
    """Go on without the lost ranks: every rank must hold the whole state
    (pure data parallelism), so dropping replicas loses no state."""
    lost = sorted(r for r, s in view.ranks.items() if not s.alive)
    if not lost:
        return "no rank was lost (elastic-training drops lost data-parallel replicas)"
    if view.lock is None:
        return "no healthy rank is consistent (UPDATED) at any step"
    why = _corrupted(view)
    if why:
        return why
    partial = sorted({r for r, groups in view.layout.items() for g in groups if not g.is_full})
    if partial:
        return f"ranks {partial[:8]} hold part of the state (sharded): dropping a rank would lose its shard"
    if not view.live:
        return "no rank is left to train"
    transfers = _repairs(view)
    if isinstance(transfers, str):
        return transfers
    return Plan(strategy=Strategy.ELASTIC_TRAINING, step=view.lock, participants=view.live, transfers=transfers)


#: Strategy -> planner. A planner returns a Plan, or why it cannot work.
PLANNERS: dict[Strategy, Callable[[JobView], Plan | str]] = {
    Strategy.RETRY: plan_retry,
    Strategy.RECOVER_IN_PLACE: plan_recover_in_place,
    Strategy.RECOVER: plan_recover,
    Strategy.ELASTIC_TRAINING: plan_elastic,
    Strategy.DUMP: plan_dump,
    Strategy.EXIT: plan_exit,
}


def _describe(plan: Plan) -> str:
    if plan.strategy is Strategy.RETRY:
        copies = ", ".join(f"rank {t.dst} from rank {t.src}" for t in plan.transfers) or "no state copy needed"
        return f"retry at step {plan.step} ({copies})"
    if plan.replacements:
        where = ", ".join(f"rank {r} on {n}" for r, n in sorted(plan.replacements.items()))
        copies = ", ".join(f"rank {t.dst} from rank {t.src}" for t in plan.transfers)
        return f"{plan.strategy.value} at step {plan.step} (new process for {where}; state {copies})"
    if plan.strategy is Strategy.ELASTIC_TRAINING:
        copies = "".join(f"; rank {t.dst} from rank {t.src}" for t in plan.transfers)
        return f"elastic-training at step {plan.step} with ranks {list(plan.participants)[:16]}{copies}"
    if plan.strategy is Strategy.DUMP:
        savers = ", ".join(f"shard {s} by rank {r}" for s, r in sorted(plan.savers.items()))
        return f"dump at step {plan.step} ({savers}; rank {plan.finaliser} finalises)"
    return "exit"


def decide(
    ranks: Mapping[int, RankState],
    faults: Sequence[Fault],
    config: ControllerConfig,
    now: float,
    *,
    layout: Layout,
    tried: Iterable = (),
    agents: Agents | None = None,
    missing: Iterable[int] = (),
    previous: tuple[int, str] | None = None,
) -> tuple[Plan, str]:
    """Choose the plan for a fault episode.

    Args:
        ranks: every rank's state after the prelock.
        faults: the faults of this episode, oldest first.
        config: supplies the ordered strategy list.
        now: the controller's clock (unix seconds); planners that wait for
            replacements use it.
        layout: each rank's replica groups.
        tried: strategies that already failed in this episode.
        agents: what the node agents can restart (none: no restarts).
        missing: ranks of the world that never registered: the job has not
            started (a rank failed while it started or resumed), so nothing
            can be recovered -- the plan is ``exit``, and no rank saves a
            state that would not cover them.
        previous: ``(step, cause)`` of the dying gasp the job resumed from
            (see :func:`repeats`); ``None``: it resumed from none.

    Returns:
        ``(plan, reason)``; ``reason`` says why each earlier strategy was
        passed over and what the plan does.
    """
    del now  # no strategy of this version waits on the clock
    bad = _state_bad(faults)
    lock = lock_step(ranks, bad)
    view = JobView(
        ranks=ranks,
        faults=tuple(faults),
        layout=layout,
        tried=frozenset(tried),
        lock=lock,
        usable=_usable(ranks, bad, lock),
        bad=bad,
        agents=agents or Agents(),
        previous=previous,
    )
    missing = sorted(missing)
    if missing:
        return plan_exit(view), (f"ranks {missing[:16]} never registered: the job had not started (a rank failed "
                                 f"while it started or resumed), so no strategy applies and nothing is saved; exit")
    passed: list[str] = []
    for strategy in config.strategies:
        if strategy in view.tried:
            passed.append(f"{strategy.value}: already failed in this episode")
            continue
        outcome = PLANNERS[strategy](view)
        if isinstance(outcome, Plan):
            return outcome, "; ".join(passed + [_describe(outcome)])
        passed.append(f"{strategy.value}: {outcome}")
    plan = plan_exit(view)
    return plan, "; ".join(passed + ["exit (no strategy left)"])
