"""What a rank does between leaving a step and training again (or exiting).

Adapters implement :class:`Handlers` (MindIO's stop / clean / repair /
rollback / save / rename handlers, as one object) and call :func:`recover`
on the training thread after the step was left. ``recover`` reports the
fault (or answers the STOP that caused the stop), then executes the
controller's commands one by one until it is told to resume or to exit.
"""

from __future__ import annotations

import abc
import json
import logging
from dataclasses import dataclass
from typing import Sequence

from ..api import DataStatus, FaultKind, ForceStop, RunStatus, Severity, Transfer
from ..checkpoint import FileInfo, SavedShard
from ..classify import Classifier
from ..faults import FaultInjector
from .processor import Processor
from ..protocol import trainguard_pb2 as pb

__all__ = ["Handlers", "Outcome", "recover"]

log = logging.getLogger("trainguard.recovery")

#: ``clean`` results, as MindIO defines them.
CLEAN_OK, CLEAN_FAILED, CLEAN_NO_REBUILD = 0, 1, 2


class Handlers(abc.ABC):
    """How a framework carries out each recovery command. Every method runs
    on the training thread and may raise; a raised error fails the command
    and the controller falls back to its next strategy."""

    @abc.abstractmethod
    def clean(self, uce: bool) -> int:
        """Throw away the effects of the step that was left; when ``uce``,
        also clean the faulty device. Returns 0 (ok), 1 (failed) or 2 (ok,
        and the fault did not touch state)."""

    @abc.abstractmethod
    def rebuild(self, generation: int, ranks: Sequence[int], join_store: str = "") -> None:
        """Create fresh communication among ``ranks`` (every rank calls it).
        With ``join_store``, new processes replace lost ones: meet them on
        that store (``host:port``) as their start-up expects."""

    @abc.abstractmethod
    def repair(self, step: int, transfers: Sequence[Transfer]) -> None:
        """Send or receive state for each transfer naming this rank."""

    @abc.abstractmethod
    def rollback(self, step: int) -> None:
        """Put data position, LR schedule and step counter back to ``step``."""

    @abc.abstractmethod
    def save(self, step: int, kind: int) -> Sequence[FileInfo]:
        """Write this rank's copy of its ``kind`` state (0 dense, 1 experts)
        at ``step`` under the checkpoint's temporary name; return the files."""

    def save_own(self, step: int, carry: Sequence[int]) -> Sequence[FileInfo]:
        """Write this rank's own part of the state at ``step`` (what its
        replicas do not share: random streams, data position) and that of
        each lost rank in ``carry``, from the record it left on this node
        (:mod:`trainguard.core.snapshot.own`); return the files. None by
        default: a framework whose replicas share everything."""
        return []

    @abc.abstractmethod
    def finalize(self, step: int, shards: Sequence[SavedShard], history: dict,
                 own: Sequence[FileInfo] = ()) -> None:
        """Verify every shard's files and the ``own`` part files, write the
        manifest, rename the checkpoint to its final name and update the
        tracker."""

    def resumed(self, step: int, record: dict, pids: dict | None = None, replicas: int = 0) -> None:
        """Training continues at ``step`` (``record`` describes the recovery;
        ``pids``, after new processes joined, every rank's PIDs so far;
        ``replicas``, how many data-parallel replicas train from now on)."""


@dataclass(frozen=True)
class Outcome:
    """How :func:`recover` ended: resume at ``step``, or exit with ``exit_code``."""

    resume: bool
    step: int = -1
    exit_code: int = 0
    reason: str = ""
    record: dict | None = None


def report_left_step(processor: Processor, error: BaseException, classifier: Classifier,
                     *, phase: str = "", occurred_at: float | None = None) -> bool:
    """Tell the controller why this rank left its step.

    Returns:
        True when ``error`` is the rank's own fault (it was reported), False
        when it only answers a stop (the queued STOP command is answered in
        :func:`recover`).
    """
    verdict = classifier.classify(error, in_update=processor.data is DataStatus.UPDATING)
    if verdict.is_stop:
        if processor.stop_event.is_set():
            return False
        # FORCE STOP text with no stop pending: a peer aborted our collective.
        kind, severity = FaultKind.COMM, Severity.HIGH
    else:
        kind, severity = verdict.kind, verdict.severity
    cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    processor.report_fault(kind, severity, cause, phase=phase, occurred_at=occurred_at)
    # A fault trainguard repairs is the controller's one line; the traceback of
    # anything else (a bug in the script, say) is for the user to read.
    text = " ".join(cause.split())[:500]
    if kind.in_process:
        log.info("rank %d left step %d: %s (%s)", processor.rank, processor.step, text, kind.name)
        log.debug("rank %d left step %d", processor.rank, processor.step, exc_info=error)
    else:
        log.error("rank %d left step %d: %s (%s)", processor.rank, processor.step, text, kind.name, exc_info=error)
    return True


def recover(processor: Processor, handlers: Handlers, *, injector: FaultInjector | None = None) -> Outcome:
    """Execute the controller's commands until resume or exit.

    Raises:
        ControllerLostError: the controller went away mid-recovery.
    """
    while True:
        cmd = processor.next_command()
        action = cmd.WhichOneof("action")
        if action == "stop":
            processor.report_stopped()
            continue
        if action == "exit":
            processor.set_run(RunStatus.EXITING, "exit command")
            return Outcome(resume=False, exit_code=cmd.exit.code, reason=cmd.exit.reason)
        if action == "resume":
            record = json.loads(cmd.resume.record_json) if cmd.resume.record_json else None
            pids = json.loads(cmd.resume.pids_json) if cmd.resume.pids_json else None
            handlers.resumed(cmd.resume.step, record or {}, pids, cmd.resume.replicas)
            processor.resumed(new_processes=bool(pids))  # the controller sends the PIDs when it started some
            return Outcome(resume=True, step=cmd.resume.step, record=record)
        processor.set_run(RunStatus.RECOVERING, f"{action} command")
        try:
            if injector is not None:
                injector.strike("recovery", processor.step)
            code, shards = _execute(handlers, action, cmd, processor.world_size)
            processor.send_result(cmd, ok=code != CLEAN_FAILED, code=code,
                                  message="clean failed" if code == CLEAN_FAILED else "", shards=shards[0],
                                  own=shards[1])
        except ForceStop as e:
            processor.send_result(cmd, ok=False, message=str(e))
        except Exception as e:  # the controller falls back, and its one WARNING tells why
            log.info("rank %d: %s handler failed: %s: %s", processor.rank, action, type(e).__name__, e)
            log.debug("rank %d: %s handler failed", processor.rank, action, exc_info=True)
            processor.send_result(cmd, ok=False, message=f"{type(e).__name__}: {e}")
        processor.set_run(RunStatus.STOPPED, f"{action} command done")


def _files(files: Sequence[FileInfo]) -> list[pb.FileInfo]:
    return [pb.FileInfo(name=f.name, bytes=f.bytes, sha256=f.sha256) for f in files]


def _execute(handlers: Handlers, action: str, cmd: pb.Command,
             world_size: int) -> tuple[int, tuple[list[pb.ShardFiles], list[pb.FileInfo]]]:
    """Carry out one command; returns the clean code (else 0) and, for a
    save, the shards and own-part files written."""
    if action == "clean":
        return handlers.clean(cmd.clean.uce), ([], [])
    if action == "rebuild":
        excluded = set(cmd.rebuild.excluded)
        handlers.rebuild(cmd.rebuild.generation, [r for r in range(world_size) if r not in excluded],
                         cmd.rebuild.join_store)
    elif action == "repair":
        handlers.repair(cmd.repair.step, [Transfer(t.src, t.dst, t.kind) for t in cmd.repair.transfers])
    elif action == "rollback":
        handlers.rollback(cmd.rollback.step)
    elif action == "save":
        written = [pb.ShardFiles(kind=kind, files=_files(handlers.save(cmd.save.step, kind)))
                   for kind in cmd.save.kinds]
        return 0, (written, _files(handlers.save_own(cmd.save.step, list(cmd.save.carry))))
    elif action == "finalize":
        shards = [SavedShard(kind=s.kind, copies=tuple(s.copies), full=s.full, rank=s.rank,
                             files=tuple(FileInfo(f.name, f.bytes, f.sha256) for f in s.files))
                  for s in cmd.finalize.shards]
        history = json.loads(cmd.finalize.history_json) if cmd.finalize.history_json else {}
        own = [FileInfo(f.name, f.bytes, f.sha256) for f in cmd.finalize.own]
        # Handlers of a framework with no own parts may not take them.
        handlers.finalize(cmd.finalize.step, shards, history, **({"own": own} if own else {}))
    else:
        raise ValueError(f"unknown command {action!r}")
    return 0, ([], [])
