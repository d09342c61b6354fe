"""Commands and their results between the controller's core and the wire.

The core builds :class:`~trainguard.core.commands.Command` and reads
:class:`~trainguard.core.commands.CommandResult`; protobuf is made and read
here, at the edge only: :func:`command_to_pb` when a command leaves for its
ranks (:class:`Wired`, in the server's ``deliver``: once per command, however
many ranks it goes to), :func:`command_result` when an answer arrives
(:func:`.routing.dispatch`).
"""

from __future__ import annotations

from typing import Callable

from ..checkpoint_parts import FileInfo, SavedShard
from ..commands import (Clean, Command, CommandResult, Exit, Finalize, Rebuild, Repair, Resume, Rollback, Save,
                        Stop)
from ..protocol import trainguard_pb2 as pb
from ..rpc import rank_status

__all__ = ["Wired", "command_result", "command_to_pb"]


def _file(f: FileInfo) -> pb.FileInfo:
    return pb.FileInfo(name=f.name, bytes=f.bytes, sha256=f.sha256)


def _shard(s: SavedShard) -> pb.ShardFiles:
    return pb.ShardFiles(kind=s.kind, copies=s.copies, full=s.full, rank=s.rank, files=[_file(f) for f in s.files])


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


def command_result(result: pb.CommandResult) -> CommandResult:
    """A rank's answer as the controller's core takes it.

    Raises:
        ProtocolError: a status of no known value.
    """
    return CommandResult(
        command_id=result.command_id, ok=result.ok, status=rank_status(result.status), code=result.code,
        message=result.message,
        shards=tuple(SavedShard(kind=s.kind, copies=tuple(s.copies), full=s.full, rank=s.rank,
                                files=tuple(FileInfo(f.name, f.bytes, f.sha256) for f in s.files))
                     for s in result.shards),
        own=tuple(FileInfo(f.name, f.bytes, f.sha256) for f in result.own))


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
