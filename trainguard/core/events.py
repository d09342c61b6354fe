"""The run directory's event log: what a job did, one JSON object a line.

``trainguard run --run-dir DIR`` (or ``TRAINGUARD_RUN_DIR=DIR``, which the
flag sets and the workers inherit) makes the job append to
``DIR/events.jsonl``; ``trainguard report DIR`` draws it. Each line is
``{"t": unix seconds, "ev": name, ...}``. Who writes what:

* the launcher: ``launch`` (its command) and ``exit`` (its exit code);
* the controller (:class:`~trainguard.core.control.controller.ControllerCore`):
  ``controller`` (a controller started: job id, world size, strategies),
  ``rank`` (registered), ``steps`` (every rank's step from its heartbeats
  and the ranks lost, when they changed: at most twice a heartbeat interval
  -- less often above 256 ranks -- and at every state change), ``state``, ``fault``, ``decision``, ``phase``,
  ``fallback``, ``recovery`` (the recovery record, as in the job's report)
  and ``finished`` (a rank said goodbye);
* the rank that finalises a checkpoint: ``checkpoint`` (its step and path);
* rank 0: ``snapshot`` (an in-memory snapshot taken, its step).

Writing never disturbs training: each line is one ``write`` to a file
opened for appending (lines from several processes do not interleave on a
local file system), and a failing write is logged once and then skipped.
The directory is made 0700 and the file 0600 (argv, the job id and pids
are no one else's business); a directory of another user, or one others
may rename entries in, is refused, and the file is opened without following
a link and only when it is a regular file of this user
(:mod:`.private`). Only the standard library: the controller and every
adapter import this.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from .api import ConfigError
from .private import make_directory, open_append

__all__ = ["ENV_VAR", "EVENTS", "EventLog", "note"]

ENV_VAR = "TRAINGUARD_RUN_DIR"
EVENTS = "events.jsonl"
#: Longest string field kept (a fault's message, a decision's reason).
MAX_TEXT = 600

log = logging.getLogger("trainguard.events")


class EventLog:
    """Appends events to ``<directory>/events.jsonl`` (the directory is
    made when missing)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / EVENTS
        self._failed = False
        self._checked = False

    @classmethod
    def from_env(cls) -> "EventLog | None":
        """The log of ``TRAINGUARD_RUN_DIR``, or ``None`` when it is not set."""
        value = os.environ.get(ENV_VAR, "").strip()
        return cls(value) if value else None

    def write(self, ev: str, t: float | None = None, **fields: Any) -> None:
        if self._failed:
            return
        record = {"t": round(time.time() if t is None else t, 3), "ev": ev}
        for key, value in fields.items():
            record[key] = value[:MAX_TEXT] if isinstance(value, str) else value
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        try:
            if not self._checked:
                make_directory(self.directory, "run directory")
                self._checked = True
            fd = open_append(self.directory, EVENTS)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except (OSError, ConfigError) as e:
            self._failed = True
            log.warning("cannot write the run's events to %s (%s); no more are recorded", self.path, e)


_process_log: EventLog | None = None
_process_dir: str | None = None


def note(ev: str, **fields: Any) -> None:
    """Append an event to this process's run directory, if the job has one
    (``TRAINGUARD_RUN_DIR``); nothing otherwise."""
    global _process_log, _process_dir
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return
    if value != _process_dir:
        _process_log, _process_dir = EventLog(value), value
    _process_log.write(ev, **fields)
