"""A server that lives on its own asyncio event-loop thread.

The controller and the node relay are both gRPC servers that must keep
answering while the process they live in (a launcher, an agent) blocks on
other work. :class:`LoopThread` starts a thread, runs the subclass's
``_serve(ready)`` coroutine on a fresh loop until ``ready`` carries the bound
port, and offers thread-safe calls into the loop and an orderly stop.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Awaitable, Callable

from .api import TrainguardError

__all__ = ["LoopThread"]


class LoopThread:
    """Base class; subclasses implement ``_serve`` and ``_shutdown``."""

    thread_name = "trainguard-loop"

    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    async def _serve(self, ready: Future) -> None:
        """Bind, ``ready.set_result(port)``, then serve until shut down."""
        raise NotImplementedError

    async def _shutdown(self, grace_s: float) -> None:
        """Stop serving; ``_serve`` must return afterwards."""
        raise NotImplementedError

    def _start_loop(self, timeout_s: float) -> int:
        ready: Future = Future()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=self.thread_name, daemon=True)
        self._thread.start()
        return ready.result(timeout=timeout_s)

    def _run(self, ready: Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(ready))
        except BaseException as e:  # surfaced through `ready` when it happens at start-up
            if not ready.done():
                ready.set_exception(e)
        finally:
            self._loop.close()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the loop's thread and return its result."""
        if self._loop is None or not self._loop.is_running():
            raise TrainguardError(f"{self.thread_name} is not running")

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving and join the thread (idempotent)."""
        if self._loop is None or self._thread is None:
            return
        if self._loop.is_running():
            coro: Awaitable = self._shutdown(grace_s)
            try:
                asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=grace_s + 10)
            except Exception:  # the loop ends either way below
                pass
        self._thread.join(timeout=grace_s + 10)
        self._thread = None
