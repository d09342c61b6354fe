"""The controller's table of node agents: who runs which rank, who has room.

Every node agent announces itself on its relay stream (``AgentHello``: the
global ranks it runs, the spare workers it may start for other nodes'
ranks). The controller uses the table to place new processes
(recover-in-place on the rank's own node, recover on another), to count the
job's process restarts against ``--max-restarts``, and to hand out order
ids. Pure bookkeeping: no sockets, no clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..agent_messages import AgentAction, AgentHello, AgentOrder
from .decide import Agents
from ..links import sink_address

__all__ = ["AgentTable"]

log = logging.getLogger("trainguard.controller")


@dataclass
class _Agent:
    node: str
    ranks: set[int]
    spare: int
    adopted: set[int] = field(default_factory=set)  # other nodes' ranks it now runs
    probe: str = ""  # its link-probe sink (host:port), when it serves one


class AgentTable:
    """Args: the job's restart limit (process restarts per job)."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.restarts_left = max_restarts
        self._agents: dict[str, _Agent] = {}
        self._next_order = 1
        self.gone: list[str] = []  # agents whose relay stream ended while the job ran
        #: Agents all of whose ranks now run under other agents (their host was
        #: lost, frozen or cut off, and recover moved them): none may come back.
        self.vacated: list[str] = []

    def hello(self, node: str, hello: AgentHello) -> None:
        probe = sink_address(hello.probe)
        if hello.probe and not probe:
            log.warning("node agent %s: its link-probe sink %r is no host:port; its links are not surveyed",
                        node, hello.probe[:80])
        self._agents[node] = _Agent(node, set(hello.ranks), hello.spare, probe=probe)
        log.info("node agent %s runs ranks %s (%d spare)", node, sorted(hello.ranks)[:16], hello.spare)

    def lost(self, node: str, *, done: set[int] | frozenset[int] = frozenset(), starting: bool = False) -> None:
        """``node``'s relay stream ended; ``done``: the ranks that finished
        or were told to exit (an agent whose ranks are all done leaves as
        the job ends: no news); ``starting``: before every rank registered
        (the agent ends its round when a rank failed while starting, and
        said why: nothing was running that could be restarted)."""
        agent = self._agents.pop(node, None)
        if agent is not None:
            self.gone.append(node)
            if agent.ranks <= done:
                log.debug("node agent %s left: its ranks are done", node)
            elif starting:
                log.info("node agent %s left before every rank had registered", node)
            else:
                log.warning("node agent %s is gone: its ranks cannot be restarted on its node", node)

    def sinks(self) -> dict[str, str]:
        """The link-probe sinks of the agents still here, by node."""
        return {a.node: a.probe for a in self._agents.values() if a.probe and a.node not in self.vacated}

    def ranks_of(self, node: str) -> list[int]:
        agent = self._agents.get(node)
        return sorted(agent.ranks) if agent is not None else []

    def nodes(self) -> list[str]:
        """The node agents still here."""
        return sorted(self._agents)

    def home(self, rank: int) -> str | None:
        return next((a.node for a in self._agents.values() if rank in a.ranks), None)

    def view(self) -> Agents:
        home = {r: a.node for a in self._agents.values() for r in a.ranks}
        spare = {a.node: a.spare - len(a.adopted) for a in self._agents.values()}
        return Agents(home=home, spare=spare, restarts_left=self.restarts_left, max_restarts=self.max_restarts)

    def order(self, action: AgentAction) -> AgentOrder:
        """An order carrying ``action``, with the next order id."""
        order = AgentOrder(self._next_order, action)
        self._next_order += 1
        return order

    def started(self, rank: int, node: str) -> list[str]:
        """A new process for ``rank`` runs under ``node``: count the restart
        and, when ``node`` is not the rank's home, move the rank there (using
        one of its spare slots). Returns every agent, to tell the new budget."""
        self.restarts_left = max(0, self.restarts_left - 1)
        agent = self._agents.get(node)
        if agent is not None and rank not in agent.ranks:
            for other in self._agents.values():
                if rank in other.ranks:
                    other.ranks.discard(rank)
                    if not other.ranks and other.node not in self.vacated:
                        self.vacated.append(other.node)
            agent.ranks.add(rank)
            agent.adopted.add(rank)
        return list(self._agents)
