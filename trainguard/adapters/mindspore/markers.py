"""Profiling markers for the MindSpore Guard: FP and Communication on top of
the loop's Step, DataLoader and SaveCheckpoint spans
(:class:`~trainguard.core.profiling.markers.LoopMarkers`).

* **FP**: a forward pre-hook and hook on the network (PyNative; in graph
  mode the forward is inside the compiled step and only Step and
  SaveCheckpoint are recorded).
* **Communication**: the Guard's collectives (the health vote, the gradient
  all-reduce, start-up gathers) in the world group, timed on the host from
  the call until it returns. The vote returns once every replica voted, so
  a rank whose peers are late waits in it longer; the gradient all-reduce
  is queued asynchronously in PyNative mode and shows only its launch.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator

from trainguard.core.profiling import Recorder
from trainguard.core.profiling.markers import LoopMarkers

__all__ = ["MindSporeMarkers"]


class MindSporeMarkers(LoopMarkers):
    """Markers for one MindSpore Guard.

    Args:
        recorder: where spans go.
        network: the cell whose forward is FP (``None`` in graph mode).
        step: returns the number of completed steps (the loop index).
        group: the world group's name and its global ranks.
    """

    def __init__(self, recorder: Recorder, network: Any, step: Callable[[], int], group: str,
                 ranks: list[int]) -> None:
        super().__init__(recorder, step)
        self._network, self._group = network, group
        self._fp_hooks: list[Any] = []
        recorder.group(group, ranks, "mindspore")

    def install(self, markers: bool, communication: bool) -> None:
        if markers and not self._fp_hooks and self._network is not None:
            self._fp_hooks = [self._network.register_forward_pre_hook(self.fp_begin),
                              self._network.register_forward_hook(self.fp_end)]
        elif not markers and self._fp_hooks:
            for hook in self._fp_hooks:
                hook.remove()
            self._fp_hooks = []
        super().install(markers, communication)

    def collective(self, op: str, nbytes: int = 0) -> AbstractContextManager:
        """Time one of the Guard's collectives."""
        if not self.recorder.communication:
            return nullcontext()
        return self._timed(op, nbytes)

    @contextmanager
    def _timed(self, op: str, nbytes: int) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.recorder.add("Communication", self.current, start, time.time() - start,
                              {"op": op, "group": self._group, "bytes": nbytes})
