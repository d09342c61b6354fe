"""Watching workers, for both node agents (torchrun's and msrun's; no
framework imports): a process found stopped (state ``T`` in ``/proc``) on two
checks :data:`STOPPED_CONFIRM_S` apart is hung, as a stuck host or frozen
container leaves it; a worker's end is reported to the controller at once;
at the end, the controller an agent runs is stopped, its last status kept."""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["STOPPED_CONFIRM_S", "FrozenWatch", "process_state", "report_exit", "stop_controller"]

log = logging.getLogger("trainguard.launcher")

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


def report_exit(controller: Any, client: Any, rank: int, pid: int, code: int, reason: str = "",
                last_running: float = 0.0) -> None:
    """Log a worker's end and report it to the controller (in this process,
    else through ``client``: the node agent's relay, or a launcher's
    :class:`~trainguard.core.control.client.ControllerClient`)."""
    # the controller's one line tells the fault and what came of it
    log.info("worker rank %d (pid %d) %s%s", rank, pid, f"{reason}: " if reason else "",
                f"killed by signal {-code}" if code < 0 else f"exited with code {code}")
    try:
        if controller is not None:
            controller.report_process_exit(rank, pid, code, reason, last_running)
        elif client is not None:
            client.report_process_exit(rank, pid, code, reason, last_running)
    except Exception as e:  # the controller also notices through the broken session
        log.warning("could not report the exit of rank %d to the controller: %s", rank, e)


def stop_controller(controller: Any, last_status: dict | None, grace_s: float = 1.0) -> dict | None:
    """Stop the controller a node agent runs (``None``: none) and return its
    last status, or ``last_status`` when it has none to give. ``grace_s``:
    how long calls in flight may finish."""
    if controller is not None:
        try:
            last_status = controller.snapshot()
        except Exception as e:  # noqa: BLE001 - a controller that already stopped has nothing more to say
            log.debug("no last status from the controller: %s", e)
        controller.stop(grace_s)
    return last_status
