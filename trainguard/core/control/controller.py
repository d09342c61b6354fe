"""The controller's state machine: ranks, fault episodes, plans in phases.

:class:`ControllerCore` holds no sockets and no threads. The gRPC server
(:mod:`trainguard.core.control.server`) feeds it events (``on_hello``,
``on_fault``...) from one event loop and it answers by calling ``send(rank,
command)``, with a plain :class:`~trainguard.core.commands.Command`, or
``send_agent(node, order)`` with an :class:`~trainguard.core.agent_messages.AgentOrder`.
Events and answers are plain data too; the server translates protobuf both
ways (:mod:`.wire`). Its clocks are injected, so tests drive it by hand.

An *episode* begins with the first fault while training runs normally:

1. **prelock** -- every live rank is told to STOP; each leaves its step at
   the next safe point and reports its step and data status. When all have
   (or the prelock timeout named the laggards as hung) the step is locked.
2. **decide** -- :func:`trainguard.core.control.decide.decide` picks the plan.
3. **phases** -- the plan's commands go out phase by phase (retry and
   elastic-training: clean, rebuild, repair, rollback, resume;
   recover-in-place and recover: clean, respawn, join, repair, rollback,
   resume -- see :mod:`.phases` and :mod:`.restarts`; dump: save, finalise,
   exit); a phase ends when every target answered. A failed answer, a
   timeout or a new fault abandons the plan: the strategy is marked tried,
   every rank is stopped again and the next strategy is decided.

Costs stay linear in the number of ranks: groups are parsed once at the edge and interned at
registration, a phase's command is built once and shared, the prelock counts the ranks still to stop.

Parts it owns and calls, each an object given what it uses: :mod:`.job` (the state they share),
:mod:`.roster` (the ranks), :mod:`.liveness` (silence limits), :mod:`.prelock` (stage 1),
:mod:`.planning` (stage 2), :mod:`.phases` (stage 3), :mod:`.restarts` (new processes) and
:mod:`.status` (event log, records, the status view).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

from ..agent_messages import AgentEvent, AgentHello, AgentOrder
from ..api import EXIT_HUNG, EXIT_UNRECOVERABLE, ControllerState, Fault, FaultKind, RankStatus, Strategy
from ..reports import Hello, PersistReport
from .agents import AgentTable
from ..commands import Command, CommandResult, Exit
from ..config import ControllerConfig
from ..links import Surveyor
from .episode import Episode, Rank
from .job import Job
from .liveness import Liveness
from .phases import Phases
from .planning import STATE_OF, next_plan
from .prelock import Prelock
from .restarts import Restarts
from .roster import Roster
from .status import Journal, status_view

__all__ = ["ControllerCore"]

log = logging.getLogger("trainguard.controller")


class ControllerCore:
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
        send: Callable[[int, Command], None],
        send_agent: Callable[[str, AgentOrder], None] | None = None,
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
        #: What the controller reports: the run directory's event log, link verdicts, live slow-node detection.
        self.journal = Journal(world_size, wall, self.agents.ranks_of)
        self._note = self.journal.note  # one event for the run directory's log
        #: Surveys of the node agents' links, when the job slows down as a whole.
        self.links = Surveyor(self.agents.order, self._send_agent, clock, on_verdict=self.journal.link_verdict)
        #: The ranks, their pids and groups, the ranks leaving, finished or dropped (see :mod:`.roster`).
        self.roster = roster = Roster(world_size, clock)
        #: The state machine, the episode and the counters that every part below moves (see :mod:`.job`).
        self.job = job = Job(roster, self.journal)
        #: Which ranks went silent too long (see :mod:`.liveness`).
        self.liveness = Liveness(config, self.heartbeat_interval_s, clock())
        #: Stops every live rank when an episode begins (see :mod:`.prelock`).
        self.prelock = Prelock(roster.ranks, send, job.command, clock, config.prelock_timeout_s)
        #: New processes for lost or dropped ranks (see :mod:`.restarts`).
        # Late bound: the phases, made next, use the restarts in turn.
        self.restarts = Restarts(job, self.agents, self.links, self._send_agent, clock, wall, next_phase=lambda:
                                 self.phases.next(), plan_failed=self._plan_failed, stop_all=self._stop_all)
        #: A plan's phases, built and carried out (see :mod:`.phases`).
        self.phases = Phases(job, config, send, clock, self.restarts)
        self._note("controller", job_id=config.job_id, world_size=world_size,
                   strategies=[s.value for s in config.strategies])

    #: Read-only here: the job's (see :mod:`.job`), which every part moves.
    state = property(lambda self: self.job.state, doc="Where the controller stands (a ControllerState).")
    episode = property(lambda self: self.job.episode, doc="The fault episode under way (an Episode), or None.")
    generation = property(lambda self: self.job.generation, doc="The generation of the ranks' process groups.")
    ranks = property(lambda self: self.roster.ranks, doc="The registered ranks (rank -> Rank), the roster's.")

    # ----------------------------------------------------------------- events
    def on_hello(self, hello: Hello) -> None:
        """Register a rank (its first message).

        Raises:
            ProtocolError: the rank is already connected, or its replica
                groups are malformed or disagree with its peers'.
        """
        r = self.roster.register(hello)
        self._note("rank", rank=r.rank, pid=hello.pid, host=hello.host, step=r.step, joining=hello.joining)
        log.debug("rank %d registered (pid %d on %s, step %d)", r.rank, hello.pid, hello.host, r.step)
        if hello.joining:
            self._joined(r)
            return
        if self.state is ControllerState.INIT and len(self.ranks) == self.world_size:
            self.job.to(ControllerState.NORMAL)
            log.info("all %d ranks registered", self.world_size)

    def _joined(self, r: Rank) -> None:
        """A replacement process registered: it waits for commands."""
        r.stopped = True
        phase = self.job.current_phase()
        if phase is not None and phase.name == "join" and r.rank in phase.waiting:
            log.info("rank %d rejoined (pid %d on %s)", r.rank, r.pid, r.host)
            phase.waiting.discard(r.rank)
            if not phase.waiting:
                self.phases.next()
        elif self.episode is None:
            # Nothing to join any more: it must not train on its own.
            self.roster.exiting.add(r.rank)
            self._send(r.rank, self.job.command(Exit(code=EXIT_UNRECOVERABLE,
                                                     reason="no recovery is waiting for this process")))

    def on_heartbeat(self, rank: int, status: RankStatus) -> None:
        self.roster.heard(rank, status)

    def on_stopped(self, rank: int, status: RankStatus) -> None:
        r = self.roster.heard(rank, status)
        if self.episode is not None:
            r.stopped = True
            self.episode.unstopped.discard(r.rank)
            self._check_prelock()

    def on_fault(self, rank: int, fault: Fault, status: RankStatus) -> None:
        """A rank reported ``fault`` (its rank is ``rank``'s; it is stamped
        detected now) and its status as it reported it."""
        r = self.roster.heard(rank, status)
        fault = replace(fault, rank=rank, detected_at=self._wall())
        if fault.kind is FaultKind.HANG:
            # Its loop is stuck: it cannot take part in a recovery. End the
            # process (its processor forces the exit) and treat it as lost.
            self._end(r, EXIT_HUNG, fault.message)
            self._fault(fault)
            return
        if fault.kind is FaultKind.UCE and not r.repairable:
            # Its device cannot be cleaned in the process (CUDA: the context
            # stays poisoned): end it and treat it as lost, so that a restart
            # strategy replaces it or the others dump (its node keeps its own part).
            self._end(r, EXIT_UNRECOVERABLE, f"{fault.describe()}: this rank's device cannot be repaired in the "
                                             f"process, so the process ends (a restart strategy replaces it)")
            self._fault(fault)
            return
        # A watchdog report comes from the processor's thread while the
        # training thread is still blocked: that rank must be stopped too.
        self._fault(fault, stopped=None if fault.phase == "watchdog" else r)

    def on_result(self, rank: int, result: CommandResult) -> None:
        self.roster.heard(rank, result.status)
        phase = self.job.current_phase()
        if phase is None or rank not in phase.waiting or rank not in phase.commands \
                or phase.commands[rank].id != result.command_id:
            log.debug("ignoring stale result %d from rank %d", result.command_id, rank)
            return
        if not result.ok:
            self._plan_failed(f"{phase.name} failed on rank {rank}: {result.message or f'code {result.code}'}")
            return
        phase.waiting.discard(rank)
        if phase.name == "save":
            written, shards = {s.kind: s.files for s in result.shards}, self.episode.shards
            for i, shard in enumerate(shards):
                if shard.rank == rank:
                    shards[i] = replace(shard, files=shard.files + written.get(shard.kind, ()))
            self.episode.own.extend(result.own)
        if not phase.waiting:
            self.phases.next()

    def on_persist(self, rank: int, health: PersistReport) -> None:
        """A rank's periodic saves stopped reaching storage, or reach it again:
        only shown (``trainguard status``); training goes on."""
        self.roster.persist(rank, health)

    def on_goodbye(self, rank: int, status: RankStatus) -> None:
        r = self.roster.known(rank)
        r.update(status)
        r.alive = False
        self.roster.finished.add(rank)
        self._note("finished", rank=rank, step=r.step)
        log.debug("rank %d finished at step %d", rank, r.step)
        ep = self.episode
        if ep is not None and ep.grow and self.state is ControllerState.ABNORMAL:
            ep.unstopped.discard(rank)  # it passed its last step before the pause: no scaling up now
            self._check_prelock()
        if self.roster.all_done() and self.state is ControllerState.NORMAL:
            self.job.to(ControllerState.FINISHED)
            log.info("all %d ranks finished", self.world_size)
            if self.job.grow is not None:
                self.restarts.grow_failed("the job finished before the new processes ran")

    def on_disconnect(self, rank: int) -> None:
        """The rank's session ended without Goodbye."""
        r = self.ranks.get(rank)
        if r is None or not r.alive:
            return
        self.job.lose(r)
        if rank in self.roster.exiting or rank in self.roster.finished:
            return
        self._fault(Fault(kind=FaultKind.PROCESS_LOST, rank=rank,
                          message=f"pid {r.pid} on {r.host} disconnected", detected_at=self._wall()))

    def on_process_exit(self, rank: int, pid: int, code: int, reason: str = "", last_running: float = 0.0) -> None:
        """A node agent saw the rank's process exit with ``code`` (or ended
        it, for ``reason``: a process found stopped is a hang); it last saw
        it running at ``last_running`` (unix time, 0 if unknown), so the
        fault came after that."""
        r = self.ranks.get(rank)
        early = self.restarts.exited_before_joining(rank, pid, code, joined=r is not None and r.pid == pid and r.alive)
        if early is not None:  # a new process of the restarts': a fault during the recovery, if any
            if early:
                self._fault(Fault(kind=FaultKind.PROCESS_LOST, rank=rank, detected_at=self._wall(), message=early))
            return
        if r is None or r.pid != pid or not r.alive or rank in self.roster.exiting or rank in self.roster.finished:
            return
        self.job.lose(r)
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        kind = FaultKind.HANG if reason else FaultKind.PROCESS_LOST
        self._fault(Fault(kind=kind, rank=rank, message=f"pid {pid} {reason + '; ' if reason else ''}{how}",
                          occurred_at=last_running or None, detected_at=self._wall()))

    def tick(self) -> None:
        """Check heartbeats and deadlines; call a few times a second."""
        now = self._clock()
        self.links.tick()
        self.liveness.forgive_stall(now, self.ranks.values())
        self.journal.tick(now, self.heartbeat_interval_s, self.ranks, self.roster.finished)
        if self.state is not ControllerState.INIT:
            for r in self.liveness.silent(now, self.ranks.values()):
                if r.rank in self.roster.exiting:
                    continue
                why = f"no heartbeat for {now - r.last_seen:.1f} s"
                self._end(r, EXIT_HUNG, why)  # should it wake up, it must not rejoin a job that went on without it
                self._fault(Fault(kind=FaultKind.HANG, rank=r.rank, detected_at=self._wall(), message=why))
        ep = self.episode
        if ep is None:
            return
        if self.state is ControllerState.ABNORMAL:
            self.prelock.release(ep, now)
        if self.state is ControllerState.ABNORMAL and (late := self.prelock.late(ep, now)):
            why = f"did not stop within {self.config.prelock_timeout_s:g} s"
            for rank in late:
                # Stuck in a collective with a peer that left it, it still
                # talks: tell it to go, or it waits for commands forever.
                self._end(self.ranks[rank], EXIT_HUNG, why)
                ep.faults.append(Fault(kind=FaultKind.HANG, rank=rank, detected_at=self._wall(), message=why))
            self._check_prelock()
        phase = self.job.current_phase()
        if phase is not None and phase.waiting and now > phase.deadline:
            late = sorted(phase.waiting)
            self._plan_failed(f"{phase.name} did not finish within {phase.timeout_s:g} s on ranks {late[:16]}")

    # ------------------------------------------------------------- snapshots
    def pids(self, rank: int) -> list[int]:
        """Every pid that registered as ``rank`` (its processes, oldest first)."""
        return self.roster.pids.get(rank, [])

    def snapshot(self) -> dict:
        """A JSON-able view for ``trainguard status`` and agents (see :func:`.status.status_view`)."""
        return status_view(self, self.roster.pids)

    # --------------------------------------------------------------- faults
    def _end(self, r: Rank, code: int, why: str) -> None:
        """A rank that cannot take part any more: lost, and told to exit (its processor forces it)."""
        self.job.lose(r)
        self.roster.exiting.add(r.rank)
        self._send(r.rank, self.job.command(Exit(code=code, reason=why)))

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
            self.job.epoch += 1
            reached = max((r.reached for r in self.ranks.values()), default=0)
            self.job.episode = Episode(self.job.epoch, [fault], fault.detected_at, reached)
            self.job.to(ControllerState.ABNORMAL)
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
        self.prelock.stop_all(self.episode, reason, at_boundary)
        self._check_prelock()

    def _check_prelock(self) -> None:
        if self.state is ControllerState.ABNORMAL and not self.episode.unstopped:
            self._decide()

    def _decide(self) -> None:
        ep = self.episode
        plan = self.restarts.grow_plan() if ep.grow and Strategy.ELASTIC_TRAINING not in ep.tried else None
        if ep.grow and plan is None and ep.starts is not None:  # cannot take them in: end them
            self.restarts.give_up(ep.starts)
            ep.started, ep.starts, self.job.grow = set(), None, None
        view, layout = self.roster.view(), self.roster.layout()
        plan, reason = next_plan(ep, plan, view, layout, self.config, self._wall, self.agents.view, self.roster.missing,
                                 self.roster.resumed_after)
        ep.plan = plan
        ep.reason = f"{ep.reason}; then {reason}" if ep.reason else reason  # keep what failed before
        log.info("decision: %s", reason)
        self._note("decision", strategy=plan.strategy.value, step=plan.step, reason=reason)
        if plan.final:  # a relaunch would fail alike: no node agent restarts the job (--max-restarts)
            self.restarts.no_more_restarts()
        ep.phases = self.phases.plan(plan, layout)
        self.job.to(STATE_OF.get(plan.strategy, ControllerState.EXITED))
        self.phases.start()

    def _plan_failed(self, why: str) -> None:
        ep = self.episode
        log.info("%s; falling back", why)  # the outcome's one WARNING says it too
        self._note("fallback", strategy=ep.plan.strategy.value, why=why)
        started = set(ep.starts.started) if ep.starts is not None else set()
        for rank in sorted(started | ep.started):
            r = self.ranks.get(rank)
            if ep.grow and r is not None and r.alive:  # the job goes on without it, as before
                self.job.lose(r)
                self.roster.exiting.add(rank)
            if ep.grow or r is None or not r.alive:  # not joined: it may sit in its startup
                self.restarts.kill_new(rank, ep.starts.placement[rank])
        if ep.starts is not None:  # and those still starting, once their agent answers
            self.restarts.end_when_started(ep.starts)
        ep.started, ep.starts = set(), None
        ep.tried.add(ep.plan.strategy)
        ep.reason = f"{ep.reason}; {why}"
        ep.phases = []
        self.job.to(ControllerState.ABNORMAL)
        for r in self.ranks.values():
            r.stopped = False
        self._stop_all(why)

    # ----------------------------------------------------------- node agents
    def on_agent(self, node: str, hello: AgentHello) -> None:
        self.restarts.on_agent(node, hello)

    def on_agent_lost(self, node: str) -> None:
        self.restarts.on_agent_lost(node)

    def survey_links(self, why: str) -> None:
        """Ask the node agents to measure their links (the job slowed down as a whole)."""
        self.restarts.survey_links(why)

    def on_agent_event(self, node: str, event: AgentEvent) -> None:
        """A node agent answered an order: a start, or a link survey."""
        self.restarts.on_agent_event(node, event)

