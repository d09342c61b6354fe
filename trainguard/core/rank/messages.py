"""What a rank says to the controller, as protobuf: its hello, a fault
report (its own, or its watchdog's hang report), its saves' health. The processor builds its
messages here, so the rest of the rank side speaks the core's own types
(:mod:`trainguard.core.api`)."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Sequence

from ..api import FaultKind, Severity
from ..protocol import trainguard_pb2 as pb
from ..replicas import ReplicaGroup
from .watchdog import Alarm

if TYPE_CHECKING:
    from ..snapshot.health import Failing

__all__ = ["fault_report", "hang_report", "hello", "persist_health", "replica_group"]


def replica_group(group: ReplicaGroup) -> pb.ReplicaGroup:
    """A group on the wire; an arithmetic progression of ranks (every DP
    group) goes as three numbers instead of the whole list."""
    ranks = group.rank_list
    out = pb.ReplicaGroup(replica_cnt=group.replica_cnt, replica_shift=group.replica_shift)
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    if len(ranks) > 2 and step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        out.range_start, out.range_step, out.range_count = ranks[0], step, len(ranks)
    else:
        out.rank_list.extend(ranks)
    return out


def hello(rank: int, world_size: int, status: pb.Status, replicas: Sequence[ReplicaGroup], *, device: str,
          device_repairable: bool, restart_count: int, joining: bool, resumed_after_dump: str = "",
          join_refused: str = "") -> pb.RankMessage:
    """A rank's registration: who and where it is, what it holds, its device, the cause of the
    dying gasp it resumed from (if it did) and why no new process can join its job (if so)."""
    return pb.RankMessage(hello=pb.Hello(
        rank=rank, world_size=world_size, pid=os.getpid(), host=socket.gethostname(), status=status,
        device=device, device_repairable=device_repairable, restart_count=restart_count, joining=joining,
        replicas=[replica_group(g) for g in replicas], resumed_after_dump=resumed_after_dump,
        join_refused=join_refused))


def fault_report(kind: FaultKind, severity: Severity, message: str, *, phase: str, occurred_at: float,
                 status: pb.Status) -> pb.RankMessage:
    """A fault this rank saw (its message cut to 2,000 characters)."""
    return pb.RankMessage(fault=pb.FaultReport(
        kind=kind.value, severity=severity.value, phase=phase, message=message[:2000], occurred_at=occurred_at,
        status=status))


def hang_report(alarm: Alarm, now: float, status: pb.Status) -> pb.RankMessage:
    """The watchdog's alarm as a fault: a collective that never completes
    (everyone waits on everyone), or a training loop that hung."""
    if alarm.in_collective:
        kind, message = FaultKind.COMM, f"collective did not complete: {alarm.describe()}"
    else:
        kind, message = FaultKind.HANG, f"training loop hung: {alarm.describe()}"
    return fault_report(kind, Severity.HIGH, message, phase="watchdog", occurred_at=now - alarm.idle_s,
                        status=status)


def persist_health(failing: "Failing | None") -> pb.RankMessage:
    """This rank's periodic saves stopped reaching storage (``None``: they
    reach it again)."""
    health = pb.PersistHealth() if failing is None else pb.PersistHealth(
        failing=True, since_step=failing.since, reason=failing.reason[:2000],
        last_complete=-1 if failing.last_complete is None else failing.last_complete)
    return pb.RankMessage(persist=health)
