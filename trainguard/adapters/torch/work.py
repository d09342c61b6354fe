"""The handle of a collective an :class:`~.process_group.AbortableProcessGroup`
issued: the caller waits on a future trainguard completes -- with the
result when the backend finishes, or with
:class:`~trainguard.core.ForceStop` when the group is stopped -- never on
the backend call itself (an aborted gloo call is not released)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard.core import ForceStop

__all__ = ["Work"]


class Work(dist._Work):
    """A collective's handle whose future trainguard completes."""

    def __init__(self, group: Any, inner: Any, result: Any) -> None:  # its AbortableProcessGroup
        super().__init__()
        self._group = group
        self._result = result
        self._future: torch.futures.Future = torch.futures.Future()
        self._lock = threading.Lock()
        self._inner: Any = None  # the backend's future, or its work when it has none
        if inner is None:
            return
        group._pending.add(self)
        if group.halted:
            # stop() ran between the caller's check and the add above: it set
            # the flag before sweeping _pending, so one of the two catches us.
            self.finish(error=ForceStop("the process group was stopped"))
            return
        try:
            future = self._inner = inner.get_future()
        except RuntimeError:  # gloo's send/recv work has no future: wait on a helper thread
            self._inner = inner
            threading.Thread(target=self._wait_inner, args=(inner,), daemon=True,
                             name="trainguard-p2p-wait").start()
        else:
            future.then(self._wait_inner)

    def _wait_inner(self, inner: Any) -> None:
        """Wait for the backend's future or work (done, as a future's
        callback), then finish with its outcome."""
        try:
            inner.wait()
        except Exception as e:  # the backend's own failure (peer gone, timeout)
            self.finish(error=e)
        else:
            self.finish()

    def release(self, reason: str) -> None:
        """Fail the collective with :class:`ForceStop`, unless the backend
        already completed it: its callback may still wait for the GIL (a
        STOP's thread can hold it just then), and a peer that saw the same
        collective complete has gone on with its result -- a rank stopped
        here would stay a step behind it."""
        inner = self._inner
        future = isinstance(inner, torch._C.Future)  # else gloo's send/recv work itself
        if inner is None or not (inner.done() if future else inner.is_completed()):
            self.finish(error=ForceStop(reason))
        else:
            self._wait_inner(inner)

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._future.done():
                return
            self._group._pending.discard(self)
            # The backend's work is not needed past here, and it holds the backend's connections: kept from
            # this handle (a handle a framework still holds: FSDP's reduce-scatter in an abandoned backward
            # pass, the frames of its error), a retired backend stays open, and its peers' retiring threads
            # wait on it into the interpreter's exit ("terminate called without an active exception").
            self._inner = None
            if error is None:
                self._future.set_result(self._result)
            else:
                self._future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._future.wait()  # raises the stored exception, if any
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()
