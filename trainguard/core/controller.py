"""The controller's state machine: ranks, fault episodes, plans in phases.

:class:`ControllerCore` holds no sockets and no threads. The gRPC server
(:mod:`trainguard.core.server`) feeds it events (``on_hello``,
``on_fault``...) from one event loop and it answers by calling ``send(rank,
command)``. Its clocks are injected, so tests drive it by hand.

An *episode* begins with the first fault while training runs normally:

1. **prelock** -- every live rank is told to STOP; each leaves its step at
   the next safe point and reports its step and data status. When all have
   (or the prelock timeout named the laggards as hung) the step is locked.
2. **decide** -- :func:`trainguard.core.decide.decide` picks the plan.
3. **phases** -- the plan's commands go out phase by phase (retry and
   elastic-training: clean, rebuild, repair, rollback, resume;
   recover-in-place and recover: clean, respawn, join, repair, rollback,
   resume -- see :mod:`.phases` and :mod:`.restarts`; dump: save, finalise,
   exit); a phase ends when every target answered. A failed answer, a
   timeout or a new fault abandons the plan: the strategy is marked tried,
   every rank is stopped again and the next strategy is decided.

Costs stay linear in the number of ranks: groups are interned at
registration, a phase's command is built when the phase starts and shared by
every rank it goes to, and the prelock counts the ranks still to stop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from .api import (
    EXIT_HUNG,
    EXIT_UNRECOVERABLE,
    ConfigError,
    ControllerState,
    DataStatus,
    Fault,
    FaultKind,
    ProtocolError,
    RankState,
    RecoveryRecord,
    RunStatus,
    Strategy,
)
from .agents import AgentTable
from .config import ControllerConfig
from .decide import decide
from .events import EventLog
from .links import Surveyor
from .episode import Episode, Rank, Starts
from .protocol import trainguard_pb2 as pb
from .replicas import Registry, ReplicaGroup
from .rpc import fault_fields
from .phases import Phases
from .restarts import Restarts
from .transitions import advance

__all__ = ["ControllerCore"]

log = logging.getLogger("trainguard.controller")


class ControllerCore(Restarts, Phases):
    """The job's brain. Every method is called from one thread (the server's
    event loop); none blocks.

    Args:
        config: strategies, timeouts, limits.
        world_size: number of ranks in the job.
        send: delivers a command to a rank's session.
        send_agent: delivers an order to a node agent (none: no restarts).
        clock: monotonic seconds, for timeouts.
        wall: unix seconds, for reported times.
    """

    def __init__(
        self,
        config: ControllerConfig,
        world_size: int,
        *,
        send: Callable[[int, pb.Command], None],
        send_agent: Callable[[str, pb.AgentOrder], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.world_size = world_size
        self.heartbeat_interval_s = config.heartbeat_interval_for(world_size)
        self._send = send
        self._send_agent = send_agent or (lambda node, order: None)
        self.agents = AgentTable(config.max_restarts)
        self._clock, self._wall = clock, wall
        #: Surveys of the node agents' links, when the job slows down as a whole.
        self.links = Surveyor(self.agents.order, self._send_agent, clock, on_verdict=self._link_verdict)
        self.state = ControllerState.INIT
        self.ranks: dict[int, Rank] = {}
        self.registry = Registry(world_size)
        self.records: list[RecoveryRecord] = []
        self.episode: Episode | None = None
        self.generation = 0
        self._epoch = 0
        self._next_id = 1
        self._exiting: set[int] = set()
        self._finished: set[int] = set()
        self.dropped: set[int] = set()  # ranks elastic-training went on without
        self._grow: Starts | None = None  # new processes for them, starting while the others train
        self._unwanted: set[int] = set()  # start orders given up before their agent answered
        self._pids: dict[int, list[int]] = {}
        self._parsed: dict[tuple, ReplicaGroup] = {}
        self._last_tick = clock()
        self._next_heartbeat_scan = 0.0
        #: Live slow-node detection (a :class:`~trainguard.core.profiling.live.LiveDetector`), when profiling is on.
        self.slow_nodes: Any = None
        self.persist_failing: dict[int, dict] = {}  # rank -> its streak of saves that do not reach storage
        #: The run directory's event log (``TRAINGUARD_RUN_DIR``; ``trainguard report`` draws it), or None.
        self.events = EventLog.from_env()
        self._sampled: tuple = ()
        self._next_sample = 0.0
        self._note("controller", job_id=config.job_id, world_size=world_size,
                   strategies=[s.value for s in config.strategies])

    # ----------------------------------------------------------------- events
    def on_hello(self, hello: pb.Hello) -> None:
        """Register a rank (its first message).

        Raises:
            ProtocolError: the rank is already connected, or its replica
                groups are malformed or disagree with its peers'.
        """
        rank = hello.rank
        old = self.ranks.get(rank)
        if old is not None and old.alive:
            raise ProtocolError(f"rank {rank} is already registered by pid {old.pid} on {old.host}")
        try:
            groups = self.registry.register(rank, [self._group(g) for g in hello.replicas]
                                            or [ReplicaGroup.full([rank])])
        except ConfigError as e:
            raise ProtocolError(f"rank {rank}: {e}") from None
        self._pids.setdefault(rank, []).append(hello.pid)
        self._exiting.discard(rank)
        r = Rank(rank=rank, pid=hello.pid, host=hello.host, repairable=hello.device_repairable, groups=groups,
                  step=0, run=RunStatus.STARTING, data=DataStatus.UPDATED, last_seen=self._clock())
        r.update(hello.status)
        self.ranks[rank] = r
        self._note("rank", rank=rank, pid=hello.pid, host=hello.host, step=r.step, joining=hello.joining)
        log.debug("rank %d registered (pid %d on %s, step %d)", rank, hello.pid, hello.host, r.step)
        if hello.joining:
            self._joined(r)
            return
        if self.state is ControllerState.INIT and len(self.ranks) == self.world_size:
            self._to(ControllerState.NORMAL)
            log.info("all %d ranks registered", self.world_size)

    def _joined(self, r: Rank) -> None:
        """A replacement process registered: it waits for commands."""
        r.stopped = True
        phase = self._current_phase()
        if phase is not None and phase.name == "join" and r.rank in phase.waiting:
            log.warning("rank %d rejoined (pid %d on %s)", r.rank, r.pid, r.host)
            phase.waiting.discard(r.rank)
            if not phase.waiting:
                self._next_phase()
        elif self.episode is None:
            # Nothing to join any more: it must not train on its own.
            self._exiting.add(r.rank)
            self._send(r.rank, self._command(exit=pb.Exit(code=EXIT_UNRECOVERABLE,
                                                          reason="no recovery is waiting for this process")))

    def _group(self, g: pb.ReplicaGroup) -> ReplicaGroup:
        """Parse a group, reusing the object when many ranks send the same one."""
        if g.range_count:
            key = ("range", g.range_start, g.range_step, g.range_count, g.replica_cnt, g.replica_shift)
        else:
            key = ("list", tuple(g.rank_list), g.replica_cnt, g.replica_shift)
        group = self._parsed.get(key)
        if group is None:
            if g.range_count and (g.range_step == 0 or not 0 < g.range_count <= self.world_size):
                raise ProtocolError(f"replica group range of {g.range_count} ranks in steps of {g.range_step}: "
                                    f"needs a step and at most {self.world_size} ranks")
            ranks = (tuple(range(g.range_start, g.range_start + g.range_step * g.range_count, g.range_step))
                     if g.range_count else key[1])
            group = self._parsed[key] = ReplicaGroup(ranks, g.replica_cnt, g.replica_shift)
        return group

    def on_heartbeat(self, rank: int, status: pb.Status) -> None:
        r = self._known(rank)
        r.last_seen = self._clock()
        r.update(status)

    def on_stopped(self, rank: int, status: pb.Status) -> None:
        r = self._known(rank)
        r.last_seen = self._clock()
        r.update(status)
        if self.episode is not None:
            self._mark_stopped(r)

    def on_fault(self, rank: int, report: pb.FaultReport) -> None:
        r = self._known(rank)
        r.last_seen = self._clock()
        r.update(report.status)
        kind, severity = fault_fields(report)
        fault = Fault(kind=kind, rank=rank, severity=severity, message=report.message, phase=report.phase,
                      occurred_at=report.occurred_at or None, detected_at=self._wall())
        if kind is FaultKind.HANG:
            # Its loop is stuck: it cannot take part in a recovery. End the
            # process (its processor forces the exit) and treat it as lost.
            self._lose(r)
            self._exiting.add(rank)
            self._send(rank, self._command(exit=pb.Exit(code=EXIT_HUNG, reason=report.message)))
            self._fault(fault)
            return
        # A watchdog report comes from the processor's thread while the
        # training thread is still blocked: that rank must be stopped too.
        self._fault(fault, stopped=None if report.phase == "watchdog" else r)

    def on_result(self, rank: int, result: pb.CommandResult) -> None:
        r = self._known(rank)
        r.last_seen = self._clock()
        r.update(result.status)
        phase = self._current_phase()
        if phase is None or rank not in phase.waiting or rank not in phase.commands \
                or phase.commands[rank].id != result.command_id:
            log.debug("ignoring stale result %d from rank %d", result.command_id, rank)
            return
        if not result.ok:
            self._plan_failed(f"{phase.name} failed on rank {rank}: {result.message or f'code {result.code}'}")
            return
        phase.waiting.discard(rank)
        if phase.name == "save":
            written = {s.kind: s.files for s in result.shards}
            for shard in self.episode.shards:
                if shard.rank == rank:
                    shard.files.extend(written.get(shard.kind, []))
            self.episode.own.extend(result.own)
        if not phase.waiting:
            self._next_phase()

    def on_persist(self, rank: int, health: pb.PersistHealth) -> None:
        """A rank's periodic saves stopped reaching storage, or reach it again:
        only shown (``trainguard status``); training goes on."""
        self._known(rank)
        if health.failing:
            self.persist_failing[rank] = {"since_step": health.since_step, "reason": health.reason,
                                          "last_complete": health.last_complete if health.last_complete >= 0 else None}
        else:
            self.persist_failing.pop(rank, None)

    def on_goodbye(self, rank: int, status: pb.Status) -> None:
        r = self._known(rank)
        r.update(status)
        r.alive = False
        self._finished.add(rank)
        self._note("finished", rank=rank, step=r.step)
        log.debug("rank %d finished at step %d", rank, r.step)
        ep = self.episode
        if ep is not None and ep.grow and self.state is ControllerState.ABNORMAL:
            ep.unstopped.discard(rank)  # it passed its last step before the pause: no scaling up now
            self._check_prelock()
        if len(self._finished | self.dropped) == self.world_size and self.state is ControllerState.NORMAL:
            self._to(ControllerState.FINISHED)
            log.info("all %d ranks finished", self.world_size)
            if self._grow is not None:
                self._grow_failed("the job finished before the new processes ran")

    def on_disconnect(self, rank: int) -> None:
        """The rank's session ended without Goodbye."""
        r = self.ranks.get(rank)
        if r is None or not r.alive:
            return
        self._lose(r)
        if rank in self._exiting or rank in self._finished:
            return
        self._fault(Fault(kind=FaultKind.PROCESS_LOST, rank=rank,
                          message=f"pid {r.pid} on {r.host} disconnected", detected_at=self._wall()))

    def on_process_exit(self, rank: int, pid: int, code: int, reason: str = "", last_running: float = 0.0) -> None:
        """A node agent saw the rank's process exit with ``code`` (or ended
        it, for ``reason``: a process found stopped is a hang); it last saw
        it running at ``last_running`` (unix time, 0 if unknown), so the
        fault came after that."""
        r = self.ranks.get(rank)
        ep = self.episode
        grow = self._grow
        if ep is None and grow is not None and grow.started.get(rank) == pid:
            self._grow_failed(f"the new process for rank {rank} (pid {pid}) exited with code {code}")
            return
        new_pid = ep.starts.started.get(rank) if ep is not None and ep.starts is not None else None
        if new_pid == pid and (r is None or r.pid != pid or not r.alive):
            # The replacement died before it joined: a fault during the recovery.
            if ep.grow:
                ep.tried.add(Strategy.ELASTIC_TRAINING)
            self._fault(Fault(kind=FaultKind.PROCESS_LOST, rank=rank, detected_at=self._wall(),
                              message=f"replacement pid {pid} exited with code {code} before it joined"))
            return
        if r is None or r.pid != pid or not r.alive or rank in self._exiting or rank in self._finished:
            return
        self._lose(r)
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        kind = FaultKind.HANG if reason else FaultKind.PROCESS_LOST
        self._fault(Fault(kind=kind, rank=rank, message=f"pid {pid} {reason + '; ' if reason else ''}{how}",
                          occurred_at=last_running or None, detected_at=self._wall()))

    def tick(self) -> None:
        """Check heartbeats and deadlines; call a few times a second."""
        now = self._clock()
        self.links.tick()
        stalled = now - self._last_tick - 0.5
        self._last_tick = now
        if stalled > 0:
            # The event loop itself was held up: that is no rank's fault, so
            # nobody's silence during it counts.
            for r in self.ranks.values():
                r.last_seen += stalled
        if self.events is not None and now >= self._next_sample:
            self._next_sample = now + max(self.heartbeat_interval_s / 2, self.world_size / 256)
            self._sample_steps()
        if self.state is not ControllerState.INIT and now >= self._next_heartbeat_scan:
            self._next_heartbeat_scan = now + self.heartbeat_interval_s / 2
            for r in [r for r in self.ranks.values() if r.alive and now - r.last_seen > self._silence_limit(r)]:
                if r.rank in self._exiting:
                    continue
                self._lose(r)
                self._exiting.add(r.rank)
                why = f"no heartbeat for {now - r.last_seen:.1f} s"
                # Should it wake up, it must not rejoin a job that went on without it.
                self._send(r.rank, self._command(exit=pb.Exit(code=EXIT_HUNG, reason=why)))
                self._fault(Fault(kind=FaultKind.HANG, rank=r.rank, detected_at=self._wall(), message=why))
        ep = self.episode
        if ep is None:
            return
        if ep.grow and self.state is ControllerState.ABNORMAL and ep.unstopped and 0 < ep.escalate_at < now:
            # Ranks that began the next step wait in it for the ones that
            # stopped: release them (they stop mid-step, still consistent).
            ep.escalate_at = 0.0
            stop = self._command(stop=pb.Stop(reason="scaling back up"))
            for rank in sorted(ep.unstopped):
                self._send(rank, stop)
        if self.state is ControllerState.ABNORMAL and ep.unstopped and now > ep.stop_deadline:
            why = f"did not stop within {self.config.prelock_timeout_s:g} s"
            for rank in sorted(ep.unstopped):
                self._lose(self.ranks[rank])
                # Stuck in a collective with a peer that left it, it still
                # talks: tell it to go, or it waits for commands forever.
                self._exiting.add(rank)
                self._send(rank, self._command(exit=pb.Exit(code=EXIT_HUNG, reason=why)))
                ep.faults.append(Fault(kind=FaultKind.HANG, rank=rank, detected_at=self._wall(), message=why))
            self._check_prelock()
        phase = self._current_phase()
        if phase is not None and phase.waiting and now > phase.deadline:
            late = sorted(phase.waiting)
            self._plan_failed(f"{phase.name} did not finish within {phase.timeout_s:g} s on ranks {late[:16]}")

    def _silence_limit(self, r: Rank) -> float:
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

    # ------------------------------------------------------------- snapshots
    def pids(self, rank: int) -> list[int]:
        """Every pid that registered as ``rank`` (its processes, oldest first)."""
        return self._pids.get(rank, [])

    def snapshot(self) -> dict:
        """A JSON-able view for ``trainguard status`` and agents."""
        return {
            "state": self.state.name,
            "job_id": self.config.job_id,
            "world_size": self.world_size,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "ranks": {
                r.rank: {"pid": r.pid, "host": r.host, "step": r.step, "run": r.run.name,
                         "data": r.data.name, "alive": r.alive}
                for r in self.ranks.values()
            },
            "pids": {str(k): v for k, v in self._pids.items()},
            "recoveries": [rec.to_dict() for rec in self.records],
            "agents_gone": list(self.agents.gone) + [a for a in self.agents.vacated if a not in self.agents.gone],
            "episode": None if self.episode is None else {
                "faults": [f.describe() for f in self.episode.faults],
                "plan": self.episode.plan.strategy.value if self.episode.plan else None,
                "reason": self.episode.reason,
            },
            "slow_nodes": None if self.slow_nodes is None else self.slow_nodes.status(),
            "links": self.links.last,
            "persist": self._persist_view(),
        }

    def _persist_view(self) -> dict | None:
        """The ranks whose saves fail, and one line for the job (the earliest streak's)."""
        if not self.persist_failing:
            return None
        rank, first = min(self.persist_failing.items(), key=lambda item: (item[1]["since_step"], item[0]))
        complete = "none" if first["last_complete"] is None else f"step {first['last_complete']}"
        return {"failing": f"persist failing since step {first['since_step']} on ranks "
                           f"{sorted(self.persist_failing)[:16]}: {first['reason']}; last complete checkpoint: "
                           f"{complete}",
                "ranks": {str(r): v for r, v in sorted(self.persist_failing.items())}}

    # --------------------------------------------------------------- faults
    def _lose(self, r: Rank) -> None:
        r.alive = False
        if self.episode is not None:
            self.episode.unstopped.discard(r.rank)

    def _mark_stopped(self, r: Rank) -> None:
        r.stopped = True
        self.episode.unstopped.discard(r.rank)
        self._check_prelock()

    def _fault(self, fault: Fault, stopped: Rank | None = None) -> None:
        if self.state in (ControllerState.EXITED, ControllerState.FINISHED):
            log.info("fault: %s (the job had ended)", fault.describe())
            return
        log.info("fault: %s", fault.describe())  # one WARNING tells its outcome (Phases._next_phase)
        self._note("fault", kind=fault.kind.name.lower(), rank=fault.rank, phase=fault.phase,
                   message=fault.message, occurred_at=fault.occurred_at,
                   step=self.ranks[fault.rank].step if fault.rank in self.ranks else None)
        ep = self.episode
        if ep is None:
            self._epoch += 1
            reached = max((r.reached for r in self.ranks.values()), default=0)
            self.episode = Episode(self._epoch, [fault], fault.detected_at, reached)
            self._to(ControllerState.ABNORMAL)
            if stopped is not None:
                stopped.stopped = True
            self._stop_all(fault.describe())
            return
        ep.faults.append(fault)
        if stopped is not None:
            stopped.stopped = True
            ep.unstopped.discard(stopped.rank)
        if self.state in (ControllerState.RECOVERING, ControllerState.DUMPING):
            self._plan_failed(f"second fault during {ep.plan.strategy.value}: {fault.describe()}")
        else:
            self._check_prelock()

    def _stop_all(self, reason: str, at_boundary: bool = False) -> None:
        ep = self.episode
        ep.stop_deadline = self._clock() + self.config.prelock_timeout_s
        ep.unstopped = {r.rank for r in self.ranks.values() if r.alive and not r.stopped}
        stop = self._command(stop=pb.Stop(reason=reason, at_boundary=at_boundary))
        for rank in sorted(ep.unstopped):
            self._send(rank, stop)
        self._check_prelock()

    def _check_prelock(self) -> None:
        if self.state is ControllerState.ABNORMAL and not self.episode.unstopped:
            self._decide()

    def _decide(self) -> None:
        ep = self.episode
        plan = self._grow_plan() if ep.grow and Strategy.ELASTIC_TRAINING not in ep.tried else None
        if ep.grow and plan is None and ep.starts is not None:  # cannot take them in: end them
            self._give_up(ep.starts)
            ep.started, ep.starts, self._grow = set(), None, None
        view = {
            r.rank: RankState(rank=r.rank, step=r.step, data=r.data, run=r.run, alive=r.alive,
                              stopped=r.stopped, device_repairable=r.repairable)
            for r in self.ranks.values()
        }
        layout = {r.rank: r.groups for r in self.ranks.values()}
        if plan is not None:
            reason = f"scaling back up at step {plan.step}: ranks {sorted(plan.replacements)[:16]} rejoin"
        elif ep.grow:  # go on as before
            plan, reason = decide(view, [], dataclasses.replace(self.config, strategies=(Strategy.RETRY,)),
                                  self._wall(), layout=layout, tried=ep.tried)
            reason = f"scaling back up abandoned; {reason}"
        else:
            missing = set(range(self.world_size)) - set(self.ranks) - self.dropped
            plan, reason = decide(view, ep.faults, self.config, self._wall(), layout=layout, tried=ep.tried,
                                  agents=self.agents.view(), missing=missing)
        ep.plan = plan
        ep.reason = f"{ep.reason}; then {reason}" if ep.reason else reason  # keep what failed before
        log.info("decision: %s", reason)
        self._note("decision", strategy=plan.strategy.value, step=plan.step, reason=reason)
        ep.phases = self._phases(plan, layout)
        self._to({Strategy.RETRY: ControllerState.RECOVERING, Strategy.RECOVER_IN_PLACE: ControllerState.RECOVERING,
                  Strategy.RECOVER: ControllerState.RECOVERING, Strategy.ELASTIC_TRAINING: ControllerState.RECOVERING,
                  Strategy.DUMP: ControllerState.DUMPING}.get(plan.strategy, ControllerState.EXITED))
        self._start_phase()

    def _plan_failed(self, why: str) -> None:
        ep = self.episode
        log.info("%s; falling back", why)  # the outcome's one WARNING says it too
        self._note("fallback", strategy=ep.plan.strategy.value, why=why)
        started = set(ep.starts.started) if ep.starts is not None else set()
        for rank in sorted(started | ep.started):
            r = self.ranks.get(rank)
            if ep.grow and r is not None and r.alive:  # the job goes on without it, as before
                self._lose(r)
                self._exiting.add(rank)
            if ep.grow or r is None or not r.alive:  # not joined: it may sit in its startup
                self._kill_new(rank, ep.starts.placement[rank])
        if ep.starts is not None:  # and those still starting, once their agent answers
            self._end_when_started(ep.starts)
        ep.started, ep.starts = set(), None
        ep.tried.add(ep.plan.strategy)
        ep.reason = f"{ep.reason}; {why}"
        ep.phases = []
        self._to(ControllerState.ABNORMAL)
        for r in self.ranks.values():
            r.stopped = False
        self._stop_all(why)

    def _record(self) -> RecoveryRecord:
        """The record of this episode (created once, when the plan succeeds)."""
        ep = self.episode
        if ep.record is not None:
            return ep.record
        # A peer's broken collective is the symptom; the record names the
        # cause (a lost, hung or failing rank) whichever was detected first.
        first = next((f for f in ep.faults if f.kind is not FaultKind.COMM), ep.faults[0])
        ep.record = RecoveryRecord(
            fault=first.kind.name.lower(), rank=first.rank, step=ep.plan.step,
            strategy=ep.plan.strategy.value, reason=ep.reason,
            detect_s=(round(first.detected_at - first.occurred_at, 3) if first.occurred_at else None),
            recover_s=round(self._wall() - ep.detected_at, 3),
            lost_steps=max(0, ep.reached - ep.plan.step) if ep.plan.step >= 0 else -1,
            detected_at=first.detected_at, message=first.message[:300],
        )
        self.records.append(ep.record)
        self._note("recovery", **ep.record.to_dict())
        return ep.record

    # --------------------------------------------------------------- helpers
    def _command(self, **action) -> pb.Command:
        """A command with a fresh id; one object may go to many ranks."""
        cmd = pb.Command(id=self._next_id, epoch=self.episode.epoch if self.episode else 0, **action)
        self._next_id += 1
        return cmd

    def _known(self, rank: int) -> Rank:
        r = self.ranks.get(rank)
        if r is None:
            raise ProtocolError(f"message from unregistered rank {rank}")
        return r

    def _to(self, state: ControllerState) -> None:
        self.state = advance(self.state, state, what="controller")
        self._note("state", state=state.name)
        self._sample_steps()

    # ------------------------------------------------------------ event log
    def _link_verdict(self, verdict: dict) -> None:
        """A link survey ended: name the slow host and its ranks (a WARNING), or say none stood out."""
        ranks = self.agents.ranks_of(verdict["slow_node"]) if verdict["slow_node"] else []
        verdict["ranks"] = ranks
        if ranks:
            log.warning("slow node: ranks %s: %s", ranks[:16], verdict["reason"])
        else:
            log.info("link survey: %s", verdict["reason"])
        if self.slow_nodes is not None:
            self.slow_nodes.note_links(verdict)
        self._note("links", **{k: v for k, v in verdict.items() if k != "at"})

    def _note(self, ev: str, **fields: Any) -> None:
        """One event for the run directory's log (see :mod:`trainguard.core.events`)."""
        if self.events is not None:
            self.events.write(ev, t=self._wall(), **fields)

    def _sample_steps(self) -> None:
        """Every rank's step (-1: not registered) and the ranks lost (not alive, not finished), when they changed."""
        if self.events is None or not self.ranks:
            return
        steps = [self.ranks[r].step if r in self.ranks else -1 for r in range(self.world_size)]
        down = sorted(r.rank for r in self.ranks.values() if not r.alive and r.rank not in self._finished)
        if (steps, down) != self._sampled:
            self._sampled = (steps, down)
            self._note("steps", steps=steps, down=down)
