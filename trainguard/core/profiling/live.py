"""Slow-node detection while the job runs, beside the controller.

A thread follows the job's record files as the ranks append to them (each
poll reads only what was added), folds them into step rows, and feeds every
step that all ranks have finished -- or that one rank is ``lag_steps`` past,
so a dead rank does not stall the check -- to the same :class:`Detector`
``trainguard slow-nodes`` runs. A new finding is logged as a warning, kept
for ``trainguard status``, and written to ``<dir>/<job id>/slow_nodes.json``.

It reads the files the ranks write, so it sees the ranks whose profiling
directory the controller's machine can read (all of them on shared storage).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Mapping

from ..config_profiling import ProfilingConfig
from .detect import Detector, DetectorConfig, Finding
from .records import RowBuilder, Tail, rank_dirs

__all__ = ["LiveDetector"]

log = logging.getLogger("trainguard.profiling")

REPORT_FILE = "slow_nodes.json"


class LiveDetector:
    """Follows one job's records and reports slow ranks.

    Args:
        job_dir: ``<profiling dir>/<job id>``.
        world_size: ranks expected (steps are compared once all have them).
        config: detection thresholds.
        poll_s: seconds between reads.
        lag_steps: compare a step without the ranks that are this far behind.
    """

    def __init__(self, job_dir: str | os.PathLike, world_size: int, *, config: DetectorConfig = DetectorConfig(),
                 poll_s: float = 2.0, lag_steps: int = 20, on_job_wide: Callable[[Finding], None] | None = None
                 ) -> None:
        self.job_dir = Path(job_dir)
        self.world_size = world_size
        self.detector = Detector(list(range(world_size)), config)
        self.poll_s, self.lag_steps = poll_s, lag_steps
        self._tails: dict[int, Tail] = {}
        self._builders = {r: RowBuilder() for r in range(world_size)}
        self._next_step = 0
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # the watch and the controller's loop both write the report
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Told of a job-wide slowdown of the steps, not of compute (from the
        #: watch's thread): the controller then surveys the links.
        self.on_job_wide = on_job_wide
        self.links: list[dict] = []  # the link surveys' verdicts, newest last

    @classmethod
    def from_env(cls, job_id: str, world_size: int,
                 environ: Mapping[str, str] | None = None) -> "LiveDetector | None":
        """A detector for the job when ``TRAINGUARD_PROFILING_DIR`` is set
        (:meth:`~trainguard.core.config_profiling.ProfilingConfig.job_dir_from_env`)."""
        job_dir = ProfilingConfig.job_dir_from_env(job_id, environ)
        return cls(job_dir, world_size) if job_dir is not None else None

    def start(self) -> "LiveDetector":
        self._thread = threading.Thread(target=self._run, name="trainguard-slow-nodes", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # a bad file must not end the watch; say so and go on
                log.exception("live slow-node detection failed on %s", self.job_dir)

    def poll(self) -> list[Finding]:
        """Read what was appended, compare the steps now complete, and
        report new findings."""
        for rank, directory in rank_dirs(self.job_dir).items():
            if rank in self._builders and rank not in self._tails:
                self._tails[rank] = Tail(directory)
        for rank, tail in self._tails.items():
            for rec in tail.read():
                self._builders[rank].add(rec)
        new: list[Finding] = []
        rows = {r: b.rows for r, b in self._builders.items()}
        newest = max((max(by_step, default=-1) for by_step in rows.values()), default=-1)
        while self._next_step <= newest:
            step = self._next_step
            have = {r: by_step[step] for r, by_step in rows.items() if step in by_step}
            if len(have) < self.world_size and newest - step < self.lag_steps:
                break
            with self._lock:
                new += self.detector.feed(step, have)
            for builder in self._builders.values():
                builder.forget(step - self.detector.config.long_window)  # older than any window
            self._next_step += 1
        for finding in new:
            log.warning("slow node: step %d: %s (%s)", finding.step, finding.reason, finding.how)
            if finding.how == "job-wide" and finding.metric == "step" and self.on_job_wide is not None:
                self.on_job_wide(finding)
        if new:
            self._write()
        return new

    def status(self) -> dict:
        """For ``trainguard status``."""
        with self._lock:
            return {"job_dir": str(self.job_dir), "steps_compared": self.detector.steps_seen,
                    "slow_ranks": sorted(self.detector.slow),
                    "findings": [f.to_dict() for f in self.detector.findings], "links": list(self.links)}

    def note_links(self, verdict: dict) -> None:
        """A link survey's verdict: kept (the last 20) with the findings and written."""
        with self._lock:
            self.links = [*self.links[-19:], verdict]
        self._write()

    def _write(self) -> None:
        path = self.job_dir / REPORT_FILE
        tmp = self.job_dir / f".{REPORT_FILE}.tmp"
        try:
            with self._write_lock:
                tmp.write_text(json.dumps(self.status(), indent=1))
                os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot write %s: %s", path, e)
