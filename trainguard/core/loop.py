"""Servers that live on the process's one asyncio event-loop thread.

The controller and the node relay are both gRPC servers that must keep
answering while the process they live in (a launcher, an agent) blocks on
other work. They share one loop, on a daemon thread started at first use
and never closed: gRPC's aio completion queue delivers every completion
through the first loop it saw, and hands one that belongs to another loop
over to it -- a loop closed by then answers with an "Event loop is closed"
traceback on stderr (at every clean exit, when each server had its own).
:class:`LoopThread` runs the subclass's ``_serve(ready)`` coroutine on that
loop until ``ready`` carries the bound port, and offers thread-safe calls
into the loop and an orderly stop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Awaitable, Callable

from .api import TrainguardError

__all__ = ["LoopThread", "live_servers", "shared_loop"]

_lock = threading.Lock()
_shared: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None
_live: "weakref.WeakSet[LoopThread]" = weakref.WeakSet()  # started and not stopped yet


def shared_loop() -> asyncio.AbstractEventLoop:
    """The process's loop for trainguard's servers (a fresh one in a forked
    child, whose copy of the thread does not run)."""
    global _shared
    with _lock:
        if _shared is None or not _shared[1].is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="trainguard-loop", daemon=True)
            thread.start()
            _shared = (loop, thread)
        return _shared[0]


def live_servers() -> list[LoopThread]:
    """The servers on the shared loop that were started and not stopped."""
    return [server for server in list(_live) if server._running]


class LoopThread:
    """Base class; subclasses implement ``_serve`` and ``_shutdown``."""

    thread_name = "trainguard-loop"  # what the messages call this server

    _loop: asyncio.AbstractEventLoop | None = None
    _served: concurrent.futures.Future | None = None  # ``_serve``'s, done when it returned

    async def _serve(self, ready: Future) -> None:
        """Bind, ``ready.set_result(port)``, then serve until shut down."""
        raise NotImplementedError

    async def _shutdown(self, grace_s: float) -> None:
        """Stop serving; ``_serve`` must return (or be cancelled) afterwards."""
        raise NotImplementedError

    def _start_loop(self, timeout_s: float) -> int:
        ready: Future = Future()
        self._loop = shared_loop()
        self._served = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        self._served.add_done_callback(lambda served: ready.done() or ready.set_exception(_ended(served, self)))
        _live.add(self)
        return ready.result(timeout=timeout_s)

    @property
    def _running(self) -> bool:
        return self._served is not None and not self._served.done()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the loop's thread and return its result."""
        if not self._running:
            raise TrainguardError(f"{self.thread_name} is not running")

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving and wait until ``_serve`` ended (idempotent)."""
        if self._served is None:
            return
        if self._running:
            coro: Awaitable = self._shutdown(grace_s)
            try:
                asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=grace_s + 10)
            except Exception:  # _serve is cancelled below either way
                pass
        self._served.cancel()  # a server that serves until cancelled (the controller's ticks)
        concurrent.futures.wait([self._served], timeout=grace_s + 10)
        self._served = None
        _live.discard(self)


def _ended(served: concurrent.futures.Future, server: LoopThread) -> BaseException:
    """Why ``_serve`` ended before it was ready."""
    if served.cancelled():
        return TrainguardError(f"{server.thread_name} was stopped before it served")
    return served.exception() or TrainguardError(f"{server.thread_name} ended before it served")
