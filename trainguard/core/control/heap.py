"""A large job's controller heap: collected once after registration, then frozen.

The controller of a 16k-rank job holds a few hundred thousand objects that
live as long as the job (its ranks, their sessions and groups). Python's
full (generation-2) collection walks every one of them -- about a quarter
of a second at 16384 ranks on a 2-core machine -- and when it runs is
chance: inside a fault's stop fan-out it holds back every stop by as much
(``bench/scale.py``: a fault to every rank stopped 0.46-0.78 s where it was
0.27-0.31 s when none landed there).

So once every rank registered and the registration has settled, the
controller collects once, while nothing waits on it, and freezes what is
left (:func:`gc.freeze`): later full collections walk only the objects made
since. Freezing is process-wide and only cycles among frozen objects are
kept longer (reference counting frees everything else as before); the
controller unfreezes when it stops. Jobs under :data:`LARGE` ranks are left
alone: their collections take milliseconds.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable

from ..api import ControllerState

__all__ = ["LARGE", "Heap"]

log = logging.getLogger("trainguard.controller")

LARGE = 1024  # ranks from which the heap is settled
SETTLE_S = 1.0  # after the last rank registered: its Welcome is out, nothing waits


class Heap:
    def __init__(self, world_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled, self.clock = world_size >= LARGE, clock
        self.frozen = False
        self._registered_at: float | None = None

    def tick(self, state: ControllerState) -> None:
        """Call every tick: collects and freezes once, ``SETTLE_S`` after the state first left INIT."""
        if not self.enabled or self.frozen or state is ControllerState.INIT:
            return
        now = self.clock()
        if self._registered_at is None:
            self._registered_at = now
        elif now - self._registered_at >= SETTLE_S:
            t = time.perf_counter()
            gc.collect()
            gc.freeze()
            self.frozen = True
            log.debug("controller heap settled: %d objects frozen in %.3f s", gc.get_freeze_count(),
                      time.perf_counter() - t)

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
