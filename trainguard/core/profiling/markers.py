"""The framework-free half of an adapter's markers: Step, DataLoader and
SaveCheckpoint spans, and applying the switch at step boundaries.

An adapter subclasses :class:`LoopMarkers` and implements :meth:`install`
(forward hooks, communication timing) for its framework. Every span is filed
under the loop index of the iteration it happens in, so a save or a
collective inside the commit still belongs to its step.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterable, Iterator

from .recorder import Recorder

__all__ = ["LoopMarkers"]


class LoopMarkers:
    """Markers for one training loop.

    Args:
        recorder: where spans go.
        step: returns the number of completed steps (the loop index).
    """

    def __init__(self, recorder: Recorder, step: Callable[[], int]) -> None:
        self.recorder = recorder
        self._step = step
        self.current = step()
        self.installed = (False, False)  # (markers, communication) as hooks stand now
        self._iter_start = 0.0
        self._fp_start = 0.0

    def install(self, markers: bool, communication: bool) -> None:
        """Add or remove the framework's hooks to match the switch."""
        self.installed = (markers, communication)

    def iteration_start(self) -> None:
        """The top of a loop iteration (before the body fetches its batch):
        apply a switch change, start the Step span."""
        rec = self.recorder
        wanted = (rec.markers, rec.communication)
        if wanted != self.installed:
            self.install(*wanted)
        self.current = self._step()
        self._iter_start = time.time() if rec.markers else 0.0

    def step_started(self) -> None:
        """Where a loop has no iteration top of ours (a framework callback
        runs the step): start the span here unless it already runs."""
        if not self._iter_start:
            self.iteration_start()

    def step_end(self) -> None:
        """After the iteration's step committed."""
        if self._iter_start and self.recorder.markers:
            self.recorder.add("Step", self.current, self._iter_start, time.time() - self._iter_start)
        self._iter_start = 0.0

    def fp_begin(self, *_: object) -> None:
        """A forward pre-hook (any framework's: the arguments are ignored)."""
        self._fp_start = time.time()

    def fp_end(self, *_: object) -> None:
        """The matching forward hook: one FP record."""
        if self._fp_start:
            self.recorder.add("FP", self.current, self._fp_start, time.time() - self._fp_start)
            self._fp_start = 0.0

    def save(self) -> AbstractContextManager:
        """Time a checkpoint save."""
        if not self.recorder.markers:
            return nullcontext()
        return self.recorder.span("SaveCheckpoint", self.current)

    def loading(self) -> AbstractContextManager:
        """Time a batch fetch that is not an iteration (a function of the step)."""
        if not self.recorder.markers:
            return nullcontext()
        return self.recorder.span("DataLoader", self.current)

    def loader(self, iterable: Iterable) -> Iterator:
        """Yield from ``iterable``, timing each fetch as DataLoader."""
        it = iter(iterable)
        rec = self.recorder
        while True:
            start = time.time()
            try:
                item = next(it)
            except StopIteration:
                return
            if rec.markers:
                rec.add("DataLoader", self.current, start, time.time() - start)
            yield item

    def close(self) -> None:
        """Remove every hook and write what is buffered."""
        self.install(False, False)
        self.recorder.close()
