"""One TensorFlow worker as its launcher sees it: the process, its progress
pipe and a hang watchdog fed from that pipe (no framework imports).

:meth:`TFWorker.fault` says why the worker makes the job fail, or ``""``:
an exit other than 0 (a signal included), the process found stopped
(state ``T``, as :class:`~.watch.FrozenWatch` checks for torch's and
msrun's agents), or no step for longer than the limit the core's
:class:`~trainguard.core.rank.watchdog.ProgressWatchdog` learns from the
steps this worker reported. The watchdog runs here, in the launcher, on
the heartbeats the worker sends at each step: a worker that hangs in
Python, in a collective or in the kernel looks the same from here, and
a checkpoint save gets a section's limit.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from contextlib import AbstractContextManager
from typing import Callable

from trainguard.core import EXIT_UNRECOVERABLE
from trainguard.core.config import WatchdogConfig
from trainguard.core.rank.watchdog import ProgressWatchdog
from trainguard.core.step_pipe import StepReader

from .watch import FrozenWatch

__all__ = ["TFWorker", "hang_config"]

#: A job-level restart costs every worker's start and a checkpoint load, so
#: a step is hung only after 10 s at least (the in-process watchdogs of
#: torch and MindSpore default to 2 s), unless TRAINGUARD_HANG_MIN_S says.
TF_HANG_MIN_S = 10.0


def hang_config(config: WatchdogConfig, environ: dict) -> WatchdogConfig:
    """The launcher's watchdog settings: ``config`` (read from the
    environment) with :data:`TF_HANG_MIN_S` unless the user set the floor."""
    if environ.get("TRAINGUARD_HANG_MIN_S"):
        return config
    return dataclasses.replace(config, min_limit_s=TF_HANG_MIN_S)


class TFWorker:
    """A running worker of one attempt.

    Args:
        index: its task index in ``TF_CONFIG``.
        proc: its process (started in a session of its own).
        reader: the launcher's end of its progress pipe.
        watchdog: its settings (the first step's limit runs from now).
        frozen: the attempt's stopped-process check.
        clock: monotonic seconds (injected for tests).
    """

    def __init__(self, index: int, proc: subprocess.Popen, reader: StepReader, watchdog: WatchdogConfig,
                 frozen: FrozenWatch, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.proc = proc
        self.reader = reader
        self.step = -1  # the last step it completed or resumed from (-1: none yet)
        self.resumed: int | None = None
        self.done = False  # it reported the end of training
        self._frozen = frozen
        self._watch = watchdog.enabled
        self.watchdog = ProgressWatchdog(watchdog, clock=clock, track_gc=False)
        self.watchdog.arm(first=True)
        self._save: AbstractContextManager | None = None

    def poll(self) -> None:
        """Take in what the worker reported since the last poll."""
        for event in self.reader.read():
            if event.kind == "step":
                self.step = event.step
                self.watchdog.step_done()
            elif event.kind == "resumed":
                self.step, self.resumed = event.step, event.step
                self.watchdog.arm(first=True)  # the first step after a load traces its functions again
            elif event.kind == "save" and self._save is None:
                self._save = self.watchdog.section("checkpoint save")
                self._save.__enter__()
            elif event.kind == "saved" and self._save is not None:
                self._save.__exit__(None, None, None)
                self._save = None
            elif event.kind == "done":
                self.step, self.done = event.step, True
                self.watchdog.disarm()

    @property
    def code(self) -> int | None:
        return self.proc.poll()

    def fault(self) -> str:
        """Why this worker fails the job now (``""``: it does not)."""
        code = self.proc.poll()
        where = f"worker {self.index} (pid {self.proc.pid})"
        at = f" after step {self.step}" if self.step >= 0 else " before its first step"
        if code is not None:
            if code == 0:
                return ""
            if self.done:  # training ended: an untidy exit loses nothing (the attempt logs it)
                return ""
            if code < 0:
                return f"{where} was killed by signal {-code}{at}"
            if code == EXIT_UNRECOVERABLE:
                return f"{where} refused to go on (exit {code}){at}: its log says why"
            return f"{where} exited with code {code}{at}"
        stopped = self._frozen.stopped(self.proc.pid)
        if stopped:
            return f"{where} hung{at}: {stopped}"
        alarm = self.watchdog.check() if self._watch and not self.done else None
        if alarm is not None:
            return f"{where} hung{at}: {alarm.describe().replace('; not in a collective', '')}"
        return ""

    def close(self) -> None:
        self.watchdog.close()
        self.reader.close()
