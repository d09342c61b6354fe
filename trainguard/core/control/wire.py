"""Between the controller's core and the wire: protobuf in and out.

The core takes and makes plain data (:mod:`trainguard.core.commands`,
:mod:`trainguard.core.api`, :mod:`trainguard.core.reports`,
:mod:`trainguard.core.agent_messages`);
protobuf is made and read here, at the edge only:

* commands: :func:`command_to_pb` when a command leaves for its ranks
  (:class:`Wired`, in the server's ``deliver``: once per command, however
  many ranks it goes to), :func:`command_result` when an answer arrives
  (:func:`.routing.dispatch`); on the rank's side, :func:`command` when it
  arrives and :func:`result_to_pb` when the answer leaves (the rank's
  :class:`~trainguard.core.rank.processor.Processor`), so the rank's
  recovery (:mod:`trainguard.core.rank.recovery`) works on plain data too;
* a rank's registration: :class:`Hellos` (in the server's sessions), which
  parses its replica groups once for every rank that sends the same one;
* a rank's persist health: :func:`persist_report` (:func:`.routing.dispatch`);
* node agents: :func:`agent_hello` and :func:`agent_event` when they
  announce themselves and answer (the server's node sessions),
  :func:`agent_order_to_pb` when an order leaves (the server's ``order``);
  on the agent's side, :func:`agent_order` when it arrives and
  :func:`agent_event_to_pb` when the answer leaves (a link survey's).
"""

from __future__ import annotations

from typing import Callable, Iterable

from ..agent_messages import (AgentEvent, AgentHello, AgentOrder, Dropped, Kill, LinkProbe, LinkRate, Moved,
                              RestartsLeft, StartReplacement)
from ..api import ProtocolError, Transfer
from ..reports import Hello, PersistReport
from ..checkpoint_parts import FileInfo, SavedShard
from ..commands import (Clean, Command, CommandResult, Exit, Finalize, Rebuild, Repair, Resume, Rollback, Save,
                        Stop)
from ..protocol import trainguard_pb2 as pb
from ..replicas import ReplicaGroup
from ..rpc import rank_status, status_to_pb

__all__ = ["Hellos", "Wired", "agent_event", "agent_event_to_pb", "agent_hello", "agent_order", "agent_order_to_pb",
           "command", "command_result", "command_to_pb", "persist_report", "result_to_pb"]


def _file(f: FileInfo) -> pb.FileInfo:
    return pb.FileInfo(name=f.name, bytes=f.bytes, sha256=f.sha256)


def _shard(s: SavedShard) -> pb.ShardFiles:
    return pb.ShardFiles(kind=s.kind, copies=s.copies, full=s.full, rank=s.rank, files=[_file(f) for f in s.files])


def _files_from(files: Iterable[pb.FileInfo]) -> tuple[FileInfo, ...]:
    return tuple(FileInfo(f.name, f.bytes, f.sha256) for f in files)


def _shard_from(s: pb.ShardFiles) -> SavedShard:
    return SavedShard(kind=s.kind, copies=tuple(s.copies), full=s.full, rank=s.rank, files=_files_from(s.files))


#: Each action's protobuf message, by the action's type.
_TO_PB: dict[type, Callable] = {
    Stop: lambda a: pb.Stop(reason=a.reason, at_boundary=a.at_boundary),
    Clean: lambda a: pb.Clean(uce=a.uce),
    Rebuild: lambda a: pb.Rebuild(generation=a.generation, excluded=a.excluded, join_store=a.join_store),
    Repair: lambda a: pb.Repair(step=a.step, transfers=[pb.Transfer(src=t.src, dst=t.dst, kind=t.kind)
                                                        for t in a.transfers]),
    Rollback: lambda a: pb.Rollback(step=a.step),
    Save: lambda a: pb.Save(step=a.step, kinds=a.kinds, carry=a.carry),
    Finalize: lambda a: pb.Finalize(step=a.step, shards=[_shard(s) for s in a.shards], history_json=a.history_json,
                                    own=[_file(f) for f in a.own]),
    Resume: lambda a: pb.Resume(step=a.step, record_json=a.record_json, pids_json=a.pids_json, replicas=a.replicas),
    Exit: lambda a: pb.Exit(code=a.code, reason=a.reason),
}


def command_to_pb(cmd: Command) -> pb.Command:
    """The protobuf ``Command`` of ``cmd``."""
    return pb.Command(id=cmd.id, epoch=cmd.epoch, **{cmd.name: _TO_PB[type(cmd.action)](cmd.action)})


#: Each action from the value of its protobuf field, by the field's name.
_FROM_PB: dict[str, Callable] = {
    "stop": lambda m: Stop(reason=m.reason, at_boundary=m.at_boundary),
    "clean": lambda m: Clean(uce=m.uce),
    "rebuild": lambda m: Rebuild(m.generation, excluded=tuple(m.excluded), join_store=m.join_store),
    "repair": lambda m: Repair(m.step, tuple(Transfer(t.src, t.dst, t.kind) for t in m.transfers)),
    "rollback": lambda m: Rollback(m.step),
    "save": lambda m: Save(m.step, kinds=tuple(m.kinds), carry=tuple(m.carry)),
    "finalize": lambda m: Finalize(m.step, tuple(_shard_from(s) for s in m.shards), m.history_json,
                                   _files_from(m.own)),
    "resume": lambda m: Resume(m.step, m.record_json, m.pids_json, replicas=m.replicas),
    "exit": lambda m: Exit(m.code, m.reason),
}


def _action(msg, made: dict[str, Callable], what: str):
    """The action ``msg`` carries, made from its ``action`` field by ``made``.

    Raises:
        ProtocolError: ``msg`` carries none (``what`` names the message).
    """
    name = msg.WhichOneof("action")
    if name is None:
        raise ProtocolError(f"{what} {msg.id} carries no action")
    return made[name](getattr(msg, name))


def command(msg: pb.Command) -> Command:
    """A command as the rank takes it (the inverse of :func:`command_to_pb`).

    Raises:
        ProtocolError: a command with no action.
    """
    return Command(msg.id, msg.epoch, _action(msg, _FROM_PB, "command"))


def command_result(result: pb.CommandResult) -> CommandResult:
    """A rank's answer as the controller's core takes it.

    Raises:
        ProtocolError: a status of no known value.
    """
    return CommandResult(
        command_id=result.command_id, ok=result.ok, status=rank_status(result.status), code=result.code,
        message=result.message, shards=tuple(_shard_from(s) for s in result.shards), own=_files_from(result.own))


def result_to_pb(result: CommandResult) -> pb.CommandResult:
    """The protobuf ``CommandResult`` of a rank's answer (the inverse of :func:`command_result`)."""
    return pb.CommandResult(command_id=result.command_id, ok=result.ok, code=result.code, message=result.message,
                            status=status_to_pb(result.status), shards=[_shard(s) for s in result.shards],
                            own=[_file(f) for f in result.own])


class Wired:
    """:func:`command_to_pb` once per command: a command sent to many ranks
    (a phase's, shared) becomes one protobuf message they all get, which a
    node's relay then receives once (:class:`.routing.NodeLink`). Keeps the
    last ``keep`` commands' messages, by command id."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._done: dict[int, pb.Command] = {}

    def __call__(self, cmd: Command) -> pb.Command:
        message = self._done.get(cmd.id)
        if message is None:
            message = self._done[cmd.id] = command_to_pb(cmd)
            if len(self._done) > self._keep:
                del self._done[next(iter(self._done))]
        return message


class Hellos:
    """A rank's ``Hello`` as the core takes it, for a job of ``world_size``
    ranks. The replica groups are parsed once: every rank that sends the same
    group (all 16k ranks of a DP group) gets the same object (:attr:`parsed`)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.parsed: dict[tuple, ReplicaGroup] = {}  # replica groups, by what was sent

    def __call__(self, hello: pb.Hello) -> Hello:
        """Raises:
            ProtocolError: a malformed replica group, or a status of no known value.
        """
        replicas = tuple(self.group(g) for g in hello.replicas)
        return Hello(rank=hello.rank, pid=hello.pid, status=rank_status(hello.status), host=hello.host,
                     replicas=replicas, joining=hello.joining, device_repairable=hello.device_repairable,
                     join_refused=hello.join_refused[:500],
                     resumed_after_dump=hello.resumed_after_dump[:200])

    def group(self, g: pb.ReplicaGroup) -> ReplicaGroup:
        """Parse a group, reusing the object when many ranks send the same one.

        Raises:
            ProtocolError: a range of ranks with no step, or more ranks than the world.
        """
        if g.range_count:
            key = ("range", g.range_start, g.range_step, g.range_count, g.replica_cnt, g.replica_shift)
        else:
            key = ("list", tuple(g.rank_list), g.replica_cnt, g.replica_shift)
        group = self.parsed.get(key)
        if group is None:
            if g.range_count and (g.range_step == 0 or not 0 < g.range_count <= self.world_size):
                raise ProtocolError(f"replica group range of {g.range_count} ranks in steps of {g.range_step}: "
                                    f"needs a step and at most {self.world_size} ranks")
            ranks = (tuple(range(g.range_start, g.range_start + g.range_step * g.range_count, g.range_step))
                     if g.range_count else key[1])
            group = self.parsed[key] = ReplicaGroup(ranks, g.replica_cnt, g.replica_shift)
        return group


def persist_report(health: pb.PersistHealth) -> PersistReport:
    """A rank's persist health as the core takes it (``last_complete`` -1 on the wire: None)."""
    return PersistReport(failing=health.failing, since_step=health.since_step, reason=health.reason,
                         last_complete=health.last_complete if health.last_complete >= 0 else None)


def agent_hello(hello: pb.AgentHello) -> AgentHello:
    """A node agent's announcement as the core takes it (its key stays at
    the edge: :func:`.routing.check_agent` checked it)."""
    return AgentHello(ranks=tuple(hello.ranks), spare=hello.spare, probe=hello.probe)


def agent_event(event: pb.AgentEvent) -> AgentEvent:
    """A node agent's answer to an order as the core takes it."""
    return AgentEvent(order=event.order, rank=event.rank, ok=event.ok, pid=event.pid, join_store=event.join_store,
                      message=event.message,
                      rates=tuple(LinkRate(r.node, r.bytes_per_s, r.error) for r in event.rates))


#: Each agent order's action as the value of its protobuf field, by the action's type.
_AGENT_TO_PB: dict[type, Callable] = {
    StartReplacement: lambda a: pb.StartReplacement(rank=a.rank, generation=a.generation, step=a.step,
                                                    join_store=a.join_store),
    Kill: lambda a: a.rank,
    RestartsLeft: lambda a: a.count,
    Moved: lambda a: a.rank,
    Dropped: lambda a: a.rank,
    LinkProbe: lambda a: pb.LinkProbe(nodes=a.nodes, addrs=a.addrs, bytes=a.bytes),
}


def agent_order_to_pb(order: AgentOrder) -> pb.AgentOrder:
    """The protobuf ``AgentOrder`` of ``order``."""
    return pb.AgentOrder(id=order.id, **{order.name: _AGENT_TO_PB[type(order.action)](order.action)})


#: Each agent order's action from the value of its protobuf field, by the field's name.
_AGENT_FROM_PB: dict[str, Callable] = {
    "start": lambda v: StartReplacement(rank=v.rank, generation=v.generation, step=v.step, join_store=v.join_store),
    "kill": Kill,
    "restarts_left": RestartsLeft,
    "moved": Moved,
    "dropped": Dropped,
    "probe": lambda v: LinkProbe(nodes=tuple(v.nodes), addrs=tuple(v.addrs), bytes=v.bytes),
}


def agent_order(order: pb.AgentOrder) -> AgentOrder:
    """An order as the node agent takes it (the inverse of :func:`agent_order_to_pb`).

    Raises:
        ProtocolError: an order with no action.
    """
    return AgentOrder(order.id, _action(order, _AGENT_FROM_PB, "agent order"))


def agent_event_to_pb(event: AgentEvent) -> pb.AgentEvent:
    """The protobuf ``AgentEvent`` of a node agent's answer (the inverse of :func:`agent_event`)."""
    rates = [pb.LinkRate(node=r.node, bytes_per_s=r.bytes_per_s, error=r.error) for r in event.rates]
    return pb.AgentEvent(order=event.order, rank=event.rank, ok=event.ok, pid=event.pid, join_store=event.join_store,
                         message=event.message, rates=rates)
