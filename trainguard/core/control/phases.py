"""A recovery plan as phases, and running them.

:class:`~trainguard.core.control.controller.ControllerCore` owns one
:class:`Phases`, given the job's shared state (:class:`~.job.Job`), the way
to send commands, the clock and the :class:`~.restarts.Restarts` that start
new processes; every method runs on the controller's loop. A
plan becomes a list of :class:`~.episode.Phase` (:meth:`Phases.plan`): dump
saves, finalises and exits; retry, recover-in-place, recover and
elastic-training clean, rebuild (or, with new processes, respawn and join),
repair, roll back and resume (:meth:`_repair_phases`). A phase's commands
are built when it starts and go to every rank it names; it ends when all of
them answered (:meth:`Phases.next`, called by the core on each answer).
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from ..api import ControllerState, FaultKind, Plan, Strategy
from ..checkpoint_parts import SavedShard
from ..commands import Action, Clean, Command, Exit, Finalize, Rebuild, Repair, Resume, Rollback, Save
from ..config import ControllerConfig
from .episode import Phase
from .job import Job
from ..replicas import shard_ids
from .restarts import Restarts

__all__ = ["Phases"]

log = logging.getLogger("trainguard.controller")


class Phases:
    """Building and running a plan's phases.

    Args:
        job: the controller's shared state.
        config: the phases' timeouts.
        send: delivers a command to a rank's session.
        clock: monotonic seconds, for the phases' deadlines.
        restarts: starts new processes (respawn), drops ranks and scales back up.
    """

    def __init__(self, job: Job, config: ControllerConfig, send: Callable[[int, Command], None],
                 clock: Callable[[], float], restarts: Restarts) -> None:
        self.job, self.roster, self.config = job, job.roster, config
        self.world_size = job.roster.world_size
        self._send, self._clock, self.restarts = send, clock, restarts

    def _to_all(self, ranks, action: Action) -> dict[int, Command]:
        cmd = self.job.command(action)
        return dict.fromkeys(ranks, cmd)

    def plan(self, plan: Plan, layout) -> list[Phase]:
        cfg, everyone = self.config, list(plan.participants)
        exit_phase = Phase("exit", 0, lambda: self._to_all(
            everyone, Exit(code=plan.exit_code, reason=self.job.episode.reason)))
        if plan.strategy in (Strategy.RETRY, Strategy.RECOVER_IN_PLACE, Strategy.RECOVER,
                             Strategy.ELASTIC_TRAINING):
            return self._repair_phases(plan)
        if plan.strategy is Strategy.DUMP:
            keys = {sid: key for key, sid in shard_ids(layout).items()}
            kinds: dict[int, list[int]] = {}
            for sid, rank in sorted(plan.savers.items()):
                key = keys[sid]
                kinds.setdefault(rank, []).append(key.kind)
                self.job.episode.shards.append(SavedShard(kind=key.kind, copies=key.copies, rank=rank,
                                                          full=layout[rank][key.kind].is_full, files=()))

            carry = self._carriers(plan)

            def finalize() -> dict[int, Command]:
                history = {"records": [self.job.record().to_dict()],
                           "pids": {str(k): v for k, v in self.roster.pids.items()}}
                return {plan.finaliser: self.job.command(Finalize(
                    step=plan.step, shards=tuple(self.job.episode.shards), history_json=json.dumps(history),
                    own=tuple(self.job.episode.own)))}

            return [  # every participant saves its own part; the savers their shards too
                Phase("save", cfg.save_timeout_s, lambda: {
                    r: self.job.command(Save(step=plan.step, kinds=tuple(kinds.get(r, ())),
                                             carry=tuple(carry.get(r, ()))))
                    for r in everyone}),
                Phase("finalize", cfg.handler_timeout_s, finalize),
                exit_phase,
            ]
        self.job.record()
        return [exit_phase]

    def _carriers(self, plan: Plan) -> dict[int, list[int]]:
        """For a dump: which participant writes each lost rank's own part
        (its random streams and data position, recorded in its node agent's
        memory): the lowest participant on the lost rank's host. A lost rank
        with none there is named in the episode's reason: its own part is
        gone, and the relaunch warns that it continues from its seed."""
        by_host: dict[str, int] = {}
        for rank in sorted(plan.participants):
            by_host.setdefault(self.roster.ranks[rank].host, rank)
        carry: dict[int, list[int]] = {}
        gone = []
        for r in sorted(set(self.roster.ranks) - set(plan.participants) - self.roster.dropped):
            carrier = by_host.get(self.roster.ranks[r].host)
            if carrier is None:
                gone.append(r)
            else:
                carry.setdefault(carrier, []).append(r)
        if gone:
            log.warning("the random streams and data positions of ranks %s are lost with their hosts", gone[:16])
            self.job.episode.reason += (f"; the random streams and data positions of ranks {gone[:16]} are lost with "
                                    f"their hosts (no rank there survived)")
        return carry

    def _repair_phases(self, plan: Plan) -> list[Phase]:
        """retry: clean, rebuild, repair, rollback, resume. With new
        processes (recover-in-place, recover) the agents start them first and
        the rebuild becomes a join: the survivors meet them on the store
        their agent serves."""
        cfg, everyone = self.config, list(plan.participants)
        new = sorted(plan.replacements)
        after = sorted(everyone + new)
        uce = {f.rank for f in self.job.episode.faults if f.kind is FaultKind.UCE and f.corrupts_state}
        if self.job.episode.starts is not None and self.job.episode.grow:  # the new processes build the generation
            # reserved when they started (none when they were given up)
            generation = self.job.episode.starts.generation
        else:
            self.job.generation += 1
            generation = self.job.generation
        involved = sorted({t.src for t in plan.transfers} | {t.dst for t in plan.transfers})

        def clean() -> dict[int, Command]:
            faulty, healthy = self.job.command(Clean(uce=True)), self.job.command(Clean(uce=False))
            return {r: faulty if r in uce else healthy for r in everyone}

        phases = [Phase("clean", cfg.handler_timeout_s, clean)]
        if new:
            if not self.job.episode.grow:  # growing back: they run already
                phases.append(Phase("respawn", cfg.restart_timeout_s, dict))
            phases.append(Phase("join", cfg.restart_timeout_s, lambda: self._to_all(everyone, Rebuild(
                generation=generation, join_store=self.job.episode.join_store)), also_wait=tuple(new)))
        else:
            excluded = tuple(sorted(set(range(self.world_size)) - set(everyone)))
            phases.append(Phase("rebuild", cfg.handler_timeout_s, lambda: self._to_all(
                everyone, Rebuild(generation=generation, excluded=excluded))))
        if plan.transfers:
            phases.append(Phase("repair", cfg.handler_timeout_s, lambda: self._to_all(
                involved, Repair(step=plan.step, transfers=tuple(plan.transfers)))))
        phases.append(Phase("rollback", cfg.handler_timeout_s, lambda: self._to_all(
            after, Rollback(step=plan.step))))
        phases.append(Phase("resume", 0, lambda: self._to_all(after, Resume(
            step=plan.step, record_json=json.dumps(self.job.record().to_dict()) if self.job.episode.faults else "",
            pids_json=json.dumps({str(k): v for k, v in self.roster.pids.items()}) if new else "",
            replicas=len(after)))))
        if plan.strategy is Strategy.ELASTIC_TRAINING:
            self.restarts.drop(set(range(self.world_size)) - set(after))
        return phases

    def start(self) -> None:
        phase = self.job.episode.phases[0]
        phase.commands = phase.build()
        self.job.journal.note("phase", name=phase.name, strategy=self.job.episode.plan.strategy.value)
        if phase.name == "exit":
            self.roster.exiting.update(phase.commands)
        phase.deadline = self._clock() + phase.timeout_s
        phase.waiting = set(phase.commands) | set(phase.also_wait) if phase.timeout_s > 0 else set()
        for rank, cmd in phase.commands.items():
            self._send(rank, cmd)
        if phase.name == "respawn":
            phase.waiting = set(self.job.episode.plan.replacements)
            self.restarts.respawn(phase, self.job.episode.plan)
        if not phase.waiting:
            self.next()

    def next(self) -> None:
        ep = self.job.episode
        done = ep.phases.pop(0)
        if ep.phases:
            self.start()
            return
        if done.name == "resume":
            for r in self.roster.ranks.values():
                r.stopped = False
            self.job.episode = None
            self.job.to(ControllerState.NORMAL)
            if ep.faults:  # a handled fault: one line, its cause and outcome
                log.warning("fault: %s -> %s: training resumed at step %d%s", _causes(ep), ep.plan.strategy.value,
                            ep.plan.step, f" (after a fallback: {ep.reason})" if ep.tried else "")
            else:
                log.info("%s: training resumed at step %d", ep.reason, ep.plan.step)
            if ep.grow:
                self.roster.dropped -= set(ep.plan.replacements)
                self.job.grow = None
            elif ep.plan.strategy is Strategy.ELASTIC_TRAINING:
                self.restarts.grow_back()
        else:
            if self.job.state is not ControllerState.EXITED:
                self.job.to(ControllerState.EXITED)
            if ep.faults:
                log.warning("fault: %s -> %s: job exiting: %s", _causes(ep), ep.plan.strategy.value, ep.reason)
            else:
                log.warning("job exiting: %s", ep.reason)


def _causes(ep, most: int = 4) -> str:
    """The episode's faults, for its one log line, causes first: a
    communication error is most often what the other ranks saw of a peer's
    failure, and it can arrive before the controller sees the peer's process
    gone, so it follows every other fault, whatever the order they came in."""
    faults = sorted(ep.faults, key=lambda fault: fault.kind is FaultKind.COMM)
    told = "; ".join(fault.describe()[:300] for fault in faults[:most])
    return told + (f"; and {len(faults) - most} more" if len(faults) > most else "")
