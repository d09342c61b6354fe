"""Frozen workers: a process found stopped (state ``T`` in ``/proc``) on two
checks :data:`STOPPED_CONFIRM_S` apart is hung, as a stuck host or frozen
container leaves it. Used by both node agents (torchrun's and msrun's); no
framework imports."""

from __future__ import annotations

import time

__all__ = ["STOPPED_CONFIRM_S", "FrozenWatch", "process_state"]

STOPPED_CONFIRM_S = 0.3


def process_state(pid: int) -> str:
    """The one-letter state of a process (``R``, ``S``, ``T``...; ``""`` if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


class FrozenWatch:
    """Remembers since when each worker was seen stopped, and when each was
    last seen running (for the report's detection time)."""

    def __init__(self) -> None:
        self._stopped_since: dict[int, float] = {}
        self.running_at: dict[int, float] = {}  # pid -> unix time of the last check that found it running
        self.last_poll = 0.0  # unix time of the previous monitoring pass

    def stopped(self, pid: int) -> str:
        """Why the worker counts as hung (found stopped twice), else ``""``."""
        if process_state(pid) != "T":  # not "t": a debugger or py-spy attached for a moment
            self._stopped_since.pop(pid, None)
            return ""
        now = time.monotonic()
        if pid not in self._stopped_since:
            self.running_at[pid] = self.last_poll  # the last check that found it running
        since = self._stopped_since.setdefault(pid, now)
        return f"found stopped (state T) for {now - since:.1f} s; killed by its agent" \
            if now - since >= STOPPED_CONFIRM_S else ""
