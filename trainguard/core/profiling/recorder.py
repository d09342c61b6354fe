"""One rank's marker recorder: the switch, an in-memory buffer, a writer thread.

Adapters read two plain attributes on the hot path, :attr:`Recorder.markers`
and :attr:`Recorder.communication`, and call :meth:`Recorder.add` with a
span they timed. Everything else -- polling the switch file, turning
records into JSON lines, writing, starting new files, ageing old ones --
happens on the recorder's thread, twice a second, so a change of the switch
shows on disk within about a second and a half.

Each record is one JSON object per line::

    {"name": "Step", "rank": 3, "step": 120, "start": 1732345678.123456, "dur": 0.2034}
    {"name": "Communication", "rank": 3, "step": 120, "start": ..., "dur": ..., "op": "allreduce",
     "group": "0", "bytes": 4194304}

``step`` is the number of updates completed before the span began (the loop
index), ``start`` Unix seconds and ``dur`` seconds. The settings,
:class:`ProfilingConfig`, are read in :mod:`trainguard.core.config_profiling`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from ..config_profiling import ProfilingConfig, job_id_from_env
from .files import RankFiles
from .switch import Switch, SwitchFile

__all__ = ["MARKERS", "ProfilingConfig", "Recorder", "job_id_from_env", "recorder_from_env"]

log = logging.getLogger("trainguard.profiling")

#: Record names.
MARKERS = ("Step", "FP", "DataLoader", "SaveCheckpoint", "Communication")
#: Records held in memory at most; past it new ones are dropped and counted
#: (a writer that cannot keep up must not eat the host's memory).
MAX_BUFFERED = 1 << 20


@dataclass
class _Counters:
    written: int = 0
    dropped: int = 0
    write_errors: int = 0
    by_name: dict = field(default_factory=dict)


class Recorder:
    """Records one rank's spans while the switch says so.

    Args:
        config: where and how.
        clock: wall time (injected for tests).
    """

    def __init__(self, config: ProfilingConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.rank = config.rank
        self.switch = SwitchFile(config.switch_path, rank=config.rank)
        self.files = RankFiles(config.directory, config.job_id, config.rank,
                               file_bytes=int(config.file_mb * (1 << 20)), cap_bytes=int(config.cap_mb * (1 << 20)),
                               clock=clock)
        #: Read on the hot path: Step/FP/DataLoader/SaveCheckpoint on.
        self.markers = False
        #: Read on the hot path: Communication on.
        self.communication = False
        self.counters = _Counters()
        # A deque: spans arrive from other threads too (a collective's completion callback).
        self._buffer: deque[tuple] = deque()
        self._groups: dict[str, dict] = {}
        self._groups_written = 0
        self._lock = threading.Lock()  # one writer at a time (the thread, or close)
        self._stop = threading.Event()
        self._write_error = ""
        self._next_disk_check = 0.0
        self._thread: threading.Thread | None = None
        self.apply(self.switch.poll())

    def start(self) -> "Recorder":
        self._thread = threading.Thread(target=self._run, name="trainguard-profiling", daemon=True)
        self._thread.start()
        return self

    # --------------------------------------------------------- hot path
    def add(self, name: str, step: int, start: float, dur: float, extra: dict | None = None) -> None:
        """Buffer one span (``start`` Unix seconds, ``dur`` seconds)."""
        if len(self._buffer) >= MAX_BUFFERED:
            self.counters.dropped += 1
            return
        self._buffer.append((name, step, start, dur, extra))

    @contextmanager
    def span(self, name: str, step: int, **extra: Any) -> Iterator[None]:
        """Time a block as one record (when markers are on)."""
        if not self.markers:
            yield
            return
        start = time.time()
        try:
            yield
        finally:
            self.add(name, step, start, time.time() - start, extra or None)

    def group(self, name: str, ranks: list[int], backend: str = "") -> None:
        """Note which global ranks a communication group holds (written to
        ``parallel_group.json``)."""
        if name not in self._groups:
            self._groups[name] = {"global_ranks": list(ranks), "backend": backend}

    # ------------------------------------------------------- the thread
    def apply(self, switch: Switch) -> None:
        self.markers, self.communication = switch.markers, switch.communication

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_s):
            self.apply(self.switch.poll())
            self.flush()
            now = time.monotonic()
            if now >= self._next_disk_check:
                self._next_disk_check = now + self.config.disk_check_s
                try:
                    self.files.age()
                except OSError as e:
                    log.warning("rank %d: ageing profiling files failed: %s", self.rank, e)

    def flush(self) -> None:
        """Write what is buffered (called by the thread; safe to call any time)."""
        with self._lock:
            batch = [self._buffer.popleft() for _ in range(len(self._buffer))]
            if len(self._groups) != self._groups_written:
                try:
                    self.files.write_groups(dict(self._groups))
                    self._groups_written = len(self._groups)
                except OSError as e:
                    self._error(e)
            if not batch:
                return
            rank = self.rank
            lines = []
            for name, step, start, dur, extra in batch:
                record = {"name": name, "rank": rank, "step": step, "start": round(start, 6), "dur": round(dur, 7)}
                if extra:
                    record.update(extra)
                lines.append(json.dumps(record, separators=(",", ":")))
                self.counters.by_name[name] = self.counters.by_name.get(name, 0) + 1
            try:
                self.files.append(("\n".join(lines) + "\n").encode())
            except OSError as e:
                self.counters.write_errors += len(batch)
                self._error(e)
            else:
                self.counters.written += len(batch)
                if self._write_error:
                    log.warning("rank %d: profiling records are written again", self.rank)
                    self._write_error = ""

    def _error(self, e: OSError) -> None:
        if not self._write_error:
            log.warning("rank %d: cannot write profiling records to %s (%s); they are dropped until it works "
                        "again", self.rank, self.files.dir, e)
        self._write_error = str(e)

    def close(self) -> None:
        """Stop the thread and write what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush()

    def report(self) -> dict:
        """What was recorded (after writing what is buffered)."""
        self.flush()
        return {"directory": str(self.files.dir), "switch": self.switch.current.describe(),
                "records_written": self.counters.written, "records_dropped": self.counters.dropped,
                "write_errors": self.counters.write_errors, "files_aged_out": self.files.deleted,
                "by_name": dict(self.counters.by_name)}


def recorder_from_env(*, rank: int, started_at: float, directory: str | os.PathLike | None = None,
                      environ: Mapping[str, str] | None = None) -> Recorder | None:
    """A started recorder when profiling is configured, else ``None``."""
    config = ProfilingConfig.from_env(rank=rank, started_at=started_at, environ=environ, directory=directory)
    return Recorder(config).start() if config is not None else None

