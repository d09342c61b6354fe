"""What the controller and the node agents say to each other, as plain data.

A node agent announces itself (:class:`AgentHello`) and answers the
controller's orders (:class:`AgentEvent`); the controller's core
(:mod:`trainguard.core.control`) reads these and sends :class:`AgentOrder`.
The protobuf messages of the same names (``protocol/trainguard.proto``) are
read and made only at the edge, in :mod:`trainguard.core.control.wire`.
Each order's action is one field of the protobuf ``AgentOrder``'s
``action``, the one its :attr:`name` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Union

__all__ = ["AgentAction", "AgentEvent", "AgentHello", "AgentOrder", "Dropped", "Kill", "LinkProbe", "LinkRate",
           "Moved", "RestartsLeft", "StartReplacement"]


@dataclass(frozen=True, kw_only=True)
class AgentHello:
    """A node agent's announcement: the global ranks it runs and can restart,
    how many more workers it can start for other nodes' ranks, and its
    link-probe sink (``host:port``; empty: none)."""

    ranks: tuple[int, ...] = ()
    spare: int = 0
    probe: str = ""


class LinkRate(NamedTuple):
    """What one probe of a link measured: ``bytes_per_s`` to ``node``, or ``error``."""

    node: str
    bytes_per_s: float = 0.0
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class AgentEvent:
    """A node agent's answer to order ``order``: a start (of ``rank``, as
    ``pid``, meeting on ``join_store``; ``message``: why not) or the
    rates of a link survey."""

    order: int
    rank: int = 0
    ok: bool = False
    pid: int = 0
    join_store: str = ""
    message: str = ""
    rates: tuple[LinkRate, ...] = ()


@dataclass(frozen=True)
class StartReplacement:
    """Start a new process for ``rank``, joining process-group ``generation``
    and repaired to ``step`` (-1: the next step boundary); ``join_store``:
    the store to meet on, when another agent made it."""

    rank: int
    generation: int
    step: int
    join_store: str = ""
    name: ClassVar[str] = "start"


@dataclass(frozen=True)
class Kill:
    """End this rank's new process (a recovery was abandoned)."""

    rank: int
    name: ClassVar[str] = "kill"


@dataclass(frozen=True)
class RestartsLeft:
    """The job's remaining process restarts (``--max-restarts``)."""

    count: int
    name: ClassVar[str] = "restarts_left"


@dataclass(frozen=True)
class Moved:
    """This rank now runs under another agent: its old process is no failure."""

    rank: int
    name: ClassVar[str] = "moved"


@dataclass(frozen=True)
class Dropped:
    """The job goes on without this rank (elastic-training): no failure either."""

    rank: int
    name: ClassVar[str] = "dropped"


@dataclass(frozen=True)
class LinkProbe:
    """Measure the links to these agents' sinks (``addrs``, one per node),
    sending ``bytes`` to each, and answer with their rates."""

    nodes: tuple[str, ...]
    addrs: tuple[str, ...]
    bytes: int
    name: ClassVar[str] = "probe"


AgentAction = Union[StartReplacement, Kill, RestartsLeft, Moved, Dropped, LinkProbe]


@dataclass(frozen=True)
class AgentOrder:
    """One order to a node agent; its answer names ``id``."""

    id: int
    action: AgentAction

    @property
    def name(self) -> str:
        """Which action it carries: ``"start"``, ``"kill"``... ``"probe"``."""
        return self.action.name
