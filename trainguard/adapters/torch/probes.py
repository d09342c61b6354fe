"""What the watchdog asks about the training thread, from the processor's
thread (:class:`trainguard.core.rank.watchdog.ProgressWatchdog`'s
``in_collective`` and ``in_pause``): where its Python frames are now."""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

__all__ = ["ThreadProbes"]

#: The standard library (multiprocessing, threading...): not the script either.
_PYTHON_DIRS = (os.path.dirname(os.__file__),)

#: torch and this adapter: a thread whose innermost frame is here waits on them, not on the script.
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
#: Where torch's and torchdata's loaders live (torchdata's path as installed beside torch: no import here).
_LOADER_DIRS = (os.path.dirname(torch.utils.data.__file__),
                os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "torchdata") + os.sep)


class ThreadProbes:
    """Args: the training thread's ident; whether collectives are in flight
    on the groups it uses now (the data-parallel group, a device mesh's)."""

    def __init__(self, thread: int, busy: Callable[[], bool]) -> None:
        self._thread, self._busy = thread, busy

    def blocked_on_comm(self) -> bool:
        """Is the training thread waiting on communication? Collectives are
        in flight and its innermost Python frame is in torch or in our
        group's wait (``backward`` waiting for DDP's buckets, ``Work.wait``),
        not in the training script."""
        if not self._busy():
            return False
        frame = sys._current_frames().get(self._thread)
        return frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS)

    def where(self) -> str:
        """The training thread's innermost frame, and the script's innermost
        one when that is in a library ("" when the thread is gone)."""
        frame = sys._current_frames().get(self._thread)
        if frame is None:
            return ""
        here = _at(frame)
        while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS + _PYTHON_DIRS):
            frame = frame.f_back
        return here if frame is None or _at(frame) == here else f"{here}, from {_at(frame)}"

    def waiting_for_loader(self) -> str:
        """Is the training thread inside a DataLoader -- its worker
        processes starting (spawned ones import torch and the script, at
        every epoch without ``persistent_workers``) or a batch on its way?
        A benign pause, "" when not."""
        frame = sys._current_frames().get(self._thread)
        while frame is not None:
            if frame.f_code.co_filename.startswith(_LOADER_DIRS):
                return "waiting for a DataLoader"
            frame = frame.f_back
        return ""


def _at(frame) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
