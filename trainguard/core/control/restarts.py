"""New processes for ranks: restarts, moves and scaling back up.

:class:`~trainguard.core.control.controller.ControllerCore` owns one
:class:`Restarts`, given the job's shared state (:class:`~.job.Job`), the
node agents, the way to send them orders and the clocks; every method runs
on the controller's loop:

* node agents announce themselves and answer start orders
  (:meth:`on_agent`, :meth:`on_agent_event`);
* ``recover-in-place`` and ``recover`` start new processes in their plan's
  *respawn* phase (:meth:`respawn`); the first one's agent serves the store
  they all meet the survivors on, so the rest are ordered once its address
  is known (:meth:`order_starts`);
* after ``elastic-training`` dropped ranks, new processes for them start
  while the others train (:meth:`grow_back`); once all of them reached
  their rendezvous the job pauses at a step boundary and takes them in
  (:meth:`_begin_grow`, :meth:`grow_plan`).
"""

from __future__ import annotations

import logging
from typing import Callable

from ..agent_messages import AgentEvent, AgentHello, AgentOrder, Dropped, Kill, Moved, RestartsLeft, StartReplacement
from ..api import ControllerState, DataStatus, Plan, Strategy
from .agents import AgentTable
from .episode import Episode, Phase, Starts
from .job import Job
from ..links import Surveyor
from ..replicas import choose_sources

__all__ = ["Restarts"]

log = logging.getLogger("trainguard.controller")


class Restarts:
    """Restart, move and scale-up logic of the controller.

    Args:
        job: the controller's shared state.
        agents: the node agents (placement, restart budget, order ids).
        links: the surveys of the agents' links.
        send_agent: delivers an order to a node agent.
        clock: monotonic seconds, for the scale-up's deadline.
        wall: unix seconds, for an episode's start.
        next_phase: the current phase is done (all new processes run).
        plan_failed: the plan is abandoned, for the reason given.
        stop_all: stops every live rank, for a reason (at a step boundary).
    """

    def __init__(self, job: Job, agents: AgentTable, links: Surveyor, send_agent: Callable[[str, AgentOrder], None],
                 clock: Callable[[], float], wall: Callable[[], float], *, next_phase: Callable[[], None],
                 plan_failed: Callable[[str], None], stop_all: Callable[..., None]) -> None:
        self.job, self.roster, self.agents, self.links = job, job.roster, agents, links
        self.world_size = job.roster.world_size
        self._send_agent, self._clock, self._wall = send_agent, clock, wall
        self._next_phase, self._plan_failed, self._stop_all = next_phase, plan_failed, stop_all

    # ------------------------------------------------------------ agents
    def on_agent(self, node: str, hello: AgentHello) -> None:
        self.agents.hello(node, hello)

    def on_agent_lost(self, node: str) -> None:
        over = self.job.state in (ControllerState.EXITED, ControllerState.FINISHED)
        roster = self.roster
        # A rank that never registered (its script built no Guard) is no rank trainguard could restart.
        self.agents.lost(node, done=set(range(self.world_size)) if over else
                         roster.finished | roster.exiting | roster.missing(),
                         starting=self.job.state is ControllerState.INIT)

    def no_more_restarts(self) -> None:
        """Spend the job's restart budget: every node agent is told none is left, so neither a
        process restart nor torch's restart of the whole group follows (a fault no relaunch helps)."""
        self.agents.restarts_left = 0
        for node in self.agents.nodes():
            self._send_agent(node, self.agents.order(RestartsLeft(0)))

    def survey_links(self, why: str) -> None:
        """Ask the node agents to measure their links (the job slowed down as a whole)."""
        self.links.start(self.agents.sinks(), why)

    def on_agent_event(self, node: str, event: AgentEvent) -> None:
        """A node agent answered an order: a start, or a link survey."""
        if self.links.answer(event.order, node, event.rates):
            return
        ep = self.job.episode
        phase = self.job.current_phase()
        if phase is not None and phase.name == "respawn" and ep.starts is not None:
            starts, growing = ep.starts, False
        elif self.job.grow is not None and ep is None:
            starts, growing = self.job.grow, True
        else:
            starts, growing = None, False
        if event.order in self.job.unwanted:  # given up while it started: it would wait to join for ever
            self.job.unwanted.discard(event.order)
            if event.ok:
                log.warning("ending rank %d's new process (pid %d): it is no longer wanted", event.rank, event.pid)
                self.kill_new(event.rank, node)
            return
        if starts is None or starts.orders.get(event.rank) != event.order or event.rank in starts.started:
            log.debug("ignoring stale agent event for rank %d from %s", event.rank, node)
            return
        if not event.ok:
            why = f"node agent {node} could not start rank {event.rank}: {event.message}"
            if growing:
                self.grow_failed(why)
            else:
                self._plan_failed(why)
            return
        starts.started[event.rank] = event.pid
        starts.store = starts.store or event.join_store
        for other in self.agents.started(event.rank, node):
            self._send_agent(other, self.agents.order(RestartsLeft(self.agents.restarts_left)))
        log.info("rank %d restarted as pid %d by %s (%d process restarts left)", event.rank, event.pid, node,
                    self.agents.restarts_left)
        self.order_starts(starts)
        if not starts.done:
            return
        if growing:
            self._begin_grow()
        else:
            ep.join_store, ep.started = starts.store, set(starts.started)
            phase.waiting.clear()
            self._next_phase()

    def order_starts(self, starts: Starts) -> None:
        """Order the first start, or, once its store is known, the rest."""
        for rank, node in sorted(starts.placement.items()):
            if rank in starts.orders:
                continue
            order = self.agents.order(StartReplacement(
                rank=rank, generation=starts.generation, step=starts.step, join_store=starts.store))
            starts.orders[rank] = order.id
            self._send_agent(node, order)
            if not starts.store:
                return

    # ------------------------------------------------------------ scaling back up
    def grow_back(self) -> None:
        """After elastic-training dropped ranks: start new processes for them
        while the others train (restart budget and agents permitting); the
        job takes them back at a step boundary once all of them run."""
        ranks = sorted(self.roster.dropped)
        homes = {r: self.agents.home(r) for r in ranks}
        if not ranks or self.job.grow is not None:
            return
        if self.agents.restarts_left < len(ranks) or None in homes.values():
            log.warning("elastic-training goes on with %d ranks: no restart left or no agent to start ranks %s "
                        "again", self.world_size - len(ranks), ranks[:16])
            return
        self.job.generation += 1
        self.job.grow = Starts(placement=homes, generation=self.job.generation, step=-1)
        log.warning("starting new processes for ranks %s to scale back up", ranks[:16])
        self.order_starts(self.job.grow)

    def _begin_grow(self) -> None:
        """Every new process runs: pause the others at their next step
        boundary (no collective is released), then take the new ones in."""
        if self.roster.finished:  # the others are past their last step: nothing to join
            self.grow_failed(f"ranks {sorted(self.roster.finished)[:16]} finished training")
            return
        self.job.epoch += 1
        reached = max((r.reached for r in self.roster.ranks.values()), default=0)
        grow = self.job.grow
        ep = self.job.episode = Episode(self.job.epoch, [], self._wall(), reached, grow=True, starts=grow,
                                        join_store=grow.store, started=set(grow.started))
        self.job.to(ControllerState.ABNORMAL)
        limit = max((r.step_time_s for r in self.roster.ranks.values() if r.alive), default=0.0)
        ep.escalate_at = self._clock() + max(2.0, 3 * limit)
        self._stop_all("scaling back up at a step boundary", at_boundary=True)

    def grow_plan(self) -> Plan | None:
        """The plan that takes the new processes in, or None when the
        others are not consistent at one step (or some finished)."""
        ep = self.job.episode
        if self.roster.finished:
            return None
        live = [r for r in self.roster.ranks.values() if r.alive and r.rank not in ep.started]
        lock = max((r.step for r in live if r.stopped and r.data is DataStatus.UPDATED), default=None)
        usable = frozenset(r.rank for r in live if r.stopped and r.data is DataStatus.UPDATED and r.step == lock)
        targets = sorted(ep.started) + [r.rank for r in live if r.rank not in usable]
        transfers, missing = choose_sources({r.rank: r.groups for r in self.roster.ranks.values()}, targets, usable)
        if lock is None or missing or len(usable) < len(live):
            return None
        return Plan(strategy=Strategy.ELASTIC_TRAINING, step=lock, participants=tuple(sorted(r.rank for r in live)),
                    transfers=tuple(transfers), replacements=dict(ep.starts.placement))

    def exited_before_joining(self, rank: int, pid: int, code: int, *, joined: bool) -> str | None:
        """A process ``pid`` for ``rank`` exited with ``code`` (``joined``:
        it registered as that rank and is alive). One a scale-up started:
        the scale-up fails (""). A replacement a recovery started that had
        not joined: why, as the fault during the recovery (a scale-up's
        strategy then counts as tried). ``None``: not a new process of ours."""
        ep, grow = self.job.episode, self.job.grow
        if ep is None and grow is not None and grow.started.get(rank) == pid:
            self.grow_failed(f"the new process for rank {rank} (pid {pid}) exited with code {code}")
            return ""
        if ep is not None and ep.starts is not None and ep.starts.started.get(rank) == pid and not joined:
            if ep.grow:
                ep.tried.add(Strategy.ELASTIC_TRAINING)
            return f"replacement pid {pid} exited with code {code} before it joined"
        return None

    def grow_failed(self, why: str) -> None:
        log.warning("scaling back up abandoned: %s", why)
        grow, self.job.grow = self.job.grow, None
        self.give_up(grow)

    def give_up(self, starts: Starts) -> None:
        """End the processes a scale-up began (one that registered already
        is not a fault when it goes); those whose agent has not answered yet
        are ended when it does."""
        for rank, node in starts.placement.items():
            if rank in starts.started:
                r = self.roster.ranks.get(rank)
                if r is not None and r.alive:
                    self.job.lose(r)
                    self.roster.exiting.add(rank)
                self.kill_new(rank, node)
        self.end_when_started(starts)

    def end_when_started(self, starts: Starts) -> None:
        self.job.unwanted.update(order for rank, order in starts.orders.items() if rank not in starts.started)

    def drop(self, ranks: set[int]) -> None:
        """The job goes on without ``ranks`` (elastic-training): it finishes
        when the others do, and their agents do not count them as failed."""
        for rank in sorted(ranks - self.roster.dropped):
            home = self.agents.home(rank)
            if home is not None:
                self._send_agent(home, self.agents.order(Dropped(rank)))
        self.roster.dropped |= ranks

    def kill_new(self, rank: int, node: str) -> None:
        """End a new process that will not join; a rank elastic-training
        dropped stays dropped for its agent."""
        self._send_agent(node, self.agents.order(Kill(rank)))
        if rank in self.roster.dropped:
            self._send_agent(node, self.agents.order(Dropped(rank)))

    def respawn(self, phase: Phase, plan: Plan) -> None:
        """Order each replacement's agent to start it (and tell a rank's old
        agent, when the rank moves to another node, not to count it)."""
        for rank, node in sorted(plan.replacements.items()):
            home = self.agents.home(rank)
            if home is not None and home != node:
                self._send_agent(home, self.agents.order(Moved(rank)))
        starts = Starts(placement=dict(plan.replacements), generation=self.job.generation, step=plan.step)
        self.job.episode.starts = starts
        self.order_starts(starts)
