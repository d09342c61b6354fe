"""A recovery plan as phases, and running them.

A mix-in of :class:`~trainguard.core.control.controller.ControllerCore` (it uses the
core's state and helpers; every method runs on the controller's loop). A
plan becomes a list of :class:`~.episode.Phase` (:meth:`_phases`): dump
saves, finalises and exits; retry, recover-in-place, recover and
elastic-training clean, rebuild (or, with new processes, respawn and join),
repair, roll back and resume (:meth:`_repair_phases`). A phase's commands
are built when it starts and go to every rank it names; it ends when all of
them answered (:meth:`_next_phase`, called by the core on each answer).
"""

from __future__ import annotations

import json
import logging

from ..api import ControllerState, FaultKind, Plan, Strategy
from .episode import Phase
from ..protocol import trainguard_pb2 as pb
from ..replicas import shard_ids

__all__ = ["Phases"]

log = logging.getLogger("trainguard.controller")


class Phases:
    """Building and running a plan's phases (a mix-in of the controller)."""

    def _to_all(self, ranks, **action) -> dict[int, pb.Command]:
        cmd = self._command(**action)
        return dict.fromkeys(ranks, cmd)

    def _phases(self, plan: Plan, layout) -> list[Phase]:
        cfg, everyone = self.config, list(plan.participants)
        exit_phase = Phase("exit", 0, lambda: self._to_all(
            everyone, exit=pb.Exit(code=plan.exit_code, reason=self.episode.reason)))
        if plan.strategy in (Strategy.RETRY, Strategy.RECOVER_IN_PLACE, Strategy.RECOVER,
                             Strategy.ELASTIC_TRAINING):
            return self._repair_phases(plan)
        if plan.strategy is Strategy.DUMP:
            keys = {sid: key for key, sid in shard_ids(layout).items()}
            kinds: dict[int, list[int]] = {}
            for sid, rank in sorted(plan.savers.items()):
                key = keys[sid]
                kinds.setdefault(rank, []).append(key.kind)
                self.episode.shards.append(pb.ShardFiles(kind=key.kind, copies=key.copies, rank=rank,
                                                         full=layout[rank][key.kind].is_full))

            carry = self._carriers(plan)

            def finalize() -> dict[int, pb.Command]:
                history = {"records": [self._record().to_dict()], "pids": {str(k): v for k, v in self._pids.items()}}
                return {plan.finaliser: self._command(finalize=pb.Finalize(
                    step=plan.step, shards=self.episode.shards, history_json=json.dumps(history),
                    own=self.episode.own))}

            return [  # every participant saves its own part; the savers their shards too
                Phase("save", cfg.save_timeout_s, lambda: {
                    r: self._command(save=pb.Save(step=plan.step, kinds=kinds.get(r, []), carry=carry.get(r, [])))
                    for r in everyone}),
                Phase("finalize", cfg.handler_timeout_s, finalize),
                exit_phase,
            ]
        self._record()
        return [exit_phase]

    def _carriers(self, plan: Plan) -> dict[int, list[int]]:
        """For a dump: which participant writes each lost rank's own part
        (its random streams and data position, recorded in its node agent's
        memory): the lowest participant on the lost rank's host. A lost rank
        with none there is named in the episode's reason: its own part is
        gone, and the relaunch warns that it continues from its seed."""
        by_host: dict[str, int] = {}
        for rank in sorted(plan.participants):
            by_host.setdefault(self.ranks[rank].host, rank)
        carry: dict[int, list[int]] = {}
        gone = []
        for r in sorted(set(self.ranks) - set(plan.participants) - self.dropped):
            carrier = by_host.get(self.ranks[r].host)
            if carrier is None:
                gone.append(r)
            else:
                carry.setdefault(carrier, []).append(r)
        if gone:
            log.warning("the random streams and data positions of ranks %s are lost with their hosts", gone[:16])
            self.episode.reason += (f"; the random streams and data positions of ranks {gone[:16]} are lost with "
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
        uce = {f.rank for f in self.episode.faults if f.kind is FaultKind.UCE and f.corrupts_state}
        if self.episode.starts is not None and self.episode.grow:  # the new processes build the generation
            # reserved when they started (none when they were given up)
            generation = self.episode.starts.generation
        else:
            self.generation += 1
            generation = self.generation
        involved = sorted({t.src for t in plan.transfers} | {t.dst for t in plan.transfers})

        def clean() -> dict[int, pb.Command]:
            faulty, healthy = self._command(clean=pb.Clean(uce=True)), self._command(clean=pb.Clean(uce=False))
            return {r: faulty if r in uce else healthy for r in everyone}

        phases = [Phase("clean", cfg.handler_timeout_s, clean)]
        if new:
            if not self.episode.grow:  # growing back: they run already
                phases.append(Phase("respawn", cfg.restart_timeout_s, dict))
            phases.append(Phase("join", cfg.restart_timeout_s, lambda: self._to_all(everyone, rebuild=pb.Rebuild(
                generation=generation, join_store=self.episode.join_store)), also_wait=tuple(new)))
        else:
            excluded = sorted(set(range(self.world_size)) - set(everyone))
            phases.append(Phase("rebuild", cfg.handler_timeout_s, lambda: self._to_all(
                everyone, rebuild=pb.Rebuild(generation=generation, excluded=excluded))))
        if plan.transfers:
            transfers = [pb.Transfer(src=t.src, dst=t.dst, kind=t.kind) for t in plan.transfers]
            phases.append(Phase("repair", cfg.handler_timeout_s, lambda: self._to_all(
                involved, repair=pb.Repair(step=plan.step, transfers=transfers))))
        phases.append(Phase("rollback", cfg.handler_timeout_s, lambda: self._to_all(
            after, rollback=pb.Rollback(step=plan.step))))
        phases.append(Phase("resume", 0, lambda: self._to_all(after, resume=pb.Resume(
            step=plan.step, record_json=json.dumps(self._record().to_dict()) if self.episode.faults else "",
            pids_json=json.dumps({str(k): v for k, v in self._pids.items()}) if new else "",
            replicas=len(after)))))
        if plan.strategy is Strategy.ELASTIC_TRAINING:
            self._drop(set(range(self.world_size)) - set(after))
        return phases

    def _current_phase(self) -> Phase | None:
        ep = self.episode
        if ep is None or not ep.phases or self.state not in (ControllerState.RECOVERING, ControllerState.DUMPING):
            return None
        return ep.phases[0]

    def _start_phase(self) -> None:
        phase = self.episode.phases[0]
        phase.commands = phase.build()
        self._note("phase", name=phase.name, strategy=self.episode.plan.strategy.value)
        if phase.name == "exit":
            self._exiting.update(phase.commands)
        phase.deadline = self._clock() + phase.timeout_s
        phase.waiting = set(phase.commands) | set(phase.also_wait) if phase.timeout_s > 0 else set()
        for rank, cmd in phase.commands.items():
            self._send(rank, cmd)
        if phase.name == "respawn":
            phase.waiting = set(self.episode.plan.replacements)
            self._respawn(phase, self.episode.plan)
        if not phase.waiting:
            self._next_phase()

    def _next_phase(self) -> None:
        ep = self.episode
        done = ep.phases.pop(0)
        if ep.phases:
            self._start_phase()
            return
        if done.name == "resume":
            for r in self.ranks.values():
                r.stopped = False
            self.episode = None
            self._to(ControllerState.NORMAL)
            if ep.faults:  # a handled fault: one line, its cause and outcome
                log.warning("fault: %s -> %s: training resumed at step %d%s", _causes(ep), ep.plan.strategy.value,
                            ep.plan.step, f" (after a fallback: {ep.reason})" if ep.tried else "")
            else:
                log.info("%s: training resumed at step %d", ep.reason, ep.plan.step)
            if ep.grow:
                self.dropped -= set(ep.plan.replacements)
                self._grow = None
            elif ep.plan.strategy is Strategy.ELASTIC_TRAINING:
                self._grow_back()
        else:
            if self.state is not ControllerState.EXITED:
                self._to(ControllerState.EXITED)
            if ep.faults:
                log.warning("fault: %s -> %s: job exiting: %s", _causes(ep), ep.plan.strategy.value, ep.reason)
            else:
                log.warning("job exiting: %s", ep.reason)


def _causes(ep, most: int = 4) -> str:
    """The episode's faults, for its one log line."""
    told = "; ".join(fault.describe()[:300] for fault in ep.faults[:most])
    return told + (f"; and {len(ep.faults) - most} more" if len(ep.faults) > most else "")
