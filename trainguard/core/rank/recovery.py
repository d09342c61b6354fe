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
from ..commands import Action, Clean, Exit, Finalize, Rebuild, Repair, Resume, Rollback, Save, Stop
from ..faults import FaultInjector
from .processor import Processor

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
                     *, phase: str = "", occurred_at: float | None = None, cause: str | None = None) -> bool:
    """Tell the controller why this rank left its step (``cause``: how to
    say it, when the error's own text is longer than the message, as a
    framework's call-stack banner; default ``Type: text``).

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
    cause = cause or (f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
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
        match cmd.action:
            case Stop():
                processor.report_stopped()
                continue
            case Exit(code=code, reason=reason):
                processor.set_run(RunStatus.EXITING, "exit command")
                return Outcome(resume=False, exit_code=code, reason=reason)
            case Resume() as resume:
                record = json.loads(resume.record_json) if resume.record_json else None
                pids = json.loads(resume.pids_json) if resume.pids_json else None
                handlers.resumed(resume.step, record or {}, pids, resume.replicas)
                processor.resumed(new_processes=bool(pids))  # the controller sends the PIDs when it started some
                return Outcome(resume=True, step=resume.step, record=record)
        processor.set_run(RunStatus.RECOVERING, f"{cmd.name} command")
        try:
            if injector is not None:
                injector.strike("recovery", processor.step)
            code, shards, own = _execute(handlers, cmd.action, processor.world_size)
            processor.send_result(cmd.id, ok=code != CLEAN_FAILED, code=code,
                                  message="clean failed" if code == CLEAN_FAILED else "", shards=shards, own=own)
        except ForceStop as e:
            processor.send_result(cmd.id, ok=False, message=str(e))
        except Exception as e:  # the controller falls back, and its one WARNING tells why
            log.info("rank %d: %s handler failed: %s: %s", processor.rank, cmd.name, type(e).__name__, e)
            log.debug("rank %d: %s handler failed", processor.rank, cmd.name, exc_info=True)
            processor.send_result(cmd.id, ok=False, message=f"{type(e).__name__}: {e}")
        processor.set_run(RunStatus.STOPPED, f"{cmd.name} command done")


def _execute(handlers: Handlers, action: Action,
             world_size: int) -> tuple[int, Sequence[SavedShard], Sequence[FileInfo]]:
    """Carry out one command; returns the clean code (else 0) and, for a
    save, the shards (their kind and files) and own-part files written."""
    match action:
        case Clean(uce=uce):
            return handlers.clean(uce), (), ()
        case Rebuild(generation=generation, excluded=excluded, join_store=join_store):
            handlers.rebuild(generation, [r for r in range(world_size) if r not in set(excluded)], join_store)
        case Repair(step=step, transfers=transfers):
            handlers.repair(step, list(transfers))
        case Rollback(step=step):
            handlers.rollback(step)
        case Save(step=step, kinds=kinds, carry=carry):
            shards = [SavedShard(kind=kind, copies=(), full=False, rank=0, files=tuple(handlers.save(step, kind)))
                      for kind in kinds]
            return 0, shards, handlers.save_own(step, list(carry))
        case Finalize(step=step, shards=shards, history_json=history_json, own=own):
            history = json.loads(history_json) if history_json else {}
            # Handlers of a framework with no own parts may not take them.
            handlers.finalize(step, list(shards), history, **({"own": list(own)} if own else {}))
        case _:
            raise ValueError(f"unknown command {action!r}")
    return 0, (), ()
