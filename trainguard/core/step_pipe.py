"""A worker's progress, told to its launcher over an inherited pipe.

``trainguard run --framework tensorflow`` restarts a whole job when one
worker dies or stops making progress. It learns of progress through one
pipe per worker: the launcher keeps the read end, the worker inherits the
write end (its number in ``TRAINGUARD_HEARTBEAT_FD``) and writes one short
line per event:

* ``resumed N`` -- the worker loaded the checkpoint of step N (0: a fresh start);
* ``step N``    -- step N completed (the heartbeat, once a step);
* ``save N`` / ``saved N`` -- a checkpoint save of step N opened and closed
  (the launcher's hang limit for a save is a section's, not a step's);
* ``done N``    -- training ended at step N (what follows, TensorFlow's own
  shutdown included, is not watched for progress).

A pipe needs no address, port or secret (only the worker holds the write
end) and costs one ``write`` a step. The write end is non-blocking: a full
pipe (a launcher that stopped reading) drops the line, and a launcher that
is gone (EPIPE) silences the worker's pipe; training itself never waits on
either. Lines are shorter than ``PIPE_BUF``, so each arrives whole.

Framework-free: the adapter writes, the launcher reads.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["ENV_FD", "KINDS", "StepEvent", "StepPipe", "StepReader"]

log = logging.getLogger("trainguard.launcher")

ENV_FD = "TRAINGUARD_HEARTBEAT_FD"
KINDS = ("resumed", "step", "save", "saved", "done")
_MAX_LINE = 64  # longer is not a line a worker wrote


@dataclass(frozen=True)
class StepEvent:
    kind: str
    step: int


class StepPipe:
    """The worker's end: :meth:`send` one event, never blocking.

    Args:
        fd: the inherited write end.
    """

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        os.set_blocking(fd, False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "StepPipe | None":
        """The pipe the launcher gave this worker (``None``: not launched by it).

        Raises:
            ValueError: ``TRAINGUARD_HEARTBEAT_FD`` is not an open descriptor.
        """
        value = (os.environ if environ is None else environ).get(ENV_FD, "").strip()
        if not value:
            return None
        if not value.isdigit():
            raise ValueError(f"{ENV_FD}={value!r} is not a file descriptor")
        fd = int(value)
        try:
            os.fstat(fd)
        except OSError:
            raise ValueError(f"{ENV_FD}={fd} is not an open file descriptor (set by trainguard run "
                             f"--framework tensorflow; do not set it by hand)") from None
        return cls(fd)

    def send(self, kind: str, step: int) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, f"{kind} {int(step)}\n".encode())
        except BlockingIOError:
            pass  # the launcher is behind: a later line says more
        except OSError as e:  # EPIPE: the launcher is gone; the worker trains on unwatched
            log.warning("the launcher no longer reads this worker's progress (%s)", e.strerror or e)
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class StepReader:
    """The launcher's end of one worker's pipe.

    Args:
        fd: the read end (made non-blocking here).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._partial = b""
        self.closed = False

    def read(self) -> list[StepEvent]:
        """The events that arrived since the last call (none when closed)."""
        if self.closed:
            return []
        data = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:  # every write end closed: the worker is gone
                self.close()
                break
            data += chunk
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > _MAX_LINE:
            self._partial = b""
        return [e for e in map(_parse, lines) if e is not None]

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
            self.closed = True


def _parse(line: bytes) -> StepEvent | None:
    kind, _, step = line.decode("ascii", "replace").strip().partition(" ")
    if kind not in KINDS or not step.isdigit() or len(line) > _MAX_LINE:
        log.debug("ignoring a malformed progress line %r", line[:_MAX_LINE])
        return None
    return StepEvent(kind, int(step))
