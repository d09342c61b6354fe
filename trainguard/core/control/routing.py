"""Between the controller's gRPC service and its core: ways back, and checks.

The service (:mod:`trainguard.core.control.server`) holds the sessions; this module
holds what it uses that is not a gRPC method itself, all on the
controller's event loop:

* :class:`NodeLink` -- the way back to one node's relay, batching the
  commands of one burst into one delivery;
* :class:`Abort` and :data:`END` -- what ends a session's outgoing queue;
* :func:`dispatch` -- a rank's message, once checked, to the core's handler
  (in the core's types: see :mod:`.wire` for command results and persist health);
* :func:`check_agent` -- whether a node agent may take its name;
* :func:`exit_refusal` and :func:`call_exit_refusal` -- whether a worker's
  exit may be reported by a node's relay, or by a call of its own.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import grpc

from ..protocol import trainguard_pb2 as pb
from ..rpc import fault_from_pb, rank_status
from .wire import command_result, persist_report

__all__ = ["END", "Abort", "NodeLink", "call_exit_refusal", "check_agent", "dispatch", "exit_refusal"]

#: Ends a session's outgoing queue: the session is over.
END = object()


class Abort:
    """Ends a session's outgoing queue with a refusal: the call is aborted with ``code``."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        self.code, self.reason = code, reason


class NodeLink:
    """The way back to one node's relay. Commands sent to several of its ranks
    in one burst (a phase's shared command) leave as one delivery."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self._pending: dict[int, tuple[object, list[int]]] = {}

    def send(self, rank: int, message: pb.Command | pb.ControllerMessage) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        entry = self._pending.get(id(message))
        if entry is None:
            self._pending[id(message)] = (message, [rank])
        else:
            entry[1].append(rank)

    def refuse(self, rank: int, reason: str) -> None:
        self.queue.put_nowait(pb.NodeCommands(items=[pb.NodeDelivery(ranks=[rank], refused=reason)]))

    def _flush(self) -> None:
        items = []
        for message, ranks in self._pending.values():
            if isinstance(message, pb.Command):
                message = pb.ControllerMessage(command=message)
            items.append(pb.NodeDelivery(ranks=ranks, message=message))
        self._pending = {}
        self.queue.put_nowait(pb.NodeCommands(items=items))


def dispatch(core: Any, rank: int, body: str, msg: pb.RankMessage) -> None:
    """Hand a rank's message (``body``: which one it carries) to the
    :class:`~trainguard.core.control.controller.ControllerCore`, in the
    core's types where it takes them.

    Raises:
        ProtocolError: a status or fault field of no known value.
    """
    if body == "heartbeat":
        core.on_heartbeat(rank, rank_status(msg.heartbeat))
    elif body == "stopped":
        core.on_stopped(rank, rank_status(msg.stopped))
    elif body == "fault":
        core.on_fault(rank, fault_from_pb(rank, msg.fault), rank_status(msg.fault.status))
    elif body == "result":
        core.on_result(rank, command_result(msg.result))
    elif body == "goodbye":
        core.on_goodbye(rank, rank_status(msg.goodbye.status))
    elif body == "persist":
        core.on_persist(rank, persist_report(msg.persist))


def check_agent(node: str, agent: pb.AgentHello, world_size: int, keys: dict[str, bytes]) -> Abort | None:
    """Why a node agent may not announce itself as ``node``, or None.

    Its ranks must lie in the world and its spare slots not be negative; a
    name belongs to the key it was first announced with (``keys``, which
    this fills), so only the agent that took a name may take it again.
    """
    bad = [r for r in agent.ranks if not 0 <= r < world_size]
    if bad or agent.spare < 0:
        return Abort(grpc.StatusCode.INVALID_ARGUMENT, (
            f"node agent {node}: ranks {bad[:8]} outside a world of {world_size}"
            if bad else f"node agent {node}: negative spare slots {agent.spare}"))
    key = keys.setdefault(node, agent.key) if agent.key else b""
    if not key or not hmac.compare_digest(key, agent.key):
        return Abort(grpc.StatusCode.PERMISSION_DENIED, (
            f"node agent {node}: that name was announced with another key (only the agent that "
            "took it may take it again)" if agent.key else f"node agent {node}: no key"))
    return None


def exit_refusal(core: Any, agent: str | None, node: str, report: pb.ProcessExit) -> str | None:
    """Why ``node`` may not report this worker's exit, or None: only the node
    agent that runs a rank (``agent``: the agent on that relay, if any) may."""
    if agent != node or core.agents.home(report.rank) != node:
        owner = core.agents.home(report.rank) if 0 <= report.rank < core.world_size else None
        return f"an exit report for rank {report.rank}: " + (
            "it is no node agent" if agent != node else f"rank {report.rank} runs under {owner}")
    return None


def call_exit_refusal(core: Any, request: pb.ProcessExit) -> tuple[grpc.StatusCode, str] | None:
    """Why a ``ReportProcessExit`` call may not report this exit (its status
    code and reason), or None: a rank a node agent runs is reported over that
    agent's relay, and only a pid that registered as the rank may be."""
    rank = request.rank
    if not 0 <= rank < core.world_size:
        return grpc.StatusCode.INVALID_ARGUMENT, f"rank {rank} outside a world of {core.world_size}"
    home = core.agents.home(rank)
    if home is not None:  # a node agent runs it: its exits come over that agent's relay stream
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"the exit of rank {rank} is reported by its node agent {home}, not by this call")
    if core.pids(rank) and request.pid not in core.pids(rank):  # a launcher without a relay (msrun)
        return grpc.StatusCode.PERMISSION_DENIED, f"pid {request.pid} never registered as rank {rank}"
    return None
