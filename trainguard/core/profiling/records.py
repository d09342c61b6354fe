"""Reading profiling records back: per rank, per step, what took how long.

A step's row holds the Step span, and the sums of its FP, DataLoader and
SaveCheckpoint spans. Communication wait is the *union* of the step's
collective spans (from issue to completion): DDP's bucket all-reduces
overlap each other and the backward pass, and what matters is how long the
rank had something outstanding -- a rank whose peers are late has its
collectives outstanding for longer. ``compute`` is the step minus that wait.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..api import ConfigError
from .files import numbered_files

__all__ = ["RowBuilder", "StepRow", "Tail", "find_job_dir", "load_rows", "rows_from_records"]


@dataclass
class StepRow:
    """One rank's step (seconds)."""

    step: int
    step_s: float = 0.0
    fp_s: float = 0.0
    data_s: float = 0.0
    save_s: float = 0.0
    comm_spans: list = field(default_factory=list)
    has_step: bool = False

    @property
    def comm_s(self) -> float:
        """Time with at least one collective outstanding."""
        total, end = 0.0, float("-inf")
        for a, b in sorted(self.comm_spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.comm_s)


class RowBuilder:
    """Folds one rank's records, in the order written, into rows by step.

    A rank writes a step's spans before the step's own ``Step`` record, so
    spans wait in an open row until it comes. A step run again (a recovery
    or a relaunch replays it) keeps its last run. A collective that completed
    after its step's record (an asynchronous one waited on later) joins it.
    """

    def __init__(self) -> None:
        self.rows: dict[int, StepRow] = {}
        self._open: dict[int, StepRow] = {}

    def add(self, rec: dict) -> int | None:
        """Take one record; returns the step it completed, if a Step record."""
        step, name, dur = rec.get("step"), rec.get("name"), rec.get("dur")
        if not isinstance(step, int) or isinstance(dur, bool) or not isinstance(dur, (int, float)):
            return None
        if name == "Step":
            row = self._open.pop(step, None) or StepRow(step)
            row.step_s, row.has_step = float(dur), True
            self.rows[step] = row
            return step
        if name == "Communication" and step in self.rows and step not in self._open:
            row = self.rows[step]
        else:
            row = self._open.setdefault(step, StepRow(step))
        if name == "FP":
            row.fp_s += dur
        elif name == "DataLoader":
            row.data_s += dur
        elif name == "SaveCheckpoint":
            row.save_s += dur
        elif name == "Communication":
            start = float(rec.get("start", 0.0))
            row.comm_spans.append((start, start + dur))
        return None


    def forget(self, step: int) -> None:
        """Drop a step no longer needed (live detection keeps a window)."""
        self.rows.pop(step, None)
        self._open.pop(step, None)


def rows_from_records(records: Iterable[dict]) -> dict[int, StepRow]:
    """One rank's completed steps, by step."""
    builder = RowBuilder()
    for rec in records:
        builder.add(rec)
    return builder.rows


class Tail:
    """Reads a rank directory's records incrementally (for live detection):
    each call returns the whole lines appended since the last one."""

    def __init__(self, rank_dir: Path) -> None:
        self.dir = rank_dir
        self._offsets: dict[str, int] = {}
        self.bad_lines = 0

    def read(self) -> list[dict]:
        out: list[dict] = []
        for path in numbered_files(self.dir):
            offset = self._offsets.get(path.name, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
            self._offsets[path.name] = offset + end
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    self.bad_lines += 1
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
                else:
                    self.bad_lines += 1
        return out


def rank_dirs(job_dir: Path) -> dict[int, Path]:
    try:
        return {int(e.name): Path(e.path) for e in os.scandir(job_dir) if e.name.isdigit() and e.is_dir()}
    except FileNotFoundError:
        return {}


def find_job_dir(path: str | os.PathLike, job: str | None = None) -> Path:
    """The job directory meant by ``path``: the profiling root (with
    ``job``, or holding one job) or a job directory itself.

    Raises:
        ConfigError: nothing there, or several jobs and none chosen.
    """
    path = Path(path)
    if job is not None:
        path = path / job
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory")
    if rank_dirs(path):
        return path
    jobs = sorted(p.name for p in path.iterdir() if p.is_dir() and rank_dirs(p))
    if len(jobs) == 1:
        return path / jobs[0]
    if not jobs:
        raise ConfigError(f"no profiling records under {path} (expected <job id>/<rank>/<timestamp> files)")
    raise ConfigError(f"{path} holds several jobs ({', '.join(jobs)}); choose one with --job")


def load_rows(job_dir: Path) -> tuple[dict[int, dict[int, StepRow]], int]:
    """Every rank's rows, and the number of unreadable lines skipped."""
    out, bad = {}, 0
    for rank, directory in sorted(rank_dirs(job_dir).items()):
        tail = Tail(directory)
        out[rank] = rows_from_records(tail.read())
        bad += tail.bad_lines
    return out, bad
