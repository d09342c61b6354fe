"""What a process forked from a training process must not inherit.

A ``DataLoader`` with ``num_workers > 0`` forks (Linux's default start
method) a process beside trainguard's threads. A forked child holds a copy
of the parent's memory and descriptors but none of its threads, so:

* **gRPC.** With gRPC's fork support on (its C core's default), every fork
  while the processor's threads are inside a call prints "Other threads are
  currently calling into gRPC, skipping fork() handlers", and the child is
  left with the polling engine's state of threads it does not have; should
  it run gRPC code (a channel or call finalized there), gRPC aborts it
  (``ev_epoll1_linux.cc ... Check failed``). trainguard's children are
  started with ``fork`` + ``exec`` (``subprocess``) and no forked child of a
  training process uses gRPC, so fork support is not needed:
  ``GRPC_ENABLE_FORK_SUPPORT`` defaults to ``false`` here, set before gRPC
  is imported (it reads it then; a value the user set is kept).
* **Garbage.** The cyclic garbage collector runs in the child too, on the
  parent's garbage: an unreachable gloo process group or gRPC channel is
  then destroyed there, and its destructor waits for threads that do not
  exist in the child (a ``ProcessGroupGloo`` hung a DataLoader worker in
  ``pthread_cond_destroy``) or calls into gRPC. Every object is frozen
  (``gc.freeze``) just before a fork and unfrozen in the parent right
  after, as Python's documentation advises for fork without exec: the child
  never collects what it inherited. Both calls move lists, not objects.
* **Pipes.** A child keeps its copy of every descriptor, the write end of
  the persist worker's request pipe included: the worker then sees no end
  of input when the trainer closes its end, and ``Guard.close()`` waited a
  minute for it. :func:`keep_from_children` names descriptors that each
  forked child points at ``/dev/null`` at once.

:func:`install` is called when :mod:`trainguard.core` is imported.
"""

from __future__ import annotations

import gc
import os
import threading

__all__ = ["install", "keep_from_children", "release"]

_FDS: set[int] = set()
_LOCK = threading.Lock()
_installed = False


def install() -> None:
    """Set gRPC's fork support off (unless set) and register the fork hooks (once)."""
    global _installed
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    if _installed or not hasattr(os, "register_at_fork"):
        return
    _installed = True
    os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze, after_in_child=_in_child)


def keep_from_children(*fds: int) -> None:
    """Forked children point these descriptors at ``/dev/null``."""
    with _LOCK:
        _FDS.update(fds)


def release(*fds: int) -> None:
    """Forget descriptors about to be closed (their numbers will be reused)."""
    with _LOCK:
        _FDS.difference_update(fds)


def _in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # only the forking thread exists here: the parent's may be held by one that is gone
    fds = list(_FDS)
    _FDS.clear()
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            try:
                os.dup2(null, fd)
            except OSError:
                pass  # closed meanwhile: nothing of ours left to hold
    finally:
        os.close(null)
