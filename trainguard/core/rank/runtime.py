"""The rank runtime: one training loop under trainguard, written once for
every framework.

:class:`RankRuntime` is the base of each adapter's ``Guard``. It holds what
a rank does the same way whatever the framework: the loop the user writes
(``steps``, ``protect``, ``section``, the data-loading markers), the
connection to the job's controller, the end of a step once the update is in
(rehearsal fingerprints, compile cache, injected faults, periodic saves and
snapshots, profiling), the way out of a failed step (carry out the
controller's recovery, or leave with its exit code), the rollback's step
counter, the load at start (:mod:`.resume`: from this node's snapshots or
from storage), the snapshots' report and end, the report and the goodbye.

What differs by framework -- how a step begins and commits, how a failed
step releases its peers, the state's hash and fingerprints, how the process
ends -- is what an adapter supplies: the abstract methods and the
attributes listed in :mod:`.contract`.
"""

from __future__ import annotations

import abc
import logging
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Iterable, Iterator

from ..api import ConfigError, ControllerLostError, DataStatus, ForceStop
from ..config import ProcessorConfig
from .processor import Processor
from ..snapshot.shared import with_holders
from .recovery import Outcome, recover
from .history import JobHistory, Protected
from .reached import note, notes, redone
from .resume import resume

__all__ = ["RankRuntime"]

log = logging.getLogger("trainguard.rank")


class RankRuntime(JobHistory, abc.ABC):
    """The loop and the way out of a failed step, shared by every adapter's
    Guard; see :mod:`.contract` for what a subclass sets and supplies."""

    #: Whether a stop the controller asks for is taken at the top of the
    #: next step (torch), or voted on inside the next update (MindSpore,
    #: whose replicas must all leave the same step).
    stops_at_step_boundary = True
    #: How to launch the job so that it reaches a controller, for the
    #: warning given without one.
    launch_hint = "launch with `trainguard run`"
    #: Whether a step has begun and not yet ended or failed (:meth:`begin_step`).
    _in_step = False

    # ------------------------------------------------------ what a framework supplies
    @abc.abstractmethod
    def _begin(self) -> None:
        """A step's body starts (``with guard.protect():``)."""

    @abc.abstractmethod
    def _commit(self) -> None:
        """The body ended cleanly: finish the update, count the step, then
        :meth:`_after_commit`. Raises when the step cannot be committed."""

    @abc.abstractmethod
    def _handle(self, error: BaseException) -> None:
        """The body (or its commit) raised ``error``: report it, release
        the peers where the framework needs it, then :meth:`_recover`."""

    @abc.abstractmethod
    def _reset_step(self) -> None:
        """Forget the step in flight (a rollback)."""

    @abc.abstractmethod
    def _state_sha256(self) -> str:
        """A hash of the trained state, equal on every replica."""

    @abc.abstractmethod
    def _connect_details(self) -> dict:
        """What the controller is told of this rank's device:
        ``device``, ``device_repairable`` (and ``restart_count``)."""

    @abc.abstractmethod
    def _gather_steps(self, steps: list[int]) -> list[list[int]]:
        """Every rank's ``steps`` (a collective of :meth:`_load`)."""

    @abc.abstractmethod
    def _gather_outcomes(self, code: int) -> list[int]:
        """Every rank's outcome ``code`` (a collective of :meth:`_load`)."""

    @abc.abstractmethod
    def _load_memory(self, step: int, slot, source: str, found, holder) -> None:
        """Load ``step`` from ``slot``, a sealed snapshot in ``source``;
        ``holder``: the slot of the replica's snapshot that holds this
        rank's state where ``slot`` only names it (``snapshot_shared``),
        else ``None``; ``found``: the newest sound checkpoint on storage
        (one of the same step knows a newer history). Raises
        ``CheckpointError`` when the snapshot is unusable."""

    @abc.abstractmethod
    def _load_stored(self, found) -> int:
        """Load ``found``, a verified checkpoint on storage, and return its
        step. Raises ``CheckpointError`` when one of its files does not load."""

    def _fingerprints(self) -> dict:
        """What a rehearsal compares after each step (default: the state's hash)."""
        return {"model": self._state_sha256()}

    def _loop_ran(self, frame) -> None:
        """The first step of this process ended; ``frame`` is the training
        loop's (an adapter may look at what it iterates)."""

    def _final_extras(self) -> dict:
        """What a rehearsal's final record adds to the report."""
        return {"data_given": False}

    def _report_extras(self) -> dict:
        """What this framework adds to :meth:`report`."""
        return {}

    def _snapshot_after_step(self) -> None:
        """The snapshot of a step on a ``snapshot_every`` boundary."""
        self.take_snapshot(self._step)

    def _detach(self) -> None:
        """Undo what the Guard hooked into the framework's objects."""

    def _close_snapshots(self, finished: bool) -> None:
        """End the snapshots; a finished job waits for its last persists."""
        self.close_snapshots(wait_s=self.save_timeout_s if finished else 0.0)

    def _exit(self, code: int) -> None:
        """End the process with ``code`` after the controller's exit command."""
        raise SystemExit(code)

    @property
    def save_timeout_s(self) -> float:
        """How long a save (and the last persists at the end) may take."""
        return self.settings.save_timeout_s

    # ------------------------------------------------------ snapshots and the start
    def close_snapshots(self, wait_s: float) -> None:
        """End the snapshots, waiting up to ``wait_s`` for persists still running."""
        if self.snapshots is not None:
            self.snapshots.shutdown(wait_s)

    def snapshot_report(self) -> dict:
        """The report's ``snapshots`` (nothing without them)."""
        if self.snapshots is None:
            return {}
        return {"snapshots": {**self.snapshots.report(self.resumed_from),
                              **self.sharing.report(self.snapshot_holder())}}

    def _load(self) -> int:
        """Load the newest step every rank can load -- from this node's
        memory where a sealed snapshot holds it, else the newest complete
        checkpoint on storage -- and return it (nothing to load: the
        ``start_step`` the script gave, else 0)."""
        floor = getattr(self, "start_step", 0)  # the script loaded this step itself: older copies are not used
        memory = self.snapshots.available(verify=False) if self.snapshots is not None else {}
        memory = {step: slot for step, slot in memory.items() if step >= floor}
        holders: dict = {}  # step -> the holder's slot, for a snapshot that only names it
        if memory and self.sharing.enabled:
            memory, holders = with_holders(memory, self.snapshots.replica_slots)
        found: list = [None]  # the newest sound checkpoint (a dying gasp's history is newer)

        def newest(dropped: set[int]):
            found[0] = self.store.latest(exclude=dropped) if self.store is not None else None
            if found[0] is not None and found[0].step < floor:
                log.warning("rank %d: the newest checkpoint, step %d, is older than the start_step %d the script "
                            "gave: the script's state is kept", self.rank, found[0].step, floor)
                found[0] = None
            return found[0]
        try:
            step = resume(memory, newest, gather=self._gather_steps, outcomes=self._gather_outcomes, rank=self.rank,
                          load_memory=lambda step, slot, source: self._load_memory(
                              step, slot, source, found[0], holders.get(step)),
                          load_stored=self._load_stored,
                          before=lambda step: self.injector.strike("resume", step)) or floor
        finally:  # a read closes its slots; these were not all read
            for slot in holders.values():
                slot.close()
        if self.rehearsal is not None:
            self.rehearsal.started(step)
        record = redone(self.store.root, step, say=self.rank == 0) if self.store is not None else None
        if record is not None:  # the last launch got further and left no checkpoint of it
            self.records.append(record)
        return step

    # ------------------------------------------------------------- the controller
    def _connect(self, *, joining: bool = False) -> Processor:
        config = ProcessorConfig.from_env(rank=self.rank, world_size=self.world_size)
        if config is None:
            if joining:
                raise ConfigError("a replacement process (TRAINGUARD_JOIN set) needs the controller's address")
            if self.rank == 0:
                log.warning("no trainguard controller in this job (TRAINGUARD_CONTROLLER unset): checkpoints "
                            "work, but faults will not be recovered; %s", self.launch_hint)
            processor = Processor(None, rank=self.rank)
            processor.step = self._step
            return processor
        processor = Processor(config)
        processor.connect(step=self._step, replicas=self.groups, joining=joining,
                          resumed_after_dump="" if joining else self.resumed_after_dump(self._step),
                          **self._connect_details())
        return processor

    def section(self, name: str) -> AbstractContextManager:
        """Mark a stretch that may take much longer than a step (evaluation,
        a save of your own) so neither hang check (watchdog, heartbeats) counts
        it; its limit is three times its longest run so far (600 s the first time)::

            with guard.section("evaluation"):
                evaluate(model)
        """
        return self.processor.watchdog.section(name)

    # ------------------------------------------------------------------ the loop
    @property
    def step(self) -> int:
        """Completed steps."""
        return self._step

    # The step API: a loop trainguard does not own (a framework's trainer,
    # an integration) calls these three; steps() and protect() are made of them.
    def begin_step(self) -> int:
        """Begin a step and return the completed steps (the step to run).

        A stop the controller asked for at a step boundary is carried out
        first (a recovery, after which training may go on at an earlier
        step: run the step this returns).

        Raises:
            SystemExit: the controller ended the job (a dying gasp was saved).
        """
        while self._at_boundary():
            pass
        self._begin()
        self._in_step = True
        return self._step

    def end_step(self) -> bool:
        """The step's body ended cleanly: commit it (count it, save or
        snapshot on the boundaries). Returns ``True`` when it was committed,
        ``False`` when the commit failed and the failure was recovered: run
        the step again (:attr:`step` completed steps, state rolled back)."""
        try:
            self._commit()
        except Exception as e:  # a skipped update, a collective of the commit, a periodic save
            self.fail_step(e)
            return False
        self._in_step = False
        return True

    def fail_step(self, error: BaseException) -> None:
        """Hand the Guard the error that left the step: it reports it and
        carries out the controller's recovery. Returns when training goes
        on (retry): the state is rolled back to :attr:`step` completed
        steps; run that step again.

        Raises:
            error: it is no fault (``KeyboardInterrupt``, ``SystemExit``, a
                usage error), or no controller recovers it (launched
                without ``trainguard run``).
            SystemExit: the controller ended the job (a dying gasp was
                saved: relaunch to resume; or the job cannot go on).
        """
        self._in_step = False
        if not isinstance(error, Exception) or isinstance(error, ConfigError):
            raise error
        self._handle(error)

    def _at_boundary(self) -> bool:
        """Carry out a stop pending at a step boundary; whether there was one."""
        if not (self.stops_at_step_boundary and self.processor.stop_event.is_set()):
            return False
        self._in_step = False
        self._handle(ForceStop("stopped at a step boundary"))
        return True

    def steps(self, total: int) -> Iterator[int]:
        """Yield the number of completed steps until ``total`` are done."""
        first = True
        while self._step < total:
            if self._at_boundary():
                continue
            self._entered = False
            if self._markers is not None:
                self._markers.iteration_start()
            yield self._step
            if not self._entered:
                raise ConfigError("wrap the body of `for step in guard.steps(...)` in `with guard.protect():`")
            if first:
                first = False
                self._loop_ran(sys._getframe(1))  # the frame of the loop that drives this generator

    def protect(self) -> Protected:
        """Context manager around one step's body: a fault in it is
        recovered, not raised (see the adapter's module docstring);
        :meth:`begin_step`, then :meth:`end_step` or :meth:`fail_step`."""
        return Protected(self)

    def loader(self, iterable: Iterable) -> Iterator:
        """Iterate ``iterable`` (a DataLoader), timing each batch fetch as the
        DataLoader marker when profiling is on::

            batches = guard.loader(train_loader)
            for step in guard.steps(total):
                with guard.protect():
                    x, y = next(batches)
        """
        return self._markers.loader(iterable) if self._markers is not None else iter(iterable)

    def loading(self) -> AbstractContextManager:
        """Time a batch fetch made by a function of the step as the
        DataLoader marker (``with guard.loading(): x, y = batch(step)``)."""
        return self._markers.loading() if self._markers is not None else nullcontext()

    def _after_commit(self) -> None:
        """The end of a committed step: rehearsal, compile cache, injected
        faults, a periodic save or snapshot, profiling."""
        if self.rehearsal is not None:
            self.rehearsal.step(self._step, self._fingerprints())
        self.compile_cache.after_step()
        self.injector.after_step(self._step, time.perf_counter() - self._step_started)
        if self.save_every and self._step % self.save_every == 0:
            with self._markers.save() if self._markers is not None else nullcontext():
                self.save()
        elif self.snapshot_every and self._step % self.snapshot_every == 0:
            self._snapshot_after_step()
        if self._markers is not None:
            self._markers.step_end()

    # ------------------------------------------------------------ leaving a step
    def _recover(self, error: BaseException) -> None:
        """Carry out the controller's recovery of the step ``error`` left;
        without a controller, ``error`` is raised."""
        try:
            outcome = recover(self.processor, self._handlers, injector=self.injector)
        except ControllerLostError as lost:
            raise error from lost
        if not outcome.resume:
            self._leave(outcome)

    def _leave(self, outcome: Outcome) -> None:
        """The controller said exit: say so, close, and leave with its code."""
        log.info("rank %d exits with code %d: %s", self.rank, outcome.exit_code, outcome.reason)
        if self.store is not None and notes(self.rank, self.world_size):
            note(self.store.root, self.rank, self._step, outcome.reason)  # a relaunch from older state counts it
        self.close(finished=False)
        self._exit(outcome.exit_code)

    def rolled_back(self, step: int) -> None:
        """Called by the rollback handler: training continues at ``step``."""
        self._step = step
        self._reset_step()
        self.processor.step = step
        if self.processor.data is not DataStatus.UPDATED:
            self.processor.end_update(step)
        self.state.commit(step)

    # --------------------------------------------------------------- the end
    def report(self) -> dict:
        """What happened so far: steps, lost steps, PIDs per rank, recoveries,
        and a hash of the trained state (equal on every replica)."""
        return {
            "steps_completed": self._step,
            **self.history_report(),
            "final_state_sha256": self._state_sha256(),
            **self._report_extras(),
            **self.snapshot_report(),
            **({"profiling": self.recorder.report()} if self.recorder else {}),
            "compile_cache": self.compile_cache.report(),
        }

    def close(self, *, finished: bool = True) -> None:
        """Say goodbye to the controller and remove trainguard's hooks."""
        if self.rehearsal is not None:
            if finished:
                self.rehearsal.final({**self.report(), **self._final_extras()})
            self.rehearsal.close()
            self.rehearsal = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._detach()
        if self._markers is not None:
            self._markers.close()
            self._markers = None
        self.processor.watchdog.disarm()  # waiting for the last persists is not a hung step
        self._close_snapshots(finished)
        self.processor.close(finished=finished)
        self.compile_cache.close()

