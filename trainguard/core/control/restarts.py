"""New processes for ranks: restarts, moves and scaling back up.

A mix-in of :class:`~trainguard.core.control.controller.ControllerCore` (it uses the
core's state and helpers; every method runs on the controller's loop):

* node agents announce themselves and answer start orders
  (:meth:`on_agent`, :meth:`on_agent_event`);
* ``recover-in-place`` and ``recover`` start new processes in their plan's
  *respawn* phase (:meth:`_respawn`); the first one's agent serves the store
  they all meet the survivors on, so the rest are ordered once its address
  is known (:meth:`_order_starts`);
* after ``elastic-training`` dropped ranks, new processes for them start
  while the others train (:meth:`_grow_back`); once all of them reached
  their rendezvous the job pauses at a step boundary and takes them in
  (:meth:`_begin_grow`, :meth:`_grow_plan`).
"""

from __future__ import annotations

import logging

from ..api import ControllerState, DataStatus, Plan, Strategy
from .episode import Episode, Phase, Starts
from ..protocol import trainguard_pb2 as pb
from ..replicas import choose_sources

__all__ = ["Restarts"]

log = logging.getLogger("trainguard.controller")


class Restarts:
    """Restart, move and scale-up logic of the controller (a mix-in)."""

    # ------------------------------------------------------------ agents
    def on_agent(self, node: str, hello: pb.AgentHello) -> None:
        self.agents.hello(node, hello)

    def on_agent_lost(self, node: str) -> None:
        over = self.state in (ControllerState.EXITED, ControllerState.FINISHED)
        self.agents.lost(node, done=set(range(self.world_size)) if over else self._finished | self._exiting)

    def survey_links(self, why: str) -> None:
        """Ask the node agents to measure their links (the job slowed down as a whole)."""
        self.links.start(self.agents.sinks(), why)

    def on_agent_event(self, node: str, event: pb.AgentEvent) -> None:
        """A node agent answered an order: a start, or a link survey."""
        if self.links.answer(event.order, node, [(r.node, r.bytes_per_s, r.error) for r in event.rates]):
            return
        ep = self.episode
        phase = self._current_phase()
        if phase is not None and phase.name == "respawn" and ep.starts is not None:
            starts, growing = ep.starts, False
        elif self._grow is not None and ep is None:
            starts, growing = self._grow, True
        else:
            starts, growing = None, False
        if event.order in self._unwanted:  # given up while it started: it would wait to join for ever
            self._unwanted.discard(event.order)
            if event.ok:
                log.warning("ending rank %d's new process (pid %d): it is no longer wanted", event.rank, event.pid)
                self._kill_new(event.rank, node)
            return
        if starts is None or starts.orders.get(event.rank) != event.order or event.rank in starts.started:
            log.debug("ignoring stale agent event for rank %d from %s", event.rank, node)
            return
        if not event.ok:
            why = f"node agent {node} could not start rank {event.rank}: {event.message}"
            if growing:
                self._grow_failed(why)
            else:
                self._plan_failed(why)
            return
        starts.started[event.rank] = event.pid
        starts.store = starts.store or event.join_store
        for other in self.agents.started(event.rank, node):
            self._send_agent(other, self.agents.order(restarts_left=self.agents.restarts_left))
        log.warning("rank %d restarted as pid %d by %s (%d process restarts left)", event.rank, event.pid, node,
                    self.agents.restarts_left)
        self._order_starts(starts)
        if not starts.done:
            return
        if growing:
            self._begin_grow()
        else:
            ep.join_store, ep.started = starts.store, set(starts.started)
            phase.waiting.clear()
            self._next_phase()

    def _order_starts(self, starts: Starts) -> None:
        """Order the first start, or, once its store is known, the rest."""
        for rank, node in sorted(starts.placement.items()):
            if rank in starts.orders:
                continue
            order = self.agents.order(start=pb.StartReplacement(
                rank=rank, generation=starts.generation, step=starts.step, join_store=starts.store))
            starts.orders[rank] = order.id
            self._send_agent(node, order)
            if not starts.store:
                return

    # ------------------------------------------------------------ scaling back up
    def _grow_back(self) -> None:
        """After elastic-training dropped ranks: start new processes for them
        while the others train (restart budget and agents permitting); the
        job takes them back at a step boundary once all of them run."""
        ranks = sorted(self.dropped)
        homes = {r: self.agents.home(r) for r in ranks}
        if not ranks or self._grow is not None:
            return
        if self.agents.restarts_left < len(ranks) or None in homes.values():
            log.warning("elastic-training goes on with %d ranks: no restart left or no agent to start ranks %s "
                        "again", self.world_size - len(ranks), ranks[:16])
            return
        self.generation += 1
        self._grow = Starts(placement=homes, generation=self.generation, step=-1)
        log.warning("starting new processes for ranks %s to scale back up", ranks[:16])
        self._order_starts(self._grow)

    def _begin_grow(self) -> None:
        """Every new process runs: pause the others at their next step
        boundary (no collective is released), then take the new ones in."""
        if self._finished:  # the others are past their last step: nothing to join
            self._grow_failed(f"ranks {sorted(self._finished)[:16]} finished training")
            return
        self._epoch += 1
        reached = max((r.reached for r in self.ranks.values()), default=0)
        ep = self.episode = Episode(self._epoch, [], self._wall(), reached, grow=True, starts=self._grow,
                                     join_store=self._grow.store, started=set(self._grow.started))
        self._to(ControllerState.ABNORMAL)
        limit = max((r.step_time_s for r in self.ranks.values() if r.alive), default=0.0)
        ep.escalate_at = self._clock() + max(2.0, 3 * limit)
        self._stop_all("scaling back up at a step boundary", at_boundary=True)

    def _grow_plan(self) -> Plan | None:
        """The plan that takes the new processes in, or None when the
        others are not consistent at one step (or some finished)."""
        ep = self.episode
        if self._finished:
            return None
        live = [r for r in self.ranks.values() if r.alive and r.rank not in ep.started]
        lock = max((r.step for r in live if r.stopped and r.data is DataStatus.UPDATED), default=None)
        usable = frozenset(r.rank for r in live if r.stopped and r.data is DataStatus.UPDATED and r.step == lock)
        targets = sorted(ep.started) + [r.rank for r in live if r.rank not in usable]
        transfers, missing = choose_sources({r.rank: r.groups for r in self.ranks.values()}, targets, usable)
        if lock is None or missing or len(usable) < len(live):
            return None
        return Plan(strategy=Strategy.ELASTIC_TRAINING, step=lock, participants=tuple(sorted(r.rank for r in live)),
                    transfers=tuple(transfers), replacements=dict(ep.starts.placement))

    def _grow_failed(self, why: str) -> None:
        log.warning("scaling back up abandoned: %s", why)
        grow, self._grow = self._grow, None
        self._give_up(grow)

    def _give_up(self, starts: Starts) -> None:
        """End the processes a scale-up began (one that registered already
        is not a fault when it goes); those whose agent has not answered yet
        are ended when it does."""
        for rank, node in starts.placement.items():
            if rank in starts.started:
                r = self.ranks.get(rank)
                if r is not None and r.alive:
                    self._lose(r)
                    self._exiting.add(rank)
                self._kill_new(rank, node)
        self._end_when_started(starts)

    def _end_when_started(self, starts: Starts) -> None:
        self._unwanted.update(order for rank, order in starts.orders.items() if rank not in starts.started)

    def _drop(self, ranks: set[int]) -> None:
        """The job goes on without ``ranks`` (elastic-training): it finishes
        when the others do, and their agents do not count them as failed."""
        for rank in sorted(ranks - self.dropped):
            home = self.agents.home(rank)
            if home is not None:
                self._send_agent(home, self.agents.order(dropped=rank))
        self.dropped |= ranks

    def _kill_new(self, rank: int, node: str) -> None:
        """End a new process that will not join; a rank elastic-training
        dropped stays dropped for its agent."""
        self._send_agent(node, self.agents.order(kill=rank))
        if rank in self.dropped:
            self._send_agent(node, self.agents.order(dropped=rank))

    def _respawn(self, phase: Phase, plan: Plan) -> None:
        """Order each replacement's agent to start it (and tell a rank's old
        agent, when the rank moves to another node, not to count it)."""
        for rank, node in sorted(plan.replacements.items()):
            home = self.agents.home(rank)
            if home is not None and home != node:
                self._send_agent(home, self.agents.order(moved=rank))
        self.episode.starts = Starts(placement=dict(plan.replacements), generation=self.generation, step=plan.step)
        self._order_starts(self.episode.starts)
