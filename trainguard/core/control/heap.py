"""A large job's controller heap: frozen once every rank registered.

The controller of a 16k-rank job holds a few hundred thousand objects that
live as long as the job (its ranks, their sessions and groups). Python's
full (generation-2) collection walks every one of them -- about a quarter
of a second at 16384 ranks on a 2-core machine -- and when it runs is
chance: inside a fault's stop fan-out it holds back every stop by as much
(``bench/scale.py``: a fault to every rank stopped 0.46-0.78 s where it was
0.27-0.31 s when none landed there).

So once every rank registered the controller freezes its heap
(:func:`gc.freeze`, which moves the tracked objects to a permanent
generation and walks none of them: no pause): later full collections walk
only the objects made since. No collection is forced first (it would be the
very pause this avoids, and it held back Welcomes still being written), so
cyclic garbage left from the registration, and cycles among frozen objects
that die later, are freed only when the controller stops and unfreezes;
reference counting frees everything else as before. Freezing is
process-wide. Jobs under :data:`LARGE` ranks are left alone: their
collections take milliseconds.
"""

from __future__ import annotations

import gc
import logging

from ..api import ControllerState

__all__ = ["LARGE", "Heap"]

log = logging.getLogger("trainguard.controller")

LARGE = 1024  # ranks from which the heap is frozen


class Heap:
    def __init__(self, world_size: int) -> None:
        self.enabled = world_size >= LARGE
        self.frozen = False

    def tick(self, state: ControllerState) -> None:
        """Call every tick: freezes once, when the state first left INIT (every rank registered)."""
        if not self.enabled or self.frozen or state is ControllerState.INIT:
            return
        gc.freeze()
        self.frozen = True
        log.debug("controller heap frozen after registration: %d objects", gc.get_freeze_count())

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
