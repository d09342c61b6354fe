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
* **Descriptors.** A child keeps its copy of every descriptor. The write
  end of the persist worker's request pipe: the worker then saw no end of
  input when the trainer closed its end, and ``Guard.close()`` waited a
  minute for it. The processor's connection to its node's relay: when the
  rank's process died, its loader workers (alive until they notice, up to
  5 s) kept the connection open, and the replacement started in place was
  refused ("rank 1 is already connected to this node's relay").
  :func:`keep_from_children` names descriptors, and
  :func:`keep_peer_from_children` the ``host:port`` of connections, that
  each forked child points at ``/dev/null`` at once.

:func:`install` is called when :mod:`trainguard.core` is imported.
"""

from __future__ import annotations

import gc
import os
import socket
import stat
import threading

__all__ = ["install", "keep_from_children", "keep_peer_from_children", "release"]

_FDS: set[int] = set()
_PEERS: set[tuple[str, int]] = set()  # (address, port) of connections children must not hold
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


def keep_peer_from_children(address: str) -> None:
    """Forked children point their copies of connections to ``address``
    (``host:port``, as a client dials it) at ``/dev/null``."""
    host, _, port = address.rpartition(":")
    try:
        found = {(info[4][0], int(port)) for info in socket.getaddrinfo(host.strip("[]"), int(port),
                                                                       type=socket.SOCK_STREAM)}
    except (OSError, ValueError):
        return  # an address that does not resolve here is not one a socket of ours is connected to
    with _LOCK:
        _PEERS.update((_plain(a), p) for a, p in found)


def _plain(address: str) -> str:
    """An IPv4 address mapped into IPv6 (a dual-stack socket's peer) as IPv4."""
    return address.removeprefix("::ffff:")


def release(*fds: int) -> None:
    """Forget descriptors about to be closed (their numbers will be reused)."""
    with _LOCK:
        _FDS.difference_update(fds)


def _in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # only the forking thread exists here: the parent's may be held by one that is gone
    fds = list(_FDS)
    _FDS.clear()
    if _PEERS:
        fds += _connected_to(_PEERS)
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


def _connected_to(peers: set[tuple[str, int]]) -> list[int]:
    """This process's socket descriptors connected to one of ``peers``."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: nothing to look through
        return []
    out = []
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor), or not a socket Python knows
        try:
            peer = sock.getpeername()
        except OSError:
            peer = None  # not connected: a listening socket, say
        finally:
            sock.detach()  # the descriptor stays open; only the wrapper goes
        if isinstance(peer, tuple) and (_plain(peer[0]), peer[1]) in peers:
            out.append(fd)
    return out
