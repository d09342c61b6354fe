"""The trainer's side of the persist worker (:mod:`.persist`).

:class:`PersistWorker` starts the worker process (again, after it died),
sends requests to it as JSON lines on its stdin and collects the replies
on a thread of its own, so the training loop never waits on the worker;
a request the worker died on is answered as failed.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

from .. import forks

__all__ = ["PersistWorker"]


class PersistWorker:
    """The trainer's side: starts the worker (again, after it died), sends
    requests and collects replies without blocking."""

    def __init__(self, env: dict | None = None) -> None:
        self._env = env
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._next = 0
        self.pending: dict[int, dict] = {}
        self.restarts = 0
        self._lock = threading.Lock()  # the ring's copy thread asks for seals

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                self.restarts += 1
                self._forget(self._proc)
            self._proc = subprocess.Popen([sys.executable, "-c", "from trainguard.core.snapshot.persist import main; "
                                                           "main()"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          env={**os.environ, **(self._env or {}),
                                               "TRAINGUARD_PERSIST_PARENT": str(os.getpid())},
                                          start_new_session=False)
            proc = self._proc
            # A forked child (a DataLoader worker) holding the request pipe's
            # write end would keep the worker from ever seeing its end.
            forks.keep_from_children(proc.stdin.fileno())
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        return self._proc

    @staticmethod
    def _forget(proc: subprocess.Popen) -> None:
        """Close our end of a worker's request pipe (forgotten by forked
        children first: its number is reused once closed)."""
        if proc.stdin.closed:
            return
        forks.release(proc.stdin.fileno())
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the worker is gone: nothing was waiting for the end of its input

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._replies.put(json.loads(line))
        code = proc.wait()
        self._replies.put({"died": proc.pid, "code": code})

    def submit(self, op: str, **fields: Any) -> int:
        """Send a request (from any thread); its id."""
        with self._lock:
            self._next += 1
            req = {"id": self._next, "op": op, **fields}
            proc = self._ensure()
            try:
                proc.stdin.write(json.dumps(req) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:
                self._forget(proc)  # died between the check and the write: start another
                self._proc = None
                proc = self._ensure()
                proc.stdin.write(json.dumps(req) + "\n")
                proc.stdin.flush()
            self.pending[self._next] = req
            return self._next

    def poll(self, timeout: float | None = None) -> list[dict]:
        """Replies that arrived (waiting up to ``timeout`` for the first).
        A request the worker died on is answered ``ok: False``."""
        out = []
        block = timeout is not None
        while True:
            try:
                reply = self._replies.get(block, timeout) if block else self._replies.get_nowait()
            except queue.Empty:
                return out
            block = False
            if "died" in reply:
                with self._lock:
                    if self._proc is not None and self._proc.pid == reply["died"]:
                        for rid, req in sorted(self.pending.items()):
                            out.append({"id": rid, "op": req["op"], "step": req.get("step"), "ok": False,
                                        "error": f"persist worker {reply['died']} died (exit {reply['code']})"})
                        self.pending.clear()
                continue
            if self.pending.pop(reply["id"], None) is not None:
                out.append(reply)

    def wait(self, timeout: float) -> list[dict]:
        """Replies until nothing is pending (or ``timeout`` passed)."""
        out, deadline = [], time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            out += self.poll(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        return out

    def close(self, *, wait: bool = True) -> None:
        """Let the worker finish what it was asked and exit; with ``wait``,
        wait for that (up to a minute), else leave it to finish alone (a
        process about to exit after a dying gasp)."""
        if self._proc is not None:
            self._forget(self._proc)
            if wait:
                try:
                    self._proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
            self._proc = None
